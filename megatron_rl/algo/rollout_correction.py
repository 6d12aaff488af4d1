"""Train-vs-rollout importance correction: truncated IS (TIS) and masked IS (MIS / ICEPOP).

The weight of a token is w = pi_old / pi_rollout (learner vs engine log-probs), detached.
Token level: one weight per token. Sequence level: w_seq = exp(sum of the sequence's log w)
on every token of the sequence; compute those on whole sequences (before a context-parallel
split) and pass them in, or keep whole sequences in each micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatron_rl.algo.registry import Registry

_LOG_CLAMP = 20.0


@dataclass
class CorrectionOutput:
    """Detached per-token weights and which tokens were truncated or masked."""

    weight: torch.Tensor
    """[B, S] multiplicative weight on the per-token loss (0 off the loss mask)."""
    raw_weight: torch.Tensor
    """[B, S] the untruncated IS weight (per token or per sequence), 0 off the mask."""
    clipped: torch.Tensor
    """[B, S] bool: truncated (TIS) or masked out (MIS) valid tokens."""


CorrectionFn = Callable[..., CorrectionOutput]
ROLLOUT_CORRECTIONS: Registry[CorrectionFn] = Registry("rollout correction")


def _log_w(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    lw = (old_logprobs.detach() - rollout_logprobs.detach()) * mask
    if level == "sequence":
        lw = lw.sum(dim=-1, keepdim=True).expand_as(mask)
    return lw.clamp(-_LOG_CLAMP, _LOG_CLAMP)


def _tis(old_logprobs, rollout_logprobs, mask, *, level, tis_cap=2.0, **_):
    lw = _log_w(old_logprobs, rollout_logprobs, mask, level)
    log_cap = torch.log(torch.as_tensor(tis_cap, dtype=lw.dtype, device=lw.device))
    clipped = (lw > log_cap) & (mask > 0)
    raw = torch.exp(lw) * mask
    return CorrectionOutput(torch.exp(lw.clamp(max=log_cap)) * mask, raw, clipped)


def _mis(old_logprobs, rollout_logprobs, mask, *, level, mis_low=0.5, mis_high=2.0, **_):
    lw = _log_w(old_logprobs, rollout_logprobs, mask, level)
    raw = torch.exp(lw)
    keep = (raw >= torch.as_tensor(mis_low, dtype=raw.dtype, device=raw.device)) & (raw <= torch.as_tensor(mis_high, dtype=raw.dtype, device=raw.device))
    return CorrectionOutput(torch.where(keep, raw, torch.zeros_like(raw)) * mask, raw * mask, keep.logical_not() & (mask > 0))


def _none(old_logprobs, rollout_logprobs, mask, **_):
    return CorrectionOutput(mask.to(torch.float32).clone(), mask.to(torch.float32).clone(), torch.zeros_like(mask, dtype=torch.bool))


ROLLOUT_CORRECTIONS.register("none")(_none)
ROLLOUT_CORRECTIONS.register("tis")(_tis)
ROLLOUT_CORRECTIONS.register("mis")(_mis)


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    mode: str = "tis",
    level: str = "token",
    tis_cap: torch.Tensor | float = 2.0,
    mis_low: torch.Tensor | float = 0.5,
    mis_high: torch.Tensor | float = 2.0,
) -> CorrectionOutput:
    """Detached correction weights: tis = min(w, tis_cap); mis = w inside [mis_low, mis_high] else 0 (token level = ICEPOP)."""
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown rollout correction level {level!r}; valid names: sequence, token")
    mask = loss_mask.to(torch.float32)
    return ROLLOUT_CORRECTIONS.get(mode)(
        old_logprobs, rollout_logprobs, mask, level=level, tis_cap=tis_cap, mis_low=mis_low, mis_high=mis_high
    )
