"""Per-token policy-gradient losses: PPO clip with ratio bounds [L, H], dual-clip, CISPO.

Bounds are 0-d tensors (never Python floats) so a compiled loss does not recompile when a
calibrated bound moves. A clipped token's loss is built from the bound alone, so its gradient
is exactly zero (`torch.where`, not max/min, which would split the gradient at ties).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_rl.algo.registry import Registry


@dataclass
class PolicyLossOutput:
    """Per-token loss plus the detached quantities the metrics need."""

    loss: torch.Tensor
    """[B, S] per-token loss (not masked, not aggregated)."""
    ratio: torch.Tensor
    """[B, S] detached importance ratio pi / pi_old."""
    clipped_lower: torch.Tensor
    """[B, S] bool: the lower bound L is active for this token."""
    clipped_upper: torch.Tensor
    """[B, S] bool: the upper bound H is active for this token."""
    clipped_dual: torch.Tensor
    """[B, S] bool: the dual-clip cap is active (always False outside dual_clip)."""


LossFn = Callable[..., PolicyLossOutput]
POLICY_LOSSES: Registry[LossFn] = Registry("policy loss")


def log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, clamp: float = 20.0) -> torch.Tensor:
    """log(pi / pi_old), clamped to +-clamp so exp cannot overflow."""
    return (logprobs - old_logprobs).clamp(-clamp, clamp)


def _ppo_parts(logprobs, old_logprobs, advantages, lower, upper, log_ratio_clamp, decision_ratio=None):
    """(ratio, per-token loss, clipped below, clipped above); the clip masks follow `decision_ratio` when given
    (the experimental dose-response instrument, algo/error_scale.py), the active tokens' loss always `ratio`."""
    ratio = torch.exp(log_ratio(logprobs, old_logprobs, log_ratio_clamp))
    decide = ratio if decision_ratio is None else decision_ratio.detach()
    lower = torch.as_tensor(lower, dtype=ratio.dtype, device=ratio.device).detach()
    upper = torch.as_tensor(upper, dtype=ratio.dtype, device=ratio.device).detach()
    clip_lo = (advantages < 0) & (decide < lower)
    clip_hi = (advantages > 0) & (decide > upper)
    bound = torch.where(clip_lo, lower, upper)
    loss = torch.where(clip_lo | clip_hi, -advantages * bound, -advantages * ratio)
    return ratio, loss, clip_lo, clip_hi


@POLICY_LOSSES.register("ppo")
def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    lower: torch.Tensor,
    upper: torch.Tensor,
    *,
    log_ratio_clamp: float = 20.0,
    decision_ratio: Optional[torch.Tensor] = None,
    **_: object,
) -> PolicyLossOutput:
    """PPO surrogate -min(r*A, clip(r, L, H)*A) with asymmetric ratio bounds L=lower, H=upper.

    `decision_ratio` (experiment only): the ratio that decides which tokens are clipped; `ratio` in the output is then
    that decision ratio, so clip fractions and ratio statistics describe what was clipped."""
    ratio, loss, lo, hi = _ppo_parts(logprobs, old_logprobs, advantages, lower, upper, log_ratio_clamp, decision_ratio)
    shown = ratio if decision_ratio is None else decision_ratio
    return PolicyLossOutput(loss, shown.detach(), lo, hi, torch.zeros_like(lo))


@POLICY_LOSSES.register("dual_clip")
def dual_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    lower: torch.Tensor,
    upper: torch.Tensor,
    *,
    dual_clip_c: torch.Tensor | float = 3.0,
    log_ratio_clamp: float = 20.0,
    decision_ratio: Optional[torch.Tensor] = None,
    **_: object,
) -> PolicyLossOutput:
    """Dual-clip PPO: as ppo, and for A < 0 the loss is capped at -c*A (ratio above c stops pushing); `decision_ratio` as ppo."""
    ratio, loss, lo, hi = _ppo_parts(logprobs, old_logprobs, advantages, lower, upper, log_ratio_clamp, decision_ratio)
    shown = ratio if decision_ratio is None else decision_ratio
    c = torch.as_tensor(dual_clip_c, dtype=ratio.dtype, device=ratio.device).detach()
    dual = (advantages < 0) & (shown > c)
    loss = torch.where(dual, -advantages * c, loss)
    return PolicyLossOutput(loss, shown.detach(), lo, hi & dual.logical_not(), dual)


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    lower: torch.Tensor,
    upper: torch.Tensor,
    *,
    log_ratio_clamp: float = 20.0,
    decision_ratio: Optional[torch.Tensor] = None,
    **_: object,
) -> PolicyLossOutput:
    """CISPO: -sg(clip(r, L, H)) * A * log pi; every token keeps a gradient, only its IS weight is clipped."""
    if decision_ratio is not None:
        raise ValueError("cispo clips no token's gradient: it has no clip decision for decision_ratio to change")
    ratio = torch.exp(log_ratio(logprobs, old_logprobs, log_ratio_clamp)).detach()
    lower = torch.as_tensor(lower, dtype=ratio.dtype, device=ratio.device).detach()
    upper = torch.as_tensor(upper, dtype=ratio.dtype, device=ratio.device).detach()
    weight = torch.minimum(torch.maximum(ratio, lower), upper)
    loss = -advantages * weight * logprobs
    return PolicyLossOutput(loss, ratio, ratio < lower, ratio > upper, torch.zeros_like(ratio, dtype=torch.bool))


def policy_loss(name: str, *args: torch.Tensor, **kwargs: object) -> PolicyLossOutput:
    """Dispatch to the registered policy loss `name`."""
    return POLICY_LOSSES.get(name)(*args, **kwargs)
