"""Loss aggregation modes expressed as per-token weights that sum correctly across ranks.

The learner sums `sum(token_weight * per_token_loss)` over all micro-batches and all DP ranks;
`token_weights` chooses the weights so that this sum equals the aggregated loss of the whole
global batch. Compute them on whole sequences (before any context-parallel split): the
per-sequence modes need each sequence's full token count.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_rl.algo.registry import Registry

WeightFn = Callable[[torch.Tensor, float, float, Optional[int]], torch.Tensor]
AGG_MODES: Registry[WeightFn] = Registry("loss aggregation mode")


@AGG_MODES.register("token-mean")
def _token_mean(mask: torch.Tensor, tokens: float, seqs: float, max_len: Optional[int]) -> torch.Tensor:
    return mask / max(tokens, 1.0)


@AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(mask: torch.Tensor, tokens: float, seqs: float, max_len: Optional[int]) -> torch.Tensor:
    per_seq = mask.sum(dim=-1, keepdim=True).clamp_min(1.0)
    return mask / per_seq / max(seqs, 1.0)


@AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(mask: torch.Tensor, tokens: float, seqs: float, max_len: Optional[int]) -> torch.Tensor:
    return mask / max(seqs, 1.0)


@AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(mask: torch.Tensor, tokens: float, seqs: float, max_len: Optional[int]) -> torch.Tensor:
    if not max_len:
        raise ValueError("agg mode seq-mean-token-sum-norm needs max_response_length")
    return mask / (max(seqs, 1.0) * float(max_len))


def count_tokens_and_seqs(loss_mask: torch.Tensor) -> tuple[float, float]:
    """(valid tokens, sequences with at least one valid token) of a [B, S] mask; sum these over ranks."""
    m = loss_mask.to(torch.float64)
    return float(m.sum()), float((m.sum(dim=-1) > 0).sum())


def token_weights(
    loss_mask: torch.Tensor,
    mode: str,
    global_token_count: float,
    global_seq_count: float,
    *,
    max_response_length: Optional[int] = None,
) -> torch.Tensor:
    """[B, S] weights with sum(weight * loss) over every micro-batch and DP rank = the `mode` aggregate.

    global_token_count / global_seq_count are the totals over the whole global batch (all
    ranks), e.g. from `count_tokens_and_seqs` summed across ranks; sequences with no valid
    token get weight 0 and should not be counted.
    """
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [B, S], got shape {tuple(loss_mask.shape)}")
    mask = loss_mask.to(torch.float32)
    return AGG_MODES.get(mode)(mask, float(global_token_count), float(global_seq_count), max_response_length)


def aggregate(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, mode: str, *, max_response_length: Optional[int] = None) -> torch.Tensor:
    """Single-batch aggregation of a [B, S] per-token loss (the counts taken from this batch alone)."""
    tokens, seqs = count_tokens_and_seqs(loss_mask)
    w = token_weights(loss_mask, mode, tokens, seqs, max_response_length=max_response_length)
    return (w * per_token_loss).sum()
