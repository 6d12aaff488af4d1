"""Which answers algo.calibration.strength=targeted decides on high-precision ratios.

The FP8 ratio error that flips clip decisions sits on a few answers: on the deep miniature the 10% of answers with the
most squared log-ratio error hold 92-97% of it, all of it on tokens whose next-token entropy is at least 0.01 nats
(tools/ratio_error_sources.py, docs/studies/ratio_error_sources/). The learner's FP8 forward of pi_old already gives
every token's entropy, so ranking the answers by their summed entropy costs nothing; the top share of them runs the
high-precision forwards and has its clips decided on the high-precision ratio, the rest on the FP8 ratio. Pure tensor
math, tests/algo/test_targeting.py.
"""
from __future__ import annotations

from typing import Sequence

import torch


def targeted_rows(entropy: torch.Tensor, loss_mask: torch.Tensor, candidates: Sequence[int], fraction: float) -> torch.Tensor:
    """[B] bool on `entropy`'s device: the round(fraction * len(candidates)) candidate rows (at least 1 when there are
    any) whose entropy summed over their answer tokens (`loss_mask`) is largest; ties go to the lower row, so every rank
    holding the same gathered entropy picks the same rows."""
    if not 0 < fraction <= 1:
        raise ValueError(f"targeted fraction must be in (0, 1], got {fraction}")
    rows = torch.zeros(entropy.shape[0], dtype=torch.bool, device=entropy.device)
    if not candidates:
        return rows
    score = (entropy.float() * (loss_mask > 0)).sum(dim=1)
    cand = torch.as_tensor(list(candidates), dtype=torch.long, device=entropy.device)
    n = min(len(candidates), max(1, round(fraction * len(candidates))))
    order = torch.sort(score[cand], descending=True, stable=True).indices[:n]
    rows[cand[order]] = True
    return rows
