"""Low-precision policy (FP8, or FP4 emulation): the one object that decides quantization for learner and rollout."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from megatron_rl.config.base import NonNegativeInt, PositiveInt, Seed, StrictConfig

Recipe = Literal["none", "delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4", "mxfp4"]
FP4_RECIPES = ("nvfp4", "mxfp4")
"""Recipes whose linears compute in FP4 (E2M1) rather than FP8."""


class PrecisionConfig(StrictConfig):
    """How the learner and the rollout engines quantize; configured once and passed in."""

    recipe: Recipe = "none"
    """Recipe of the learner's linear layers: none (high precision); FP8 delayed, tensorwise, blockwise, mxfp8; FP4 nvfp4, mxfp4 (mxfp4: CPU emulation only)."""
    fp8_format: Literal["e4m3", "hybrid"] = "hybrid"
    """FP8 recipes: e4m3 everywhere, or hybrid (E4M3 forward, E5M2 output gradients in backward). FP4 recipes ignore it."""
    first_last_layers_high_precision: NonNegativeInt = 0
    """Transformer layers (>= 0) kept in high precision at each end of the stack; 0 quantizes every layer. NVIDIA's NVFP4 recipe keeps the first and last layers in BF16: set it for deep models."""
    fp8_params: bool = False
    """Store learner parameters in FP8 (nvfp4: FP4) (GPU only; TE fp8_model_init / quantized_model_init, megatron fp8_param / fp4_param)."""
    amax_history_len: PositiveInt = 1
    """Delayed scaling: length of the amax history window (>= 1; megatron default 1)."""
    amax_compute_algo: Literal["max", "most_recent"] = "most_recent"
    """Delayed scaling: how the scale's amax is taken from the history."""
    margin: NonNegativeInt = 0
    """Delayed scaling: scale = fp8_max * 2^-margin / amax (margin >= 0)."""
    power_of_two_scales: bool = False
    """Blockwise recipe: round scales to powers of two (TE's default on GPU is True; FP32 scales when False)."""
    rollout_quantization: Literal["none", "fp8-blockwise", "fp8-channel"] = "none"
    """How the weights pushed to rollout engines are quantized: none, fp8-blockwise (SGLang fp8, 128x128 blocks), fp8-channel (SGLang w8a8_fp8, one scale per output channel); precision/rollout_formats.py."""
    rollout_scale_fmt: Literal["auto", "fp32", "ue8m0"] = "auto"
    """Scale format of the rollout weights (ue8m0 = power-of-two scales); auto = ue8m0 for fp8-blockwise on Blackwell (sm100) engines, whose SGLang requantizes block scales to UE8M0, else fp32 (CPU too); resolved when the config loads (precision/device.py)."""
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    """KV-cache dtype of the rollout engines: SGLang's --kv-cache-dtype; embedded engines emulate fp8_e4m3 (E4M3 K/V with each layer's per-tensor scales)."""
    kv_cache_scales: Literal["auto", "recalibrate", "unit"] = "auto"
    """FP8 KV cache scales: recalibrate (per-layer K/V amax measured on the old-log-prob forward, sent with every weight sync) or unit (1.0 everywhere, SGLang's default). auto = recalibrate when kv_cache_dtype=fp8_e4m3, unit with rollout_quantization=fp8-channel; see precision/kv_scales.py."""
    kv_cache_scale_window: PositiveInt = 4
    """recalibrate: a scale covers the max K/V amax of the last this many (>= 1) steps."""
    kv_cache_scale_headroom: float = Field(default=2.0, ge=1.0, allow_inf_nan=False)
    """recalibrate: scale = headroom (>= 1) x amax / 448: the margin between the measured amax and FP8 overflow (SGLang does not clamp: overflow is NaN)."""
    kv_cache_scale_rounding: Literal["power_of_two", "none"] = "power_of_two"
    """recalibrate: power_of_two rounds each scale up to a power of two (then the cache rounds exactly as at scale 1.0 wherever 1.0 neither overflows nor underflows), none keeps headroom x amax / 448; precision/kv_scales.py."""
    ratio_consistent_scales: bool = False
    """Within an RL step, FP8 forwards of theta reuse the per-tensor scales pi_old's forward computed on the same micro-batch (weights and activations), so unmoved elements round alike; no extra forward; tensorwise, CPU emulation (precision/scale_book.py)."""
    fp4_hadamard_wgrad: bool = True
    """FP4 recipes: apply the 16x16 random-sign Hadamard transform to both wgrad operands along tokens before quantizing (TE NVFP4BlockScaling's default)."""
    fp4_stochastic_rounding: bool = True
    """FP4 recipes: stochastic rounding of the output gradients (forward operands stay round-to-nearest-even), as TE NVFP4BlockScaling."""
    fp4_seed: Seed = 0
    """FP4 recipes: seed of the CPU emulation's stochastic-rounding streams (deterministic and checkpointed; TE draws its own on GPU)."""

    @model_validator(mode="after")
    def _check(self) -> "PrecisionConfig":
        if self.first_last_layers_high_precision < 0:
            raise ValueError("precision.first_last_layers_high_precision must be >= 0")
        if self.recipe == "delayed" and self.first_last_layers_high_precision:
            raise ValueError("precision.first_last_layers_high_precision is not supported with recipe=delayed (as in megatron-core)")
        if self.fp8_params and self.recipe == "none":
            raise ValueError("precision.fp8_params needs an FP8 recipe (recipe is 'none')")
        if self.kv_cache_scales == "recalibrate" and self.kv_cache_dtype != "fp8_e4m3":
            raise ValueError("precision.kv_cache_scales=recalibrate needs precision.kv_cache_dtype=fp8_e4m3 "
                             f"(got {self.kv_cache_dtype!r}: the cache keeps K/V unquantized)")
        if self.kv_cache_scales == "recalibrate" and self.rollout_quantization == "fp8-channel":
            raise ValueError("precision.kv_cache_scales=recalibrate is not available with "
                             "precision.rollout_quantization=fp8-channel: SGLang's w8a8_fp8 quant method creates no "
                             "K/V cache scales (W8A8Fp8Config.get_quant_method), so engines would serve 1.0; use "
                             "fp8-blockwise or none, or kv_cache_scales=unit")
        if self.ratio_consistent_scales and self.recipe != "tensorwise":
            raise ValueError("precision.ratio_consistent_scales is implemented for precision.recipe=tensorwise only "
                             f"(got {self.recipe!r}): per-block and delayed scales are not recorded")
        if self.fp8_params and self.recipe == "mxfp4":
            raise ValueError("precision.fp8_params is not available with recipe=mxfp4 (megatron-core has no MXFP4 parameters)")
        return self

    @property
    def fp8_enabled(self) -> bool:
        """True when the learner computes its linear layers in low precision (FP8 or FP4)."""
        return self.recipe != "none"

    @property
    def recalibrates_kv_scales(self) -> bool:
        """True when the learner measures K/V cache scales and every weight sync carries them (kv_cache_scales resolved)."""
        if self.kv_cache_dtype != "fp8_e4m3" or self.kv_cache_scales == "unit":
            return False
        return self.kv_cache_scales == "recalibrate" or self.rollout_quantization != "fp8-channel"

    @property
    def fp4_enabled(self) -> bool:
        """True for the FP4 recipes (nvfp4, mxfp4)."""
        return self.recipe in FP4_RECIPES
