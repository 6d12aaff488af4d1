"""Study instruments: settings that exist to measure the method, not to train with.

None of them may appear in a shipped training config (examples/configs): tests/test_experimental_instrument.py
loads every one and refuses any that sets a field here off its default. Study specs set them per arm.
"""
from __future__ import annotations

from pydantic import Field

from megatron_rl.config.base import StrictConfig


class ExperimentalConfig(StrictConfig):
    """Experiment-only instruments (off by default; never in a shipped training config)."""

    clip_error_scale: float = Field(1.0, ge=0, le=64, allow_inf_nan=False)
    """Experiment only, in [0, 64]: the PPO clip is decided on r_k = r_hp * (r_lp / r_hp)^k, the ratio error scaled by k, gradients stay low-precision. 1 = off, 0 = the high-precision ratio; k != 1 costs high-precision forwards every update."""

    def problems(self, recipe: str, policy_loss: str, calibration_enabled: bool, shadow_fraction: float,
                 bounds_update: str) -> list[str]:
        """Cross-field errors of these instruments against the rest of the run config (empty when fine)."""
        if self.clip_error_scale == 1.0:
            return []
        p, out = "algo.experimental.clip_error_scale", []
        if recipe == "none":
            out.append(f"{p}={self.clip_error_scale:g} scales the low-precision ratio error, but precision.recipe=none "
                       "has none (r_lp = r_hp)")
        if policy_loss not in ("ppo", "dual_clip"):
            out.append(f"{p} changes the PPO clip decision; algo.policy_loss.name={policy_loss} has none (ppo or dual_clip)")
        if calibration_enabled and shadow_fraction < 1.0:
            out.append(f"{p} needs the high-precision ratio of every token: algo.calibration.shadow_fraction must be 1")
        if calibration_enabled and bounds_update == "per_minibatch":
            out.append(f"{p}: the per_minibatch pre-pass solves on unscaled low-precision ratios; use another "
                       "algo.calibration.bounds_update")
        return out
