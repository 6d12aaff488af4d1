"""Precision layer: the FP8/FP4 policy's leaf implementations (TE on GPU, fake-quant emulation on CPU).

Public surface used by the rest of the code:
- `linear_classes_for_layer(cfg, layer_index, num_layers)`: (column, row) parallel linear classes
  for one transformer layer's spec (FP8-emulated subclasses, or megatron's plain ones).
- `high_precision()` / `high_precision_active()`: disable FP8 for shadow passes.
- `fp8_forward_context(cfg, model_config=None)`: wrap learner forward passes (TE autocast on GPU).
- `quantize_blockwise` / `dequantize_blockwise` / `quantize_per_channel`: rollout weight export.
- `fake_quant_fp4(x, fmt="nvfp4"|"mxfp4", axis=-1)`: dequantized FP4 values (fp4.py documents the exact arithmetic).
- `save_fp8_checkpoint` / `load_fp8_checkpoint` (hf_fp8), `load_fp8_checkpoint_into` (w8a8).

Modules: numerics (TE-convention quantizers), blockwise (checkpoint-convention quantizers),
linear (fake-quant autograd + megatron subclasses), fp4 (E2M1 / NVFP4 / MXFP4 numerics),
fp4_linear (FP4 operand rules of the linear), context, te (GPU mapping), hf_fp8, w8a8.
"""
from __future__ import annotations

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.precision.blockwise import dequantize_blockwise, quantize_blockwise, quantize_per_channel
from megatron_rl.precision.context import fp8_forward_context
from megatron_rl.precision.fp4 import fake_quant_fp4
from megatron_rl.precision.state import high_precision, high_precision_active

__all__ = [
    "high_precision",
    "high_precision_active",
    "linear_classes_for_layer",
    "layer_uses_fp8",
    "fp8_forward_context",
    "fake_quant_fp4",
    "quantize_blockwise",
    "dequantize_blockwise",
    "quantize_per_channel",
    "save_fp8_checkpoint",
    "load_fp8_checkpoint",
    "load_fp8_checkpoint_into",
]


def layer_uses_fp8(cfg: PrecisionConfig, layer_index: int, num_layers: int) -> bool:
    """True when 0-based global layer `layer_index` of `num_layers` runs its linears in low precision (FP8 or FP4)."""
    if cfg.recipe == "none":
        return False
    if not 0 <= layer_index < num_layers:
        raise ValueError(f"layer_index {layer_index} outside [0, {num_layers})")
    k = cfg.first_last_layers_high_precision
    return not (layer_index < k or layer_index >= num_layers - k)


def linear_classes_for_layer(cfg: PrecisionConfig, layer_index: int, num_layers: int):
    """(ColumnParallelLinear-like, RowParallelLinear-like) classes for transformer layer `layer_index` (0-based, global)."""
    if layer_uses_fp8(cfg, layer_index, num_layers):
        from megatron_rl.precision.linear import fp8_parallel_linear_classes

        return fp8_parallel_linear_classes(cfg)
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear


def save_fp8_checkpoint(*args, **kwargs):
    """See megatron_rl.precision.hf_fp8.save_fp8_checkpoint."""
    from megatron_rl.precision.hf_fp8 import save_fp8_checkpoint as impl

    return impl(*args, **kwargs)


def load_fp8_checkpoint(*args, **kwargs):
    """See megatron_rl.precision.hf_fp8.load_fp8_checkpoint."""
    from megatron_rl.precision.hf_fp8 import load_fp8_checkpoint as impl

    return impl(*args, **kwargs)


def load_fp8_checkpoint_into(*args, **kwargs):
    """See megatron_rl.precision.w8a8.load_fp8_checkpoint_into."""
    from megatron_rl.precision.w8a8 import load_fp8_checkpoint_into as impl

    return impl(*args, **kwargs)
