"""The dose-response instrument (algo/error_scale.py, experiment only): k = 1 is the ordinary loss bit for bit,
the clip masks follow r_k = r_hp * (r_lp / r_hp)^k as the spec writes it, and the tokens left active keep the
ordinary low-precision gradient."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algo.error_scale import error_scaled_ratio
from megatron_rl.algo.losses import log_ratio, policy_loss
from megatron_rl.algo.metrics import finalize_metrics
from megatron_rl.algo.objective import policy_objective
from megatron_rl.config.algo import AlgoConfig

LO, HI = 0.8, 1.2


def _data(seed: int, b: int = 4, s: int = 9, drift: float = 0.3, noise: float = 0.1):
    """Low- and high-precision log-probs of the same tokens: a policy drift shared by both, a low-precision error on top."""
    g = torch.Generator().manual_seed(seed)
    old_hp = -torch.rand(b, s, generator=g, dtype=torch.float64) * 3
    lp_hp = old_hp + torch.randn(b, s, generator=g, dtype=torch.float64) * drift
    old = old_hp + torch.randn(b, s, generator=g, dtype=torch.float64) * noise
    lp = lp_hp + torch.randn(b, s, generator=g, dtype=torch.float64) * noise
    adv = torch.randn(b, s, generator=g, dtype=torch.float64)
    return lp, old, lp_hp, old_hp, adv


def _loss_and_grad(name, lp, old, adv, decision=None):
    x = lp.clone().requires_grad_(True)
    kw = {} if decision is None else {"decision_ratio": decision}
    out = policy_loss(name, x, old, adv, torch.tensor(LO), torch.tensor(HI), dual_clip_c=torch.tensor(3.0), **kw)
    out.loss.sum().backward()
    return out, x.grad


@pytest.mark.parametrize("name", ["ppo", "dual_clip"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scale_one_is_the_ordinary_loss_bitwise(name, seed):
    lp, old, lp_hp, old_hp, adv = _data(seed)
    r1 = error_scaled_ratio(lp, old, lp_hp, old_hp, 1.0)
    assert torch.equal(r1, torch.exp(log_ratio(lp, old)))
    plain, g_plain = _loss_and_grad(name, lp, old, adv)
    scaled, g_scaled = _loss_and_grad(name, lp, old, adv, r1)
    for a, b in ((plain.loss, scaled.loss), (g_plain, g_scaled), (plain.ratio, scaled.ratio),
                 (plain.clipped_lower, scaled.clipped_lower), (plain.clipped_upper, scaled.clipped_upper)):
        assert torch.equal(a, b)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([0.0, 2.0, 4.0, 8.0]))
def test_masks_follow_the_spec_and_active_gradients_are_unchanged(seed, k):
    lp, old, lp_hp, old_hp, adv = _data(seed)
    r_k = error_scaled_ratio(lp, old, lp_hp, old_hp, k)
    out, grad = _loss_and_grad("ppo", lp, old, adv, r_k)
    plain, g_plain = _loss_and_grad("ppo", lp, old, adv)
    checked = 0
    for (i, j) in torch.cartesian_prod(torch.arange(lp.shape[0]), torch.arange(lp.shape[1])).tolist():
        r_lp, r_hp = math.exp(lp[i, j] - old[i, j]), math.exp(lp_hp[i, j] - old_hp[i, j])
        spec = r_hp * (r_lp / r_hp) ** k  # the formula, written independently
        a = float(adv[i, j])
        if min(abs(spec - LO), abs(spec - HI)) < 1e-9:
            continue  # a tie with a bound: rounding may fall either way
        checked += 1
        assert bool(out.clipped_lower[i, j]) == (a < 0 and spec < LO)
        assert bool(out.clipped_upper[i, j]) == (a > 0 and spec > HI)
        assert float(out.ratio[i, j]) == pytest.approx(spec, rel=1e-9)
        if out.clipped_lower[i, j] or out.clipped_upper[i, j]:
            assert float(grad[i, j]) == 0.0
        else:  # active: d/dlp of -A * r_lp, the ordinary low-precision gradient, whatever k decided
            assert float(grad[i, j]) == pytest.approx(-a * r_lp, rel=1e-12)
            if not (plain.clipped_lower[i, j] or plain.clipped_upper[i, j]):
                assert float(grad[i, j]) == float(g_plain[i, j])
    assert checked > 0


def test_scale_zero_decides_on_the_high_precision_ratio():
    lp, old, lp_hp, old_hp, adv = _data(5, noise=0.3)
    r0 = error_scaled_ratio(lp, old, lp_hp, old_hp, 0.0)
    assert torch.allclose(r0, torch.exp(lp_hp - old_hp), rtol=1e-12, atol=0)


def test_larger_scale_clips_more_negative_tokens_when_the_error_pushes_down():
    """Tokens whose low-precision ratio sits below the high-precision one are pushed further down by k."""
    b, s = 2, 64
    old_hp = torch.full((b, s), -1.0, dtype=torch.float64)
    lp_hp = old_hp + torch.linspace(-0.2, 0.0, s, dtype=torch.float64).expand(b, s)  # r_hp in [0.82, 1]: never clipped
    old, lp = old_hp.clone(), lp_hp - 0.03  # low precision: log-ratio error -0.03 on every token
    adv = -torch.ones(b, s, dtype=torch.float64)
    fractions = []
    for k in (1.0, 2.0, 4.0, 8.0):
        out = policy_loss("ppo", lp, old, adv, torch.tensor(LO), torch.tensor(HI),
                          decision_ratio=error_scaled_ratio(lp, old, lp_hp, old_hp, k))
        fractions.append(float(out.clipped_lower.double().mean()))
    assert fractions == sorted(fractions) and fractions[0] < fractions[-1]


def test_objective_counts_clip_fractions_by_the_decision_ratio():
    lp, old, lp_hp, old_hp, adv = _data(3, noise=0.2)
    mask = torch.ones_like(lp)
    w = mask / mask.sum()
    r4 = error_scaled_ratio(lp, old, lp_hp, old_hp, 4.0)
    _, sums = policy_objective(lp, old, adv, w, mask, cfg=AlgoConfig(), clip_ratio=r4)
    neg = adv < 0
    expected = float((neg & (r4 < LO)).sum()) / float(neg.sum())
    plain = float((neg & (torch.exp(lp - old) < LO)).sum()) / float(neg.sum())
    assert expected != plain  # the data tells the two apart
    got = finalize_metrics(sums, AlgoConfig().ratio_hist_log_range)["clipfrac_lower_neg"]
    assert got == pytest.approx(expected)


def test_cispo_refuses_a_decision_ratio():
    lp, old, lp_hp, old_hp, adv = _data(0)
    with pytest.raises(ValueError, match="cispo"):
        policy_loss("cispo", lp, old, adv, torch.tensor(LO), torch.tensor(HI), decision_ratio=torch.ones_like(lp))
