"""Advantage estimators and DAPO helpers against naive per-group loops."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algo.advantages import compute_advantages, expand_to_tokens
from megatron_rl.algo.dapo import dynamic_sampling_keep, expand_group_mask, overlong_penalty

rewards_st = st.integers(1, 6).flatmap(
    lambda n: st.tuples(st.just(n), st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.5]), min_size=n, max_size=6 * n).map(lambda xs: xs[: len(xs) // n * n]))
).filter(lambda t: len(t[1]) > 0)


def _naive(rewards: list[float], n: int, kind: str, eps: float = 1e-6, unbiased: bool = True) -> list[float]:
    out = []
    for g in range(len(rewards) // n):
        grp = rewards[g * n:(g + 1) * n]
        mean = sum(grp) / n
        for i, r in enumerate(grp):
            if kind == "drgrpo":
                out.append(r - mean)
            elif kind == "rloo":
                out.append(0.0 if n == 1 else r - (sum(grp) - r) / (n - 1))
            else:
                if n == 1:
                    out.append(0.0)
                    continue
                var = sum((x - mean) ** 2 for x in grp) / ((n - 1) if unbiased else n)
                out.append((r - mean) / (math.sqrt(var) + eps))
    return out


@settings(max_examples=60, deadline=None)
@given(rewards_st, st.sampled_from(["grpo", "drgrpo", "rloo"]), st.booleans())
def test_estimators_match_naive(case, kind, unbiased):
    n, rewards = case
    kwargs = {"std_eps": 1e-6, "unbiased_std": unbiased} if kind == "grpo" else {}
    got = compute_advantages(torch.tensor(rewards), n, kind, **kwargs)
    want = _naive(rewards, n, kind, unbiased=unbiased)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float32), atol=1e-4, rtol=1e-4)


def test_unknown_estimator_lists_names():
    with pytest.raises(ValueError, match="drgrpo, grpo, rloo"):
        compute_advantages(torch.zeros(4), 2, "ppo")


def test_bad_group_size():
    with pytest.raises(ValueError, match="multiple of group size"):
        compute_advantages(torch.zeros(5), 2)


def test_expand_to_tokens():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    out = expand_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[0, 2, 2, 0], [-1, -1, 0, 0]]


@settings(max_examples=60, deadline=None)
@given(rewards_st)
def test_dynamic_sampling_keep(case):
    n, rewards = case
    keep = dynamic_sampling_keep(torch.tensor(rewards), n)
    want = [len(set(rewards[g * n:(g + 1) * n])) > 1 for g in range(len(rewards) // n)]
    assert keep.tolist() == want
    assert expand_group_mask(keep, n).tolist() == [k for k in want for _ in range(n)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 120), min_size=1, max_size=20), st.integers(1, 40), st.floats(0.1, 3.0))
def test_overlong_penalty_matches_formula(lengths, buf, factor):
    lmax = 100
    got = overlong_penalty(torch.tensor(lengths), lmax, buf, factor)
    want = [min(-(L - (lmax - buf)) / buf * factor, 0.0) for L in lengths]
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float32), atol=1e-5)


def test_overlong_penalty_off_without_buffer():
    assert overlong_penalty(torch.tensor([5, 500]), 100, 0).tolist() == [0.0, 0.0]
