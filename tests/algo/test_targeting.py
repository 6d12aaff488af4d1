"""algo/targeting.py: the targeted decision picks the candidate answers with the largest summed engine-vs-learner gap."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algo.targeting import engine_gap, targeted_rows


def test_picks_the_answers_with_the_largest_summed_score_among_candidates():
    ent = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.5, 9.0], [0.3, 0.3, 0.3], [0.1, 0.1, 0.1], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]], dtype=torch.float32)
    # row 4 has the most but is no candidate (trained on-policy only); row 1's 9.0 sits off its answer
    rows = targeted_rows(ent, mask, [0, 1, 2, 3], 0.5)
    assert rows.tolist() == [False, True, True, False, False]


def test_at_least_one_row_and_none_without_candidates():
    ent, mask = torch.rand(8, 4), torch.ones(8, 4)
    assert int(targeted_rows(ent, mask, [2, 5], 0.01).sum()) == 1
    assert not targeted_rows(ent, mask, [], 0.5).any()
    with pytest.raises(ValueError, match="fraction"):
        targeted_rows(ent, mask, [1], 0.0)


def test_ties_go_to_the_lower_row():
    ent, mask = torch.ones(6, 2), torch.ones(6, 2)
    assert targeted_rows(ent, mask, [1, 3, 4, 5], 0.5).nonzero().flatten().tolist() == [1, 3]


@settings(max_examples=50, deadline=None)
@given(b=st.integers(1, 12), fraction=st.floats(0.01, 1.0), seed=st.integers(0, 2**16))
def test_picked_rows_outscore_the_rest(b, fraction, seed):
    g = torch.Generator().manual_seed(seed)
    ent = torch.rand(b, 5, generator=g)
    mask = (torch.rand(b, 5, generator=g) > 0.3).float()
    cand = [i for i in range(b) if i % 3 != 1]
    rows = targeted_rows(ent, mask, cand, fraction)
    assert not rows[[i for i in range(b) if i not in cand]].any() if len(cand) < b else True
    assert int(rows.sum()) == (min(len(cand), max(1, round(fraction * len(cand)))) if cand else 0)
    score = (ent * mask).sum(1)
    picked, rest = score[rows], score[[i for i in cand if not rows[i]]]
    if picked.numel() and rest.numel():
        assert float(picked.min()) >= float(rest.max())


def test_the_engine_gap_is_absolute_per_token_and_ranks_the_disagreeing_answer_first():
    old = torch.tensor([[-0.1, -0.2, -0.3], [-0.1, -0.2, -0.3], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    engine = old.clone().float()
    engine[0, 1] += 0.5   # the engine is more sure of one token of answer 0
    engine[1, 0] -= 0.2   # and less sure of one of answer 1
    gap = engine_gap(engine, old)
    assert gap.dtype == torch.float32 and gap.device == old.device
    assert torch.allclose(gap[0], torch.tensor([0.0, 0.5, 0.0])) and torch.allclose(gap[1], torch.tensor([0.2, 0.0, 0.0]))
    assert targeted_rows(gap, torch.ones(3, 3), [0, 1, 2], 0.34).tolist() == [True, False, False]
