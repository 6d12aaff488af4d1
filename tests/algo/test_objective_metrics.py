"""policy_objective against a naive per-token composition; metrics add up across micro-batches."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algo.aggregation import count_tokens_and_seqs, token_weights
from megatron_rl.algo.metrics import add_sums, finalize_metrics, mismatch_sums, quantiles_from_histogram, ratio_histograms
from megatron_rl.algo.objective import default_bounds, policy_objective
from megatron_rl.config.algo import AlgoConfig


def _batch(seed: int, b: int = 6, s: int = 8):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, s, generator=g, dtype=torch.float64) * 2 - 0.1
    lp = old + torch.randn(b, s, generator=g, dtype=torch.float64) * 0.3
    roll = old + torch.randn(b, s, generator=g, dtype=torch.float64) * 0.2
    ref = old + torch.randn(b, s, generator=g, dtype=torch.float64) * 0.2
    ent = torch.rand(b, s, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, s, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, s) * mask
    return lp, old, roll, ref, ent, mask, adv


def _naive_loss(lp, old, roll, ref, ent, mask, adv, w, cfg, lo, hi):
    total = 0.0
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            if mask[i, j] == 0:
                continue
            r = math.exp(float(lp[i, j] - old[i, j]))
            a = float(adv[i, j])
            pg = max(-a * r, -a * min(max(r, lo), hi))
            tis = min(math.exp(float(old[i, j] - roll[i, j])), cfg.rollout_correction.tis_cap)
            d = float(ref[i, j] - lp[i, j])
            k3 = math.exp(d) - d - 1
            total += float(w[i, j]) * (pg * tis + cfg.kl.coef * k3 - cfg.policy_loss.entropy_coef * float(ent[i, j]))
    return total


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["token-mean", "seq-mean-token-mean"]))
def test_objective_matches_naive(seed, mode):
    lp, old, roll, ref, ent, mask, adv = _batch(seed)
    cfg = AlgoConfig.model_validate({"policy_loss": {"eps_high": 0.28, "entropy_coef": 0.01, "agg_mode": mode}, "kl": {"coef": 0.05, "estimator": "k3"}})
    t, s = count_tokens_and_seqs(mask)
    w = token_weights(mask, mode, t, s).double()
    lo, hi = torch.tensor(0.85, dtype=torch.float64), torch.tensor(1.2, dtype=torch.float64)
    loss, _ = policy_objective(lp, old, adv, w, mask, (lo, hi), roll, ref, ent, cfg)
    assert float(loss) == pytest.approx(_naive_loss(lp, old, roll, ref, ent, mask, adv, w, cfg, 0.85, 1.2), rel=1e-6, abs=1e-9)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4))
def test_microbatch_sums_equal_full_batch(seed, mbs):
    lp, old, roll, ref, ent, mask, adv = _batch(seed)
    cfg = AlgoConfig()
    t, s = count_tokens_and_seqs(mask)
    w = token_weights(mask, cfg.policy_loss.agg_mode, t, s).double()
    bounds = default_bounds(cfg)
    full_loss, full = policy_objective(lp, old, adv, w, mask, bounds, roll, None, ent, cfg)
    total, loss = None, 0.0
    for k in range(mbs):
        rows = list(range(k, lp.shape[0], mbs))
        l, m = policy_objective(lp[rows], old[rows], adv[rows], w[rows], mask[rows], bounds, roll[rows], None, ent[rows], cfg)
        loss, total = loss + float(l), add_sums(total, m)
    assert loss == pytest.approx(float(full_loss), rel=1e-9, abs=1e-12)
    a, b = finalize_metrics(total), finalize_metrics(full)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12, nan_ok=True), key


def test_clip_fraction_metrics_by_sign():
    lp = torch.log(torch.tensor([[0.5, 0.9, 1.5, 1.1, 0.7, 2.0]], dtype=torch.float64))
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 6, dtype=torch.float64)
    _, m = policy_objective(lp, torch.zeros_like(lp), adv, mask / 6, mask, (torch.tensor(0.8), torch.tensor(1.2)))
    f = finalize_metrics(m)
    assert f["clipfrac_lower_neg"] == pytest.approx(1 / 3)  # 0.5 of {0.5, 0.9, 2.0}
    assert f["clipfrac_upper_pos"] == pytest.approx(1 / 3)  # 1.5 of {1.5, 1.1, 0.7}
    assert f["clipfrac"] == pytest.approx(2 / 6)


def test_objective_requires_inputs_for_enabled_terms():
    lp = torch.zeros(1, 2)
    cfg = AlgoConfig.model_validate({"kl": {"coef": 0.1}})
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_objective(lp, lp, lp, lp, torch.ones(1, 2), cfg=cfg)
    cfg = AlgoConfig.model_validate({"policy_loss": {"entropy_coef": 0.1}})
    with pytest.raises(ValueError, match="entropy"):
        policy_objective(lp, lp, lp, lp, torch.ones(1, 2), cfg=cfg)


def test_mismatch_metrics_naive():
    tr = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    ro = torch.tensor([[-1.1, -1.7, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    f = finalize_metrics(mismatch_sums(tr, ro, mask))
    d = [0.1, -0.3]
    assert f["mismatch_abs_dlogp"] == pytest.approx(0.2)
    assert f["token_mult_prob_error"] == pytest.approx(sum(math.exp(abs(x)) for x in d) / 2)
    assert f["mismatch_k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 2)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_histogram_quantiles_within_a_bin(seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.exp(torch.randn(1, 500, generator=g, dtype=torch.float64) * 0.3)
    adv = -torch.ones(1, 500, dtype=torch.float64)
    h = ratio_histograms(r, adv, torch.ones(1, 500), bins=512, log_range=2.0)["hist/ratio_neg"]
    width = 4.0 / 512
    srt = r.flatten().sort().values
    for q, val in zip((0.01, 0.5, 0.99), quantiles_from_histogram(h, 2.0, (0.01, 0.5, 0.99))):
        exact = float(srt[max(math.ceil(q * 500) - 1, 0)])
        assert abs(math.log(val) - math.log(exact)) <= width
