"""Policy losses, KL estimators and rollout correction against naive per-token formulas."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algo.kl import entropy_bonus, kl_penalty
from megatron_rl.algo.losses import policy_loss
from megatron_rl.algo.rollout_correction import rollout_correction


def _data(seed: int, b: int = 3, s: int = 7, spread: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, s, generator=g, dtype=torch.float64) * 3
    lp = old + torch.randn(b, s, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(b, s, generator=g, dtype=torch.float64)
    adv[0, 0] = 0.0
    return lp, old, adv


def _ppo_naive(lp, old, a, lo, hi, c=None):
    r = math.exp(lp - old)
    clipped_r = min(max(r, lo), hi)
    loss = max(-a * r, -a * clipped_r)
    if c is not None and a < 0:
        loss = min(loss, -a * c)
    return loss


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.3, 1.0), st.floats(1.0, 2.0), st.sampled_from(["ppo", "dual_clip"]))
def test_ppo_and_dual_clip_values(seed, lo, hi, name):
    lp, old, adv = _data(seed, spread=1.0)
    out = policy_loss(name, lp, old, adv, torch.tensor(lo), torch.tensor(hi), dual_clip_c=torch.tensor(3.0))
    c = 3.0 if name == "dual_clip" else None
    for i, j in torch.cartesian_prod(torch.arange(3), torch.arange(7)).tolist():
        want = _ppo_naive(float(lp[i, j]), float(old[i, j]), float(adv[i, j]), lo, hi, c)
        assert math.isclose(float(out.loss[i, j]), want, rel_tol=1e-6, abs_tol=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.5, 1.0), st.floats(1.0, 1.6))
def test_zero_gradient_exactly_on_clipped_tokens(seed, lo, hi):
    lp, old, adv = _data(seed)
    lp.requires_grad_(True)
    out = policy_loss("ppo", lp, old, adv, torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64))
    out.loss.sum().backward()
    r = torch.exp(lp.detach() - old)
    clipped = ((adv < 0) & (r < lo)) | ((adv > 0) & (r > hi))
    assert torch.equal(clipped, out.clipped_lower | out.clipped_upper)
    assert torch.all(lp.grad[clipped] == 0)
    active = ~clipped & (adv != 0)
    assert torch.all(lp.grad[active] != 0)
    # d(-A r)/d logp = -A r for every active token
    assert torch.allclose(lp.grad[active], (-adv * r)[active])


def test_dual_clip_caps_negative_tokens():
    lp = torch.tensor([math.log(5.0)], requires_grad=True)
    out = policy_loss("dual_clip", lp, torch.zeros(1), torch.tensor([-1.0]), torch.tensor(0.8), torch.tensor(1.2), dual_clip_c=3.0)
    out.loss.sum().backward()
    assert float(out.loss.detach()) == pytest.approx(3.0)
    assert bool(out.clipped_dual[0]) and float(lp.grad[0]) == 0.0


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_cispo_gradient(seed):
    lp, old, adv = _data(seed, spread=0.6)
    lp.requires_grad_(True)
    lo, hi = 0.8, 1.28
    out = policy_loss("cispo", lp, old, adv, torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64))
    out.loss.sum().backward()
    r = torch.exp(lp.detach() - old)
    want = -adv * r.clamp(lo, hi)  # d/dlogp of -A * sg(clip r) * logp
    assert torch.allclose(lp.grad, want)


def test_unknown_loss_lists_names():
    with pytest.raises(ValueError, match="cispo, dual_clip, ppo"):
        policy_loss("grpo", torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.tensor(0.8), torch.tensor(1.2))


@settings(max_examples=60, deadline=None)
@given(st.floats(-8, 0), st.floats(-8, 0))
def test_kl_estimators(lp, ref):
    lpt, reft = torch.tensor([lp], dtype=torch.float64), torch.tensor([ref], dtype=torch.float64)
    assert float(kl_penalty(lpt, reft, "k1")) == pytest.approx(lp - ref)
    assert float(kl_penalty(lpt, reft, "k2")) == pytest.approx(0.5 * (lp - ref) ** 2)
    assert float(kl_penalty(lpt, reft, "k3")) == pytest.approx(math.exp(ref - lp) - (ref - lp) - 1, rel=1e-9, abs=1e-12)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(lpt, reft, "k4")


def test_k3_is_unbiased_kl():
    # E_{x~p}[k3(log p, log q)] with d = log q - log p equals KL(p || q)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    est = (p * kl_penalty(p.log(), q.log(), "k3")).sum()
    assert float(est) == pytest.approx(float((p * (p / q).log()).sum()))


def test_entropy_bonus():
    assert entropy_bonus(torch.tensor([2.0, 0.5]), torch.tensor(0.1)).tolist() == pytest.approx([-0.2, -0.05])


def _rc_naive(old, roll, mask, mode, level, cap=2.0, low=0.5, high=2.0):
    b, s = old.shape
    out = torch.zeros(b, s, dtype=torch.float64)
    for i in range(b):
        seq_lw = sum(float(old[i, j] - roll[i, j]) for j in range(s) if mask[i, j] > 0)
        for j in range(s):
            if mask[i, j] == 0:
                continue
            w = math.exp(seq_lw if level == "sequence" else float(old[i, j] - roll[i, j]))
            out[i, j] = min(w, cap) if mode == "tis" else (w if low <= w <= high else 0.0)
    return out


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["tis", "mis"]), st.sampled_from(["token", "sequence"]))
def test_rollout_correction(seed, mode, level):
    old, roll, _ = _data(seed, spread=0.5)
    roll = old + (roll - old) * (0.3 if level == "sequence" else 1.0)
    mask = (torch.rand(3, 7, generator=torch.Generator().manual_seed(seed)) > 0.3).double()
    got = rollout_correction(old, roll, mask, mode=mode, level=level, tis_cap=2.0, mis_low=0.5, mis_high=2.0)
    want = _rc_naive(old, roll, mask, mode, level)
    assert torch.allclose(got.weight.double(), want, rtol=1e-6, atol=1e-9)
    valid = mask > 0
    if mode == "tis":
        assert torch.equal(got.clipped, valid & (got.raw_weight > 2.0))
    else:
        assert torch.equal(got.clipped, valid & (want == 0))
    with pytest.raises(ValueError, match="mis, none, tis"):
        rollout_correction(old, roll, mask, mode="icepop")
