"""Fake-quant FP8 (and FP4) linear layers for the CPU learner, emulating TE's recipes GEMM by GEMM.

Like TE, every GEMM consumes FP8 operands with fp32 accumulation (here: dequantized values and
an fp32 matmul):

    fprop  Y  = X_row(E4M3) @ W_fprop(E4M3)^T
    dgrad  dX = dY_row(G) @ W_dgrad(E4M3)
    wgrad  dW = dY_col(G)^T @ X_col(E4M3)

with G = E5M2 under the hybrid format and E4M3 under e4m3. Row-wise copies of X and dY are
scaled along the contraction dim of fprop/dgrad, column-wise copies along tokens (the wgrad
contraction), both quantized from high precision as TE does. For per-tensor recipes
(tensorwise, delayed) both copies are the same values. The bias gradient is taken from the
high-precision dY (TE fuses it into the quantization of dY).

The FP4 recipes (nvfp4, mxfp4) plug their own operand rules into the same GEMMs through
`make_quantizer` (precision/fp4_linear.py).

The megatron subclasses override ``_forward_impl``, the hook ColumnParallelLinear and
RowParallelLinear call with the arguments of linear_with_grad_accumulation_and_async_allreduce,
so their TP/SP communication (input copy, all-gather, dgrad all-reduce, reduce-scatter) is kept
and mirrored inside the fake-quant autograd function.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.precision import numerics as nx
from megatron_rl.precision.state import high_precision_active

Block = tuple[int, int]


class ModuleQuantizer:
    """Per-module FP8 state and rules of one recipe: which blocks each operand uses, delayed scalers."""

    def __init__(self, cfg: PrecisionConfig):
        """Quantizer for cfg.recipe (delayed scaling keeps one amax history per operand role)."""
        if cfg.recipe == "none":
            raise ValueError("ModuleQuantizer needs an FP8 recipe, got recipe='none'")
        self.recipe = cfg.recipe
        self.fwd_fmt: nx.Fp8Format = "e4m3"
        self.grad_fmt: nx.Fp8Format = "e5m2" if cfg.fp8_format == "hybrid" else "e4m3"
        self.power_of_two = bool(cfg.power_of_two_scales)
        self.delayed: dict[str, nx.DelayedScaler] = {}
        self.amax_group = None
        """Delayed scaling: process group whose ranks share one scale per role (TE's reduce_amax), or None."""
        self.scale_book = None
        """precision/scale_book.py ScaleBook (ratio_consistent_scales, tensorwise): pi_old's amaxes to reuse, or None."""
        if self.recipe == "delayed":
            for role, fmt in (("input", self.fwd_fmt), ("weight", self.fwd_fmt), ("grad", self.grad_fmt)):
                self.delayed[role] = nx.DelayedScaler(fmt, cfg.amax_history_len, cfg.amax_compute_algo, cfg.margin)

    def _per_tensor(self, role: str, x: torch.Tensor, fmt: nx.Fp8Format, update: bool, amax: Optional[torch.Tensor]) -> torch.Tensor:
        """Dequantized per-tensor quantization (delayed or current scaling)."""
        if self.recipe == "delayed":
            if update and self.amax_group is not None:
                local = nx.tensor_amax(x) if amax is None else amax
                amax = local.reshape(1).clone()
                torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=self.amax_group)
            return self.delayed[role].fake_quantize(x, update=update, amax=amax)
        if self.scale_book is not None:
            amax = self.scale_book.amax(id(self), role, x, amax)
        return nx.fake_quantize_current(x, fmt, amax=amax)

    def _blocks(self, x: torch.Tensor, block: Block, fmt: nx.Fp8Format) -> torch.Tensor:
        """Dequantized block-scaled quantization (blockwise or mxfp8)."""
        if self.recipe == "mxfp8":
            return nx.fake_quantize_mxfp8(x, fmt, block)
        return nx.fake_quantize_blockwise_te(x, block, fmt, power_of_two=self.power_of_two)

    def _block_len(self) -> int:
        """1-D block length of the recipe (128 blockwise, 32 MXFP8)."""
        return 32 if self.recipe == "mxfp8" else 128

    def operand_pair(self, role: str, x2d: torch.Tensor, fmt: nx.Fp8Format, update: bool = True,
                     amax: Optional[torch.Tensor] = None, columnwise: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(row-wise, column-wise) dequantized copies of a [tokens, features] activation or gradient (column-wise None unless wanted)."""
        if self.recipe in ("delayed", "tensorwise"):
            q = self._per_tensor(role, x2d, fmt, update, amax)
            return q, q
        n = self._block_len()
        return self._blocks(x2d, (1, n), fmt), self._blocks(x2d, (n, 1), fmt) if columnwise else None

    def weight_pair(self, w: torch.Tensor, update: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(fprop, dgrad) dequantized copies of a [out, in] weight."""
        if self.recipe in ("delayed", "tensorwise"):
            q = self._per_tensor("weight", w, self.fwd_fmt, update, None)
            return q, q
        if self.recipe == "blockwise":
            q = self._blocks(w, (128, 128), self.fwd_fmt)
            return q, q
        # MXFP8 weights: 1x32 along `in` for fprop, 32x1 along `out` for dgrad.
        return self._blocks(w, (1, 32), self.fwd_fmt), self._blocks(w, (32, 1), self.fwd_fmt)

    def state_dict(self) -> dict:
        """Delayed-scaling histories and scales (empty for stateless recipes)."""
        return {k: v.state_dict() for k, v in self.delayed.items()}

    def load_state_dict(self, state: dict) -> None:
        """Restore delayed-scaling state."""
        for k, v in state.items():
            self.delayed[k].load_state_dict(v)


def make_quantizer(cfg: PrecisionConfig):
    """The per-module quantizer of cfg.recipe: FP8 recipes share ModuleQuantizer, FP4 recipes use Fp4ModuleQuantizer."""
    if cfg.fp4_enabled:
        from megatron_rl.precision.fp4_linear import Fp4ModuleQuantizer

        return Fp4ModuleQuantizer(cfg)
    return ModuleQuantizer(cfg)


def _tp_amax(x: torch.Tensor, group) -> torch.Tensor:
    """Max |x| over the TP group (TE reduces amax across TP for sequence-parallel inputs)."""
    amax = nx.tensor_amax(x).reshape(1)
    torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    return amax.reshape(())


def _gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 over the TP group (sequence parallel)."""
    size = torch.distributed.get_world_size(group)
    out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Reduce-scatter along dim 0 over the TP group (sequence-parallel dgrad)."""
    size = torch.distributed.get_world_size(group)
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    torch.distributed.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class FakeQuantLinearFunction(torch.autograd.Function):
    """Y = X W^T (+ b) with FP8 fake-quantized operands in all three GEMMs, plus megatron's TP comms."""

    @staticmethod
    def forward(ctx, input, weight, bias, quant: ModuleQuantizer, allreduce_dgrad: bool = False,
                sequence_parallel: bool = False, tp_group=None, gradient_accumulation_fusion: bool = False,
                wgrad: bool = True):
        """fprop GEMM on dequantized E4M3 operands, fp32 accumulate, output in input's dtype.

        `wgrad` False (a forward-only pass: grad mode off or a frozen weight) skips the column-wise
        copy of the input, which only the wgrad GEMM reads.
        """
        total = _gather_first_dim(input, tp_group) if sequence_parallel else input
        x2d = total.reshape(-1, total.shape[-1])
        amax = _tp_amax(input, tp_group) if sequence_parallel and quant.recipe in ("delayed", "tensorwise") else None
        x_row, x_col = quant.operand_pair("input", x2d, quant.fwd_fmt, amax=amax, columnwise=wgrad)
        w_fprop, w_dgrad = quant.weight_pair(weight)
        out = (x_row @ w_fprop.t()).to(input.dtype)
        out = out.reshape(*total.shape[:-1], weight.shape[0])
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(x_col, w_dgrad, weight)
        ctx.quant = quant
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.tp_group = tp_group
        ctx.fusion = gradient_accumulation_fusion
        ctx.in_shape = total.shape
        ctx.in_dtype = input.dtype
        return out

    @staticmethod
    def backward(ctx, grad_output):
        """dgrad and wgrad GEMMs on quantized dY (E5M2 under hybrid), then megatron's dgrad comms."""
        x_col, w_dgrad, weight = ctx.saved_tensors
        quant: ModuleQuantizer = ctx.quant
        dy2d = grad_output.reshape(-1, grad_output.shape[-1])
        dy_row, dy_col = quant.operand_pair("grad", dy2d, quant.grad_fmt, columnwise=ctx.needs_input_grad[1])
        grad_input = (dy_row @ w_dgrad).to(ctx.in_dtype).reshape(ctx.in_shape)
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        if ctx.sequence_parallel:
            grad_input = _reduce_scatter_first_dim(grad_input, ctx.tp_group)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (dy_col.t() @ x_col).to(weight.dtype)
            if ctx.fusion and hasattr(weight, "main_grad"):
                # megatron's DDP skips param.grad when grad_added_to_main_grad is set.
                weight.main_grad.add_(grad_weight.to(weight.main_grad.dtype))
                weight.grad_added_to_main_grad = True
                grad_weight = torch.zeros_like(weight)
        grad_bias = dy2d.sum(dim=0).to(grad_output.dtype) if ctx.use_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def _wgrad_needed(weight: torch.Tensor) -> bool:
    """Whether a wgrad GEMM can follow this forward (autograd.Function.forward cannot see the caller's grad mode)."""
    return torch.is_grad_enabled() and weight.requires_grad


def fake_quant_linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], quant: ModuleQuantizer) -> torch.Tensor:
    """Single-process FP8 fake-quant linear (no TP communication)."""
    return FakeQuantLinearFunction.apply(input, weight, bias, quant, False, False, None, False, _wgrad_needed(weight))


class FakeQuantLinear(torch.nn.Linear):
    """torch.nn.Linear whose GEMMs are FP8 fake-quantized with a recipe (off inside high_precision())."""

    def __init__(self, in_features: int, out_features: int, cfg: PrecisionConfig, bias: bool = True, **kwargs):
        """nn.Linear plus its own ModuleQuantizer."""
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.fp8_quant = make_quantizer(cfg)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Fake-quant linear, or the plain linear inside high_precision()."""
        if high_precision_active():
            return torch.nn.functional.linear(input, self.weight, self.bias)
        return fake_quant_linear(input, self.weight, self.bias, self.fp8_quant)


class _Fp8ParallelMixin:
    """Routes megatron's _forward_impl through the fake-quant GEMM unless high_precision() is active."""

    fp8_policy: Optional[PrecisionConfig] = None

    def _init_fp8(self) -> None:
        """Attach the per-module quantizer (delayed-scaling state lives here)."""
        self.fp8_quant = make_quantizer(self.fp8_policy)
        if self.fp8_policy.recipe == "delayed":
            from megatron.core import parallel_state

            # as megatron's get_fp8_context: TP x DP x CP ranks share delayed scales
            if parallel_state.model_parallel_is_initialized():
                group = parallel_state.get_amax_reduction_group(with_context_parallel=True)
                if torch.distributed.get_world_size(group) > 1:
                    self.fp8_quant.amax_group = group

    def get_extra_state(self) -> Optional[dict]:
        """Delayed-scaling histories and scales, FP4 stream positions (None for stateless recipes): checkpointed as TE's _extra_state is."""
        return self.fp8_quant.state_dict() or None

    def set_extra_state(self, state) -> None:
        """Restore what get_extra_state saved (None: a stateless recipe, or a checkpoint from one)."""
        if state:
            self.fp8_quant.load_state_dict(state)

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None, **kwargs):
        """Same contract as linear_with_grad_accumulation_and_async_allreduce, FP8-emulated."""
        if high_precision_active():
            return super()._forward_impl(
                input, weight, bias=bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit, tp_group=tp_group, **kwargs)
        if grad_output_buffer is not None:
            raise NotImplementedError("deferred embedding wgrad is not supported by FP8 transformer linears")
        from megatron.core.utils import get_tensor_model_parallel_group_if_none

        if allreduce_dgrad or sequence_parallel:
            tp_group = get_tensor_model_parallel_group_if_none(tp_group if tp_group is not None else getattr(self, "tp_group", None))
        return FakeQuantLinearFunction.apply(input, weight, bias, self.fp8_quant, allreduce_dgrad, sequence_parallel,
                                             tp_group, gradient_accumulation_fusion, _wgrad_needed(weight))


@functools.lru_cache(maxsize=None)
def _fp8_classes(cfg_json: str):
    """Column/row subclasses bound to one policy (cached so equal policies share classes)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    cfg = PrecisionConfig.model_validate_json(cfg_json)

    class Fp8ColumnParallelLinear(_Fp8ParallelMixin, ColumnParallelLinear):
        """ColumnParallelLinear with emulated FP8 GEMMs."""

        fp8_policy = cfg

        def __init__(self, *args, **kwargs):
            """ColumnParallelLinear's constructor, plus the FP8 quantizer."""
            super().__init__(*args, **kwargs)
            self._init_fp8()

    class Fp8RowParallelLinear(_Fp8ParallelMixin, RowParallelLinear):
        """RowParallelLinear with emulated FP8 GEMMs."""

        fp8_policy = cfg

        def __init__(self, *args, **kwargs):
            """RowParallelLinear's constructor, plus the FP8 quantizer."""
            super().__init__(*args, **kwargs)
            self._init_fp8()

    return Fp8ColumnParallelLinear, Fp8RowParallelLinear


def fp8_parallel_linear_classes(cfg: PrecisionConfig):
    """(Fp8ColumnParallelLinear, Fp8RowParallelLinear) subclasses carrying cfg's recipe."""
    return _fp8_classes(cfg.model_dump_json())
