"""FP8 precision policy: the one object that decides FP8 for learner and rollout."""
from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from megatron_rl.config.base import StrictConfig

Recipe = Literal["none", "delayed", "tensorwise", "blockwise", "mxfp8"]


class PrecisionConfig(StrictConfig):
    """How the learner and the rollout engines quantize; configured once and passed in."""

    recipe: Recipe = "none"
    """FP8 recipe of the learner's linear layers: none (high precision), delayed, tensorwise, blockwise, mxfp8."""
    fp8_format: Literal["e4m3", "hybrid"] = "hybrid"
    """e4m3 everywhere, or hybrid (E4M3 forward, E5M2 output gradients in backward)."""
    first_last_layers_high_precision: int = 0
    """Keep this many transformer layers at each end of the stack in high precision."""
    fp8_params: bool = False
    """Store learner parameters in FP8 (GPU only; TE fp8_model_init / quantized_model_init)."""
    amax_history_len: int = 1
    """Delayed scaling: length of the amax history window (megatron default 1)."""
    amax_compute_algo: Literal["max", "most_recent"] = "most_recent"
    """Delayed scaling: how the scale's amax is taken from the history."""
    margin: int = 0
    """Delayed scaling: scale = fp8_max * 2^-margin / amax."""
    power_of_two_scales: bool = False
    """Blockwise recipe: round scales to powers of two (TE's default on GPU is True; FP32 scales when False)."""
    rollout_quantization: Literal["none", "fp8-blockwise", "fp8-channel"] = "none"
    """How the weights pushed to rollout engines are quantized: none, fp8-blockwise (SGLang fp8, 128x128 blocks), fp8-channel (SGLang w8a8_fp8, one scale per output channel); precision/rollout_formats.py."""
    rollout_scale_fmt: Literal["fp32", "ue8m0"] = "fp32"
    """Scale format of the blockwise rollout checkpoint (ue8m0 = power-of-two scales)."""
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    """KV-cache dtype of the rollout engines: SGLang's --kv-cache-dtype; embedded engines emulate fp8_e4m3 (E4M3 K/V, per-tensor scales 1.0)."""

    @model_validator(mode="after")
    def _check(self) -> "PrecisionConfig":
        if self.first_last_layers_high_precision < 0:
            raise ValueError("precision.first_last_layers_high_precision must be >= 0")
        if self.recipe == "delayed" and self.first_last_layers_high_precision:
            raise ValueError("precision.first_last_layers_high_precision is not supported with recipe=delayed (as in megatron-core)")
        if self.fp8_params and self.recipe == "none":
            raise ValueError("precision.fp8_params needs an FP8 recipe (recipe is 'none')")
        if self.margin < 0:
            raise ValueError("precision.margin must be >= 0")
        if self.amax_history_len < 1:
            raise ValueError("precision.amax_history_len must be >= 1")
        return self

    @property
    def fp8_enabled(self) -> bool:
        """True when the learner computes its linear layers in FP8."""
        return self.recipe != "none"
