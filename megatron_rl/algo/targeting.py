"""Which answers algo.calibration.strength=targeted decides on high-precision ratios.

The FP8 ratio error that flips clip decisions sits on a few answers: on the deep miniature the 10% of answers with the
most squared log-ratio error hold 92-97% of it (tools/ratio_error_sources.py, section (c);
docs/studies/ratio_error_sources/). A free signal finds nearly the same answers: the gap between the rollout engine's
log-probs and the learner's FP8 pi_old log-probs on the same tokens, summed over the answer, puts 88-94% of that error
in its top 10% (section (e)); the FP8 entropy of pi_old, 29-53%. Both log-probs exist before the updates, so ranking
costs nothing; the top share of the answers runs the high-precision forwards and has its clips decided on the
high-precision ratio, the rest on the FP8 ratio. Pure tensor math, tests/algo/test_targeting.py.
"""
from __future__ import annotations

from typing import Sequence

import torch


def engine_gap(rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """[B, S] |engine log-prob - learner pi_old log-prob| per token (float32, on old_logprobs' device): where the two
    precisions disagree already, an update's FP8 ratio is least trustworthy."""
    return (rollout_logprobs.to(old_logprobs.device).float() - old_logprobs.float()).abs()


def targeted_rows(score: torch.Tensor, loss_mask: torch.Tensor, candidates: Sequence[int], fraction: float) -> torch.Tensor:
    """[B] bool on `score`'s device: the round(fraction * len(candidates)) candidate rows (at least 1 when there are
    any) whose per-token `score` summed over their answer tokens (`loss_mask`) is largest; ties go to the lower row,
    so every rank holding the same global batch picks the same rows."""
    if not 0 < fraction <= 1:
        raise ValueError(f"targeted fraction must be in (0, 1], got {fraction}")
    rows = torch.zeros(score.shape[0], dtype=torch.bool, device=score.device)
    if not candidates:
        return rows
    per_row = (score.float() * (loss_mask.to(score.device) > 0)).sum(dim=1)
    cand = torch.as_tensor(list(candidates), dtype=torch.long, device=score.device)
    n = min(len(candidates), max(1, round(fraction * len(candidates))))
    order = torch.sort(per_row[cand], descending=True, stable=True).indices[:n]
    rows[cand[order]] = True
    return rows
