"""token_weights: summing weight * loss over micro-batches and DP ranks equals the naive aggregate."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algo.aggregation import aggregate, count_tokens_and_seqs, token_weights

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
MAX_LEN = 9


def _naive(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> float:
    seqs = []
    for i in range(loss.shape[0]):
        toks = [float(loss[i, j]) for j in range(loss.shape[1]) if mask[i, j] > 0]
        if toks:
            seqs.append(toks)
    all_toks = [t for s in seqs for t in s]
    if mode == "token-mean":
        return sum(all_toks) / len(all_toks)
    if mode == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in seqs) / len(seqs)
    if mode == "seq-mean-token-sum":
        return sum(sum(s) for s in seqs) / len(seqs)
    return sum(all_toks) / (len(seqs) * MAX_LEN)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 12), st.integers(1, 4), st.integers(1, 3), st.sampled_from(MODES))
def test_sum_over_microbatches_and_ranks_equals_aggregate(seed, batch, ranks, mbs, mode):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(batch, MAX_LEN, generator=g, dtype=torch.float64)
    mask = (torch.rand(batch, MAX_LEN, generator=g) > 0.4).float()
    mask[0, 0] = 1.0  # at least one valid token
    # the learner's view: rows dealt to ranks, then cut into micro-batches; counts summed over ranks
    rank_rows = [list(range(r, batch, ranks)) for r in range(ranks)]
    tokens = seqs = 0.0
    for rows in rank_rows:
        t, s = count_tokens_and_seqs(mask[rows])
        tokens, seqs = tokens + t, seqs + s
    total = 0.0
    for rows in rank_rows:
        for mb in range(mbs):
            sub = rows[mb::mbs]
            if not sub:
                continue
            w = token_weights(mask[sub], mode, tokens, seqs, max_response_length=MAX_LEN)
            total += float((w.double() * loss[sub]).sum())
    assert total == pytest.approx(_naive(loss, mask, mode), rel=1e-5, abs=1e-6)
    assert float(aggregate(loss, mask, mode, max_response_length=MAX_LEN)) == pytest.approx(_naive(loss, mask, mode), rel=1e-5, abs=1e-6)


def test_unknown_mode_and_missing_norm():
    m = torch.ones(2, 3)
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        token_weights(m, "sum", 6, 2)
    with pytest.raises(ValueError, match="max_response_length"):
        token_weights(m, "seq-mean-token-sum-norm", 6, 2)


def test_weights_zero_off_mask():
    m = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    for mode in MODES:
        w = token_weights(m, mode, 2, 1, max_response_length=3)
        assert torch.all(w[m == 0] == 0)
