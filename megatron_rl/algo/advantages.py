"""Group-relative advantage estimators (GRPO, Dr.GRPO, RLOO) over prompt-major rewards.

Input rewards are [num_prompts * n] with the n samples of one prompt adjacent; outputs are
per-sample advantages of the same shape. `expand_to_tokens` broadcasts them onto a [B, S]
loss mask.
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron_rl.algo.registry import Registry

AdvantageFn = Callable[..., torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


def _groups(rewards: torch.Tensor, n: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * n], got shape {tuple(rewards.shape)}")
    if n < 1 or rewards.numel() % n:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a multiple of group size n={n}")
    return rewards.reshape(-1, n).to(torch.float32)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(rewards: torch.Tensor, n: int, *, std_eps: float = 1e-6, unbiased_std: bool = True) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + std_eps); a group of one sample gets advantage 0."""
    g = _groups(rewards, n)
    centred = g - g.mean(dim=1, keepdim=True)
    if n == 1:
        return centred.reshape(-1)
    std = g.std(dim=1, keepdim=True, unbiased=unbiased_std)
    return (centred / (std + std_eps)).reshape(-1)


@ADVANTAGE_ESTIMATORS.register("drgrpo")
def drgrpo_advantages(rewards: torch.Tensor, n: int, **_: object) -> torch.Tensor:
    """Dr.GRPO: r - group mean, no std normalisation (the std division biases towards easy/hard prompts)."""
    g = _groups(rewards, n)
    return (g - g.mean(dim=1, keepdim=True)).reshape(-1)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(rewards: torch.Tensor, n: int, **_: object) -> torch.Tensor:
    """RLOO: r_i - mean of the other n-1 rewards of the group (0 for a group of one)."""
    g = _groups(rewards, n)
    if n == 1:
        return torch.zeros_like(g).reshape(-1)
    others = (g.sum(dim=1, keepdim=True) - g) / (n - 1)
    return (g - others).reshape(-1)


def compute_advantages(rewards: torch.Tensor, n: int, estimator: str = "grpo", **kwargs: object) -> torch.Tensor:
    """Per-sample advantages [num_prompts * n] by the registered `estimator`."""
    return ADVANTAGE_ESTIMATORS.get(estimator)(rewards, n, **kwargs)


def expand_to_tokens(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sample advantages [B] onto [B, S] tokens, zero off the loss mask."""
    return advantages.to(loss_mask.dtype if loss_mask.is_floating_point() else torch.float32)[:, None] * loss_mask
