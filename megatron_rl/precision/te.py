"""GPU mapping of the FP8 policy onto megatron-core's TransformerConfig and Transformer Engine.

Transformer Engine is imported lazily (it exists only on GPU machines).

FP32 block scales on Hopper: TE's Float8BlockScaling fixes its per-operand QParams
(power_2_scale) when the class is *defined*, from NVTE_FP8_BLOCK_SCALING_FP32_SCALES, and
megatron builds its own Float8BlockScaling(fp8_format=...) per layer. The only faithful way to
get FP32 scales (``power_of_two_scales=False``, this project's default) is therefore for the
LAUNCHER to export ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` before Python starts: use
``launcher_env(cfg)``. Nothing in this package sets environment variables;
``check_te_environment(cfg)`` fails fast when the imported TE disagrees with the policy.

FP4: ``nvfp4`` maps onto megatron-core 0.16's ``fp4="e2m1"``, ``fp4_recipe="nvfp4"`` (megatron builds
TE's ``NVFP4BlockScaling()``, TE >= 2.8, Blackwell GPUs). That recipe, too, reads its options from
the environment when TE is imported (``NVTE_NVFP4_DISABLE_RHT``, ``NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING``),
so ``precision.fp4_hadamard_wgrad`` / ``fp4_stochastic_rounding`` reach it through ``launcher_env``
as well. ``mxfp4`` has no TE or megatron recipe: it is a CPU emulation and is refused on GPU.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from megatron_rl.config.precision import PrecisionConfig

FP32_BLOCK_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
"""Environment variable TE reads at import time to use FP32 (not power-of-two) block scales."""
NVFP4_DISABLE_RHT_ENV = "NVTE_NVFP4_DISABLE_RHT"
"""TE >= 2.8 reads it at import time: 1 turns off NVFP4BlockScaling's wgrad Hadamard transform."""
NVFP4_DISABLE_SR_ENV = "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"
"""TE >= 2.8 reads it at import time: 1 turns off NVFP4BlockScaling's stochastic rounding of gradients."""


def te_available() -> bool:
    """True when CUDA is available and transformer_engine imports (this process's DeviceFacts, detected once)."""
    from megatron_rl.precision.device import detect_device_facts

    return detect_device_facts().use_te


def transformer_config_kwargs(cfg: PrecisionConfig) -> dict[str, Any]:
    """megatron-core 0.16 TransformerConfig fields that express the policy (fp8=None when recipe is none)."""
    if cfg.recipe == "none":
        return {"fp8": None, "fp8_param": False, "first_last_layers_bf16": False}
    k = cfg.first_last_layers_high_precision
    if cfg.recipe == "mxfp4":
        raise ValueError("precision.recipe=mxfp4 is a CPU emulation: megatron-core and Transformer Engine have no MXFP4 "
                         "training recipe (use nvfp4 on GPU)")
    if cfg.recipe == "nvfp4":
        return {
            "fp8": None,
            "fp4": "e2m1",
            "fp4_recipe": "nvfp4",
            "fp4_param": cfg.fp8_params,
            "first_last_layers_bf16": k > 0,
            "num_layers_at_start_in_bf16": k,
            "num_layers_at_end_in_bf16": k,
        }
    return {
        "fp8": cfg.fp8_format,
        "fp8_recipe": cfg.recipe,
        "fp8_margin": cfg.margin,
        "fp8_amax_history_len": cfg.amax_history_len,
        "fp8_amax_compute_algo": cfg.amax_compute_algo,
        "fp8_param": cfg.fp8_params,
        "first_last_layers_bf16": k > 0,
        "num_layers_at_start_in_bf16": k,
        "num_layers_at_end_in_bf16": k,
    }


def launcher_env(cfg: PrecisionConfig) -> dict[str, str]:
    """Environment variables the launcher must export before starting learner processes."""
    if cfg.recipe == "blockwise" and not cfg.power_of_two_scales:
        return {FP32_BLOCK_SCALES_ENV: "1"}
    if cfg.recipe == "nvfp4":
        env = {}
        if not cfg.fp4_hadamard_wgrad:
            env[NVFP4_DISABLE_RHT_ENV] = "1"
        if not cfg.fp4_stochastic_rounding:
            env[NVFP4_DISABLE_SR_ENV] = "1"
        return env
    return {}


def check_te_environment(cfg: PrecisionConfig) -> None:
    """Raise if the imported TE cannot run cfg's recipe, or its import-time options contradict cfg (env vars not exported in time)."""
    if cfg.fp4_enabled:
        _check_te_nvfp4(cfg)
        return
    if cfg.recipe != "blockwise":
        return
    from transformer_engine.common.recipe import Float8BlockScaling

    te_pow2 = bool(Float8BlockScaling.fp8_quant_fwd_inp.power_2_scale)
    if te_pow2 != cfg.power_of_two_scales:
        want = "1" if not cfg.power_of_two_scales else "0 (or unset)"
        raise RuntimeError(
            f"precision.power_of_two_scales={cfg.power_of_two_scales} but Transformer Engine was imported with "
            f"power-of-two block scales={te_pow2}; the launcher must export {FP32_BLOCK_SCALES_ENV}={want} "
            "before Python starts (see megatron_rl.precision.te.launcher_env)")


def check_te_recipe_support(cfg: PrecisionConfig) -> None:
    """Ask Transformer Engine itself whether this GPU runs cfg's recipe; RuntimeError naming precision.recipe if not.

    TE 2.20's `check_recipe_support` (transformer_engine/pytorch/quantization.py) covers the FP8 recipes and
    leaves NVFP4 out, so NVFP4 goes through its `check_nvfp4_support`; TE < 2.8 kept both in pytorch/fp8.py.
    """
    if cfg.recipe == "none":
        return
    try:
        from transformer_engine.pytorch.quantization import check_nvfp4_support, check_recipe_support
    except ImportError:
        from transformer_engine.pytorch.fp8 import check_nvfp4_support, check_recipe_support
    if cfg.fp4_enabled:
        if cfg.recipe == "mxfp4":
            transformer_config_kwargs(cfg)  # raises: no GPU recipe
        supported, reason = check_nvfp4_support()
    else:
        supported, reason = True, ""
        try:
            check_recipe_support(te_recipe(cfg))
        except RuntimeError as exc:
            supported, reason = False, str(exc)
    if not supported:
        raise RuntimeError(f"precision.recipe={cfg.recipe}: Transformer Engine says this GPU (compute capability "
                           f"{'.'.join(map(str, torch.cuda.get_device_capability()))}) cannot run it: {reason}")


def _check_te_nvfp4(cfg: PrecisionConfig) -> None:
    """nvfp4 needs TE >= 2.8 (NVFP4BlockScaling) on a Blackwell GPU, with its RHT / SR defaults matching cfg."""
    if cfg.recipe == "mxfp4":
        transformer_config_kwargs(cfg)  # raises: no GPU recipe
    from transformer_engine.common import recipe as te

    if not hasattr(te, "NVFP4BlockScaling"):
        raise RuntimeError("precision.recipe=nvfp4 needs Transformer Engine >= 2.8 (recipe.NVFP4BlockScaling)")
    if torch.cuda.get_device_capability() < (10, 0):
        raise RuntimeError(f"precision.recipe=nvfp4 needs a Blackwell GPU (compute capability >= 10.0) for TE's NVFP4 "
                           f"GEMMs; this one is {torch.cuda.get_device_capability()}")
    for field, env, te_disabled in (("fp4_hadamard_wgrad", NVFP4_DISABLE_RHT_ENV, te.NVFP4BlockScaling.disable_rht),
                                    ("fp4_stochastic_rounding", NVFP4_DISABLE_SR_ENV,
                                     te.NVFP4BlockScaling.disable_stochastic_rounding)):
        if bool(te_disabled) == bool(getattr(cfg, field)):
            want = "1" if not getattr(cfg, field) else "0 (or unset)"
            raise RuntimeError(f"precision.{field}={getattr(cfg, field)} but Transformer Engine was imported with "
                               f"NVFP4BlockScaling {env.split('NVTE_NVFP4_')[1].lower()}={bool(te_disabled)}; the launcher must "
                               f"export {env}={want} before Python starts (see megatron_rl.precision.te.launcher_env)")


def te_recipe(cfg: PrecisionConfig):
    """The TE recipe object of the policy (None for recipe none), built as megatron's get_fp8_recipe does."""
    if cfg.recipe == "none":
        return None
    from transformer_engine.common import recipe as te

    fmt = te.Format.E4M3 if cfg.fp8_format == "e4m3" else te.Format.HYBRID
    if cfg.recipe == "delayed":
        return te.DelayedScaling(margin=cfg.margin, fp8_format=fmt, amax_history_len=cfg.amax_history_len,
                                 amax_compute_algo=cfg.amax_compute_algo)
    if cfg.recipe == "tensorwise":
        return te.Float8CurrentScaling(fp8_format=fmt)
    if cfg.recipe == "blockwise":
        check_te_environment(cfg)
        return te.Float8BlockScaling(fp8_format=fmt)
    if cfg.recipe == "mxfp8":
        return te.MXFP8BlockScaling(fp8_format=fmt)
    if cfg.fp4_enabled:
        check_te_environment(cfg)
        return te.NVFP4BlockScaling(disable_rht=not cfg.fp4_hadamard_wgrad,
                                    disable_stochastic_rounding=not cfg.fp4_stochastic_rounding)
    raise ValueError(f"unknown FP8 recipe {cfg.recipe!r}")


def _amax_group():
    """megatron's amax reduction group (TP x CP x DP) when model parallel is initialized."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_amax_reduction_group(with_context_parallel=True)
    return None


def te_autocast(enabled: bool, recipe=None, group=None):
    """TE's autocast (TE >= 2.9) or fp8_autocast (older TE) with the same meaning."""
    import transformer_engine.pytorch as tep

    if hasattr(tep, "autocast"):
        return tep.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group)
    return tep.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=group)


def autocast_context(cfg: PrecisionConfig, group: Optional[object] = None):
    """TE autocast with the policy's recipe and megatron's amax group (nullcontext when recipe is none)."""
    if cfg.recipe == "none":
        return contextlib.nullcontext()
    return te_autocast(True, te_recipe(cfg), group if group is not None else _amax_group())


@contextlib.contextmanager
def te_disabled(model_config: Optional[Any] = None):
    """Run with TE FP8/FP4 off: megatron's blocks enter get_fp8_context / get_fp4_context per layer from config.fp8 / config.fp4, so both are cleared too."""
    saved = {k: getattr(model_config, k, None) for k in ("fp8", "fp4")} if model_config is not None else {}
    for k in saved:
        setattr(model_config, k, None)
    try:
        with te_autocast(False):
            yield
    finally:
        for k, v in saved.items():
            setattr(model_config, k, v)
