"""W8A8 emulation of an SGLang block-FP8 server for HF transformers models on CPU.

Weights come from an FP8 checkpoint's 128x128 blocks (held as the FP8 bits + scale_inv, used
dequantized); activations are fake-quantized per token in 1x128 groups with dynamic scales in
the DeepSeek convention (x / scale_inv, scale_inv = max(amax, 1e-10) / 448); the GEMM
accumulates in fp32. The embedded rollout server plugs `load_fp8_checkpoint_into` in as its
model loader so it serves exactly the bits the trainer exported.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

import torch

from megatron_rl.precision.blockwise import (
    ScaleFmt,
    dequantize_blockwise,
    fake_quantize_activation_groups,
    quantize_blockwise,
    quantize_per_channel,
)
from megatron_rl.precision.hf_fp8 import SCALE_SUFFIX, is_quantized_weight, load_fp8_checkpoint, weight_block_size


class SharedActivation:
    """The fake-quantized input of sibling W8A8Linears (q/k/v, gate/up) within one forward of their parent module.

    HF attention and MLP blocks feed one tensor to several projections; with the same activation
    layout its fake-quant is the same tensor, so it is computed once (the first sibling) and reused
    while the input is that same, unmodified tensor object (its version counter, where it has one:
    inference tensors have none, and the parent scope below is the guard). The parent's forward
    hooks clear it on entry and exit, so nothing outlives the parent's call.
    """

    def __init__(self):
        """Empty."""
        self.clear()

    def clear(self, *args) -> None:
        """Forget the held input (also usable as a forward hook)."""
        self._x, self._version, self._layout, self._xq = None, None, None, None

    def fake_quantized(self, x: torch.Tensor, layout: tuple[int, str]) -> torch.Tensor:
        """fake_quantize_activation_groups(x.float(), *layout), reused when x is the input it last saw."""
        version = None if x.is_inference() else x._version
        if x is self._x and version == self._version and layout == self._layout:
            return self._xq
        xq = fake_quantize_activation_groups(x.float(), *layout)
        self._x, self._version, self._layout, self._xq = x, version, layout, xq
        return xq


def share_sibling_inputs(model: torch.nn.Module) -> int:
    """Give the W8A8Linear children of every module one SharedActivation, cleared around that module's forward.

    Idempotent (a weight sync reloads into the same modules); returns the number of groups. Sharing
    changes no value: a sibling reuses exactly the tensor it would have computed.
    """
    groups = 0
    for parent in model.modules():
        children = [m for m in parent.children() if isinstance(m, W8A8Linear)]
        if len(children) < 2:
            continue
        shared = getattr(parent, "_w8a8_shared_input", None)
        if shared is None:
            shared = SharedActivation()
            parent._w8a8_shared_input = shared
            parent.register_forward_pre_hook(shared.clear)
            parent.register_forward_hook(shared.clear)
        for child in children:
            child.shared_input = shared
        groups += 1
    return groups


class W8A8Linear(torch.nn.Module):
    """Linear with a block-FP8 weight and per-token 1 x group FP8 activations (emulated)."""

    def __init__(self, weight_q: torch.Tensor, scale_inv: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 block: tuple[int, int] = (128, 128), act_group: int = 128, act_scale_fmt: ScaleFmt = "fp32"):
        """Hold the FP8 weight bits and scales; bias stays high precision."""
        super().__init__()
        self.block = tuple(block)
        self.act_group = int(act_group)
        self.act_scale_fmt = act_scale_fmt
        self.out_features, self.in_features = weight_q.shape
        self.register_buffer("weight_q", weight_q.detach().clone(), persistent=False)
        self.register_buffer("weight_scale_inv", scale_inv.detach().float().clone(), persistent=False)
        self.register_buffer("weight_dq", self._dequant(), persistent=False)
        self.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.shared_input: Optional[SharedActivation] = None
        """Set by share_sibling_inputs: where siblings fed the same input find its fake-quant."""

    def _dequant(self) -> torch.Tensor:
        """fp32 q * scale_inv of the held weight."""
        return dequantize_blockwise(self.weight_q, self.weight_scale_inv, self.block, torch.float32)

    def set_quantized(self, weight_q: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """Replace the weight with new FP8 bits and scales (weight sync)."""
        if tuple(weight_q.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {tuple(weight_q.shape)} != {(self.out_features, self.in_features)}")
        self.weight_q.copy_(weight_q)
        self.weight_scale_inv.copy_(scale_inv.float())
        self.weight_dq.copy_(self._dequant())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = fq(x) @ dequant(W)^T (+ b), fp32 accumulate, in x's dtype."""
        if self.shared_input is not None:
            xq = self.shared_input.fake_quantized(x, (self.act_group, self.act_scale_fmt))
        else:
            xq = fake_quantize_activation_groups(x.float(), self.act_group, self.act_scale_fmt)
        y = xq @ self.weight_dq.t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        """Shapes and block sizes."""
        return f"in={self.in_features}, out={self.out_features}, block={self.block}, act_group={self.act_group}"


def _set_submodule(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Replace the submodule at dotted path `name`."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def apply_fp8_state_dict(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor],
                         block: Optional[tuple[int, int]] = (128, 128), act_group: int = 128,
                         scale_suffix: str = SCALE_SUFFIX) -> list[str]:
    """Load raw FP8-checkpoint tensors into model: quantized Linears become (or update) W8A8Linear, the rest load as is.

    block=None reads per-output-channel scales [out, 1] (SGLang's w8a8_fp8 layout, scale names
    ending in `scale_suffix`) with one dynamic activation scale per token. Returns the names of the
    W8A8 modules. Raises on missing or unexpected high-precision keys.
    """
    converted = []
    for name, module in list(model.named_modules()):
        scale = tensors.get(f"{name}.weight{scale_suffix}")
        if scale is None:
            continue
        q = tensors[f"{name}.weight"]
        if isinstance(module, W8A8Linear):
            module.set_quantized(q, scale)
        elif isinstance(module, torch.nn.Linear):
            bias = tensors.get(f"{name}.bias", module.bias)
            in_features = q.shape[1]
            layout = (block, act_group) if block is not None else ((1, in_features), in_features)
            new = W8A8Linear(q, scale, bias, *layout).to(module.weight.device)
            _set_submodule(model, name, new)
        else:
            raise TypeError(f"{name} has FP8 weights but is a {type(module).__name__}, not nn.Linear")
        converted.append(name)
    quantized = {f"{n}.weight" for n in converted} | {f"{n}.weight{scale_suffix}" for n in converted} | {f"{n}.bias" for n in converted}
    rest = {k: v for k, v in tensors.items() if k not in quantized}
    missing, unexpected = model.load_state_dict(rest, strict=False)
    tied = {"lm_head.weight"} if getattr(getattr(model, "config", None), "tie_word_embeddings", False) else set()
    missing = [m for m in missing if m not in tied and not any(m.startswith(f"{n}.") for n in converted)]
    if missing or unexpected:
        raise KeyError(f"FP8 checkpoint does not match the model: missing={missing[:8]}, unexpected={list(unexpected)[:8]}")
    share_sibling_inputs(model)
    return converted


def load_fp8_checkpoint_into(model: torch.nn.Module, ckpt_dir: str | Path, act_group: int = 128) -> torch.nn.Module:
    """Load an HF FP8 checkpoint directory into an HF transformers model, converting its quantized Linears to W8A8."""
    tensors, config = load_fp8_checkpoint(ckpt_dir)
    block = weight_block_size(config)
    if block is None:
        raise ValueError(f"{ckpt_dir} is not a block-FP8 checkpoint (no fp8 quantization_config.weight_block_size)")
    apply_fp8_state_dict(model, tensors, block, act_group)
    return model


def convert_to_w8a8(model: torch.nn.Module, mode: str = "fp8-blockwise", scale_fmt: ScaleFmt = "fp32") -> list[str]:
    """Quantize a high-precision HF model's transformer Linears in place (SGLang --quantization fp8 on a BF16 checkpoint).

    fp8-blockwise: 128x128 weight blocks, 1x128 activation groups; fp8-channel: one scale per
    output row, one dynamic scale per token. Returns the converted module names.
    """
    if mode not in ("fp8-blockwise", "fp8-channel"):
        raise ValueError(f"mode must be fp8-blockwise or fp8-channel, got {mode!r}")
    converted = []
    for name, module in list(model.named_modules()):
        if not (isinstance(module, torch.nn.Linear) and is_quantized_weight(f"{name}.weight")):
            continue
        w = module.weight.detach()
        if mode == "fp8-blockwise":
            q, s = quantize_blockwise(w, (128, 128), scale_fmt)
            new = W8A8Linear(q, s, module.bias, (128, 128), 128, scale_fmt)
        else:
            q, s = quantize_per_channel(w, scale_fmt)
            new = W8A8Linear(q, s, module.bias, (1, w.shape[1]), w.shape[1], scale_fmt)
        _set_submodule(model, name, new.to(w.device))
        converted.append(name)
    share_sibling_inputs(model)
    return converted


def w8a8_weights(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name: (FP8 weight bits, scale_inv)} of every W8A8Linear in model."""
    return {n: (m.weight_q, m.weight_scale_inv) for n, m in model.named_modules() if isinstance(m, W8A8Linear)}
