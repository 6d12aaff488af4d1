"""Build the learner's megatron GPTModel chunks (one per virtual pipeline stage), wrapped in megatron DDP.

All CPU/gloo correctness settings are pinned in `build_transformer_config` (one place):
batch_p2p_comm off (on gloo batched isend/irecv match in the wrong order under VPP),
per-token-loss mode with our own finalize_model_grads_func (the loss arrives in global sum
form, so megatron must neither divide by micro-batch count nor average over DP), CPU initialisation.

What depends on the device is one `LearnerKernels`, decided once from the Learner's DeviceFacts
(`learner_kernels`) and passed to `build_transformer_config` and `wrap_ddp`. On a GPU with Transformer
Engine it is what megatron's own recipes run (megatron-core 0.16.1 megatron/training/arguments.py turns
every fusion on by default: --no-bias-swiglu-fusion, --no-bias-dropout-fusion, --no-masked-softmax-fusion,
--no-rope-fusion, --no-persist-layer-norm, --no-gradient-accumulation-fusion are opt-outs;
examples/llama/train_llama3_8b_h100_fp8.sh adds --overlap-grad-reduce --overlap-param-gather with the
distributed optimizer): the TE spec, the fused bias-activation / bias-dropout-add / masked-softmax / RoPE /
persistent-layer-norm kernels, gradient-accumulation fusion (TE's linears fuse it themselves; megatron's
own output layer needs apex's fused_weight_gradient_mlp_cuda, so it is on only where that imports), and
gradient reduce-scatter / parameter all-gather overlapped with backward / forward. On CPU (and on a GPU
without TE) all of it is off: those kernels need CUDA, and the unfused paths are the numerical reference.
Cross-entropy loss fusion does not apply: the learner computes log-probs itself from the logits
(trainer/logprobs.py), megatron's fused cross entropy only serves GPTModel's own loss.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from megatron_rl.config.model import OptimConfig, ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.models.presets import Architecture, gpt_model_kwargs, transformer_config_kwargs
from megatron_rl.parallel.compat import run_without_compat_mode
from megatron_rl.trainer.spec import block_spec, uses_te_spec

FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "apply_rope_fusion",
           "persist_layer_norm")
"""megatron TransformerConfig fusion flags LearnerKernels.fusions switches together."""


@dataclass(frozen=True)
class LearnerKernels:
    """The device-dependent way the learner runs (all off: CPU); built by `learner_kernels` from DeviceFacts."""

    te_spec: bool = False
    """megatron's Transformer Engine layer spec (else the local spec)."""
    fusions: bool = False
    """The FUSIONS kernels (bias + SwiGLU, bias + dropout + add, masked softmax, RoPE, persistent layer norm)."""
    gradient_accumulation_fusion: bool = False
    """Weight gradients accumulated into main_grad inside the GEMM (TE linears; megatron's output layer via apex)."""
    overlap_grad_reduce: bool = False
    """DDP gradient reduce-scatter / all-reduce overlapped with the backward pass (bucketed)."""
    overlap_param_gather: bool = False
    """Distributed optimizer: parameter all-gather overlapped with the next forward (Learner.finish_param_sync)."""

    def transformer_config_kwargs(self) -> dict[str, bool]:
        """The TransformerConfig fields these choices set."""
        return {**{name: self.fusions for name in FUSIONS}, "gradient_accumulation_fusion": self.gradient_accumulation_fusion}

    def ddp_config_kwargs(self) -> dict[str, bool]:
        """The DistributedDataParallelConfig fields these choices set."""
        return {"overlap_grad_reduce": self.overlap_grad_reduce, "overlap_param_gather": self.overlap_param_gather}

    def describe(self, apex_known: bool = True) -> list[str]:
        """One line per choice, on or off, for `megatron-rl plan` and logs (`apex_known=False`: the machine that will
        run it is not this one, so gradient-accumulation fusion is stated with its condition)."""
        on = lambda flag: "on" if flag else "off"  # noqa: E731
        gaf = on(self.gradient_accumulation_fusion)
        if not apex_known and self.te_spec:
            gaf = "on where apex's fused_weight_gradient_mlp_cuda imports (megatron's output layer needs it), else off"
        return [f"layer spec: {'Transformer Engine' if self.te_spec else 'local (torch SDPA, emulated FP8)'}",
                f"fusions ({', '.join(FUSIONS)}): {on(self.fusions)}",
                f"gradient_accumulation_fusion: {gaf}",
                f"overlap_grad_reduce: {on(self.overlap_grad_reduce)}; overlap_param_gather: {on(self.overlap_param_gather)}",
                "cross-entropy loss fusion: not applicable (log-probs are computed from the logits by trainer/logprobs.py)"]

    def as_dict(self) -> dict[str, bool]:
        """Plain fields (JSON)."""
        return asdict(self)


def learner_kernels(facts, parallel_cfg: ParallelConfig) -> LearnerKernels:
    """LearnerKernels for a learner on the device `facts` describes (precision/device.py DeviceFacts): megatron's
    recipe settings on a GPU with Transformer Engine, everything off elsewhere. Parameter-gather overlap needs the
    distributed optimizer (megatron asserts it), gradient-accumulation fusion apex's wgrad kernel for the output layer."""
    te = uses_te_spec(facts)
    return LearnerKernels(te_spec=te, fusions=te, gradient_accumulation_fusion=te and bool(facts.apex_wgrad),
                          overlap_grad_reduce=te, overlap_param_gather=te and parallel_cfg.use_distributed_optimizer)


def finalize_grads_sum_form(model: list, num_tokens: Optional[torch.Tensor] = None, **kwargs: Any) -> None:
    """megatron's finalize_model_grads without the 1/num_tokens scaling (losses are already global sums)."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)


def build_transformer_config(
    arch: Architecture,
    parallel_cfg: ParallelConfig,
    optim_cfg: OptimConfig,
    precision_cfg: PrecisionConfig,
    on_gpu: Optional[bool] = None,
    kernels: Optional[LearnerKernels] = None,
):
    """TransformerConfig for `arch` under the parallel layout, with the CPU correctness settings pinned and the
    device-dependent kernels of `kernels` (default: all off)."""
    from megatron.core.transformer import TransformerConfig

    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if optim_cfg.params_dtype == "bf16" else torch.float32
    pp = parallel_cfg.pipeline_model_parallel_size
    vpp = parallel_cfg.virtual_pipeline_model_parallel_size
    if arch.num_layers % (pp * (vpp or 1)) != 0:
        raise ValueError(
            f"model.num_layers={arch.num_layers} must be divisible by parallel.pipeline_model_parallel_size * "
            f"virtual_pipeline_model_parallel_size = {pp * (vpp or 1)}"
        )
    tp = parallel_cfg.tensor_model_parallel_size
    for field, value in (("num_attention_heads", arch.num_attention_heads), ("num_query_groups", arch.num_query_groups),
                         ("vocab_size", arch.vocab_size), ("ffn_hidden_size", arch.ffn_hidden_size)):
        if value % tp != 0:
            raise ValueError(f"model {field}={value} must be divisible by parallel.tensor_model_parallel_size={tp}")
    kwargs = transformer_config_kwargs(arch)
    kwargs.update(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=parallel_cfg.context_parallel_size,
        sequence_parallel=parallel_cfg.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # Sum-form losses: see finalize_grads_sum_form.
        calculate_per_token_loss=True,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        batch_p2p_comm=on_gpu or vpp is None,
        deallocate_pipeline_outputs=on_gpu,
        # megatron's default "full" is deprecated (with a warning) in favour of [], which means the same: the whole layer
        cuda_graph_scope=[],
    )
    kwargs.update((kernels or LearnerKernels()).transformer_config_kwargs())
    if on_gpu:
        # FP8 on GPU is Transformer Engine's, configured through TransformerConfig (precision/te.py).
        from megatron_rl.precision.te import transformer_config_kwargs as te_fp8_kwargs

        kwargs.update(te_fp8_kwargs(precision_cfg))
    config = TransformerConfig(**kwargs)
    config.finalize_model_grads_func = finalize_grads_sum_form
    return config


def build_model_chunks(arch: Architecture, config: Any, precision_cfg: PrecisionConfig,
                       use_te: Optional[bool] = None) -> list[torch.nn.Module]:
    """Unwrapped GPTModel chunks of this pipeline rank (one per virtual stage), on the compute device (`use_te`: block_spec's)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel

    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(config, precision_cfg, vp_stage=stage, use_te=use_te),
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            vp_stage=stage,
            **gpt_model_kwargs(arch),
        )
        if torch.cuda.is_available():
            model = model.cuda(torch.cuda.current_device())
        if precision_cfg.fp4_enabled:
            from megatron_rl.precision.fp4_linear import assign_fp4_streams

            assign_fp4_streams(model)
        # the transformer layers ask for no CUDA device by name: their ops skip the CPU compat mode's
        # per-call __torch_function__ (a no-op on GPU, where the mode is never installed)
        run_without_compat_mode(model.decoder)
        chunks.append(model)
    return chunks


def wrap_ddp(chunks: list[torch.nn.Module], config: Any, parallel_cfg: ParallelConfig,
             kernels: Optional[LearnerKernels] = None) -> list[torch.nn.Module]:
    """Wrap each chunk in megatron DDP (grads reduced over DP x CP in fp32), with `kernels`' overlap (default off).

    With overlap_grad_reduce the schedules must hold the reduce back until each chunk's last micro-batch:
    config.no_sync_func / grad_sync_func are set as megatron's training loop sets them
    (megatron/training/training.py, core_v0.16.1: no_sync per chunk, start_grad_sync per chunk).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    kernels = kernels or LearnerKernels()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=parallel_cfg.use_distributed_optimizer,
        check_for_nan_in_grad=False,
        **kernels.ddp_config_kwargs(),
    )
    model = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    if kernels.overlap_grad_reduce:
        no_sync = [m.no_sync for m in model]
        grad_sync = [m.start_grad_sync for m in model]
        config.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
        config.grad_sync_func = grad_sync[0] if len(model) == 1 else grad_sync
    return model


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP (and any other `.module` wrappers)."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk
