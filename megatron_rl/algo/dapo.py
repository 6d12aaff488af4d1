"""DAPO extras: the dynamic-sampling group filter and overlong-buffer reward shaping."""
from __future__ import annotations

import torch


def dynamic_sampling_keep(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """[num_prompts] bool: True for groups whose n rewards are not all equal (non-zero std)."""
    if rewards.dim() != 1 or n < 1 or rewards.numel() % n:
        raise ValueError(f"rewards must be 1-D with a multiple of n={n} entries, got shape {tuple(rewards.shape)}")
    g = rewards.reshape(-1, n)
    # max != min rather than std > 0: a float std of equal values can come out as a tiny non-zero
    return g.amax(dim=1) != g.amin(dim=1)


def expand_group_mask(keep: torch.Tensor, n: int) -> torch.Tensor:
    """Per-prompt mask [num_prompts] -> per-sample mask [num_prompts * n] (prompt-major)."""
    return keep.repeat_interleave(n)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment min(-(len - (max_length - buffer)) / buffer * factor, 0); zeros when buffer is 0."""
    lengths = lengths.to(torch.float32)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    expected = float(max_length - buffer)
    return torch.clamp(-(lengths - expected) / float(buffer) * float(factor), max=0.0)
