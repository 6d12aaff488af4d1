"""The learner's forward-pass context: FP8 on (TE autocast) or off (high_precision shadow passes).

On CPU the fake-quant linears decide for themselves (they check high_precision_active()), so the
context is a no-op there. On GPU megatron's TransformerBlock already enters TE autocast per
layer when TransformerConfig.fp8 is set; this context then only has to turn it OFF inside
high_precision(), which it does by clearing model_config.fp8 for the duration of the forward
(TE's backward follows the mode each module saw in its forward). Shadow passes are forward-only
log-prob passes: an activation-recompute backward would re-run the forward after the context
has restored config.fp8, so do not take gradients through a high_precision() forward on GPU.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.precision.state import high_precision_active


def fp8_forward_context(cfg: PrecisionConfig, model_config: Optional[Any] = None):
    """Context for one learner forward: TE autocast with cfg's recipe, disabled inside high_precision(); CPU: nullcontext."""
    from megatron_rl.precision import te

    if cfg.recipe == "none" or not te.te_available():
        return contextlib.nullcontext()
    if high_precision_active():
        return te.te_disabled(model_config)
    if model_config is not None and (getattr(model_config, "fp8", None) or getattr(model_config, "fp4", None)):
        # megatron enters get_fp8_context / get_fp4_context(config, layer_no) itself (honouring first/last BF16 layers).
        return contextlib.nullcontext()
    return te.autocast_context(cfg)
