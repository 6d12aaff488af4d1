"""Calibration math: quantile definition, brute-force upper bound, clamps, empty sets, histogram, clipper."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_rl.algo.calibration import (
    CalibrationTargets,
    calibrate_bounds,
    calibration_bytes,
    gather_ratio_stats,
    reference_targets,
    solve_bounds,
)
from megatron_rl.algo.clipper import CalibratedClipper
from megatron_rl.algo.losses import policy_loss
from megatron_rl.algo.ratio_stats import HistSpec, SampleStats
from megatron_rl.config.algo import CalibrationConfig

WIDE = dict(lower_min=1e-9, lower_max=1e9, upper_min=1.0, upper_max=1e9)
ratios_st = st.lists(st.floats(0.05, 4.0, allow_nan=False), min_size=1, max_size=60, unique=True)
advs_st = st.lists(st.floats(0.05, 3.0), min_size=60, max_size=60)


def _data(neg_r, pos_r, advs):
    r = torch.tensor(list(neg_r) + list(pos_r), dtype=torch.float64)
    a = torch.tensor([-advs[i % 60] for i in range(len(neg_r))] + [advs[(i + 7) % 60] for i in range(len(pos_r))], dtype=torch.float64)
    return r, a


def _c_plus(r, a, h):
    return sum(float(a[i] * r[i]) for i in range(len(r)) if a[i] > 0 and r[i] <= h)


def _c_minus(r, a, lo):
    return sum(float(-a[i] * r[i]) for i in range(len(r)) if a[i] < 0 and r[i] >= lo)


@settings(max_examples=100, deadline=None)
@given(ratios_st, st.floats(0.0, 1.0))
def test_fraction_below_lower_is_alpha_within_one_token(neg_r, alpha):
    r = torch.tensor(neg_r, dtype=torch.float64)
    a = -torch.ones_like(r)
    lo, _ = calibrate_bounds(r, a, CalibrationTargets.of(alpha, 1.0), eps_low=0.2, eps_high=0.2, **WIDE)
    lo = float(lo)
    below = sum(1 for x in neg_r if x < lo)
    assert below <= alpha * len(neg_r) + 1e-6
    assert alpha * len(neg_r) - below < 1.0 + 1e-6
    # L is a data point (or just above the largest for alpha = 1), computed in float32 at the end
    assert any(abs(lo - x) <= 2e-6 * x for x in neg_r)


def test_lower_reproduces_reference_fraction_exactly_on_same_data():
    g = torch.Generator().manual_seed(3)
    r = torch.exp(torch.randn(4000, generator=g, dtype=torch.float64) * 0.3)
    a = torch.randn(4000, generator=g, dtype=torch.float64)
    t = reference_targets(r, a, eps_low=0.2, eps_high=0.28)
    lo, hi = calibrate_bounds(r, a, t, eps_low=0.2, eps_high=0.28, **WIDE)
    neg = a < 0
    assert int((r[neg] < float(lo)).sum()) == int((r[neg] < 0.8).sum())
    # same data: H reproduces rho, i.e. the bf16 bound's contribution
    assert _c_plus(r, a, float(hi)) == pytest.approx(_c_plus(r, a, 1.28), rel=1e-9)


@settings(max_examples=80, deadline=None)
@given(ratios_st, ratios_st, advs_st, st.floats(0.0, 1.0), st.floats(0.0, 5.0))
def test_upper_is_smallest_bound_reaching_rho(neg_r, pos_r, advs, alpha, rho):
    r, a = _data(neg_r, pos_r, advs)
    lo, hi = calibrate_bounds(r, a, CalibrationTargets.of(alpha, rho), eps_low=0.2, eps_high=0.2, **WIDE)
    lo_f = float(lo)
    cm = _c_minus(r, a, lo_f)
    assume(cm > 0)
    # brute force over every candidate: 1, each positive ratio, and a grid
    cands = sorted({1.0} | {x for x in pos_r if x >= 1.0} | {1.0 + k / 64 for k in range(64 * 4)})
    reach = [h for h in cands if _c_plus(r, a, h) / cm >= rho * (1 - 1e-9)]
    want = reach[0] if reach else max(1.0, max(pos_r))
    if not reach:  # unreachable: all positive tokens active
        assert float(hi) == pytest.approx(want, rel=1e-6)
    else:
        # the smallest bound is a data point (or 1): the grid cannot undercut it
        assert float(hi) == pytest.approx(want, rel=1e-6)
        assert _c_plus(r, a, float(hi) * (1 + 1e-6)) / cm >= rho * (1 - 1e-6)


@settings(max_examples=60, deadline=None)
@given(ratios_st, ratios_st, advs_st, st.floats(0.0, 1.0), st.floats(0.0, 5.0), st.sampled_from(["match_contribution", "log_scale", "fixed"]))
def test_bounds_clamped_and_finite(neg_r, pos_r, advs, alpha, rho, rule):
    r, a = _data(neg_r, pos_r, advs)
    clamps = dict(lower_min=0.7, lower_max=0.95, upper_min=1.1, upper_max=1.5)
    lo, hi = calibrate_bounds(r, a, CalibrationTargets.of(alpha, rho), eps_low=0.2, eps_high=0.28, upper=rule, **clamps)
    assert lo.dim() == 0 and hi.dim() == 0 and lo.dtype == r.dtype
    assert 0.7 - 1e-6 <= float(lo) <= 0.95 + 1e-6 and 1.1 - 1e-6 <= float(hi) <= 1.5 + 1e-6


def test_upper_rules():
    r = torch.tensor([0.5, 0.7, 0.9, 1.1, 1.3], dtype=torch.float64)
    a = torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    t = CalibrationTargets.of(1 / 3, 1.0)
    lo, hi = calibrate_bounds(r, a, t, eps_low=0.2, eps_high=0.28, upper="log_scale", **WIDE)
    assert float(lo) == pytest.approx(0.7)
    assert float(hi) == pytest.approx(math.exp(math.log(1.28) * math.log(0.7) / math.log(0.8)), rel=1e-6)
    _, hi = calibrate_bounds(r, a, t, eps_low=0.2, eps_high=0.28, upper="fixed", **WIDE)
    assert float(hi) == pytest.approx(1.28)
    with pytest.raises(ValueError, match="fixed, log_scale, match_contribution"):
        calibrate_bounds(r, a, t, eps_low=0.2, eps_high=0.28, upper="max")
    with pytest.raises(ValueError, match="allgather, histogram"):
        calibrate_bounds(r, a, t, eps_low=0.2, eps_high=0.28, backend="nccl")


@pytest.mark.parametrize("backend", ["allgather", "histogram"])
def test_empty_sets_keep_previous(backend):
    t = CalibrationTargets.of(0.1, 1.0)
    kw = dict(eps_low=0.2, eps_high=0.28, backend=backend, previous=(0.7, 1.4))
    empty = torch.zeros(0)
    assert [float(x) for x in calibrate_bounds(empty, empty, t, **kw)] == pytest.approx([0.7, 1.4])
    pos_only = torch.tensor([1.1, 1.5]), torch.tensor([1.0, 2.0])
    lo, hi = calibrate_bounds(*pos_only, t, **kw)
    assert float(lo) == pytest.approx(0.7) and math.isfinite(float(hi))
    neg_only = torch.tensor([0.6, 0.9]), torch.tensor([-1.0, -2.0])
    lo, hi = calibrate_bounds(*neg_only, t, **kw)
    assert float(hi) == pytest.approx(1.4) and math.isfinite(float(lo))
    zero_adv = torch.tensor([0.6, 1.9]), torch.zeros(2)
    assert [float(x) for x in calibrate_bounds(*zero_adv, t, **kw)] == pytest.approx([0.7, 1.4])


def test_reference_targets_formulas_and_empty():
    r = torch.tensor([0.5, 0.85, 0.95, 1.2, 1.4, 0.9], dtype=torch.float64)
    a = torch.tensor([-1.0, -2.0, -1.0, 1.0, 3.0, 0.0], dtype=torch.float64)
    t = reference_targets(r, a, eps_low=0.2, eps_high=0.28)
    assert float(t.alpha) == pytest.approx(1 / 3)
    assert float(t.rho) == pytest.approx(1.2 / (2 * 0.85 + 0.95))
    e = reference_targets(torch.zeros(0), torch.zeros(0), eps_low=0.2, eps_high=0.28)
    assert float(e.alpha) == 0.0 and float(e.rho) == 0.0 and float(e.num_neg) == 0.0
    only_pos = reference_targets(torch.tensor([1.1]), torch.tensor([1.0]), eps_low=0.2, eps_high=0.28)
    assert math.isinf(float(only_pos.rho)) and not math.isnan(float(only_pos.alpha))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.0, 0.5), st.floats(0.3, 3.0))
def test_histogram_within_one_bin(seed, alpha, rho):
    g = torch.Generator().manual_seed(seed)
    r = torch.exp(torch.randn(3000, generator=g) * 0.25)
    a = torch.randn(3000, generator=g)
    spec = HistSpec(8192, -4.0, 4.0)
    t = CalibrationTargets.of(alpha, rho)
    exact = SampleStats(r, a)
    hist = gather_ratio_stats(r, a, backend="histogram", hist_spec=spec)
    lo_e = exact.lower_quantile(alpha)
    sol = solve_bounds(hist, t, eps_low=0.2, eps_high=0.28, **WIDE)
    lo_h = float(sol.lower)
    assert abs(math.log(lo_h) - math.log(lo_e)) <= spec.width * 1.001
    hi_e = exact.smallest_upper(rho * exact.neg_mass_from(lo_h))
    assert abs(math.log(float(sol.upper)) - math.log(hi_e)) <= spec.width * 1.001


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.02, 0.3))
def test_calibrated_bounds_zero_gradient_exactly_for_clipped(seed, alpha):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(400, generator=g, dtype=torch.float64) * 3
    lp = (old + torch.randn(400, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    adv = torch.randn(400, generator=g, dtype=torch.float64)
    r = torch.exp(lp.detach() - old)
    lo, hi = calibrate_bounds(r, adv, CalibrationTargets.of(alpha, 1.0), eps_low=0.2, eps_high=0.28, **WIDE)
    out = policy_loss("ppo", lp, old, adv, lo, hi)
    out.loss.sum().backward()
    clipped = ((adv < 0) & (r < lo)) | ((adv > 0) & (r > hi))
    assert clipped.any()
    assert torch.all(lp.grad[clipped] == 0)
    assert torch.all(lp.grad[~clipped] != 0)


def _cfg(**kw):
    return CalibrationConfig(enabled=True, lower_min=1e-3, upper_max=100.0, **kw)


def test_clipper_schedule_targets_and_state():
    g = torch.Generator().manual_seed(0)
    r_hp = torch.exp(torch.randn(2000, generator=g) * 0.2)
    r8 = r_hp * torch.exp(torch.randn(2000, generator=g) * 0.15)
    a = torch.randn(2000, generator=g)
    c = CalibratedClipper(_cfg(calibrate_every=5, smoothing=0.0), eps_low=0.2, eps_high=0.28)
    assert [float(x) for x in c.update(r8, a)] == pytest.approx([0.8, 1.28])  # no targets yet
    assert c.wants_shadow(0, 0) and c.wants_shadow(10, 3) and not c.wants_shadow(3, 0)
    c.begin_step(0)
    lo, hi = c.update(r8, a, ratio_hp=r_hp)
    t = reference_targets(r_hp, a, eps_low=0.2, eps_high=0.28)
    want = calibrate_bounds(r8, a, t, eps_low=0.2, eps_high=0.28, lower_min=1e-3, upper_max=100.0)
    assert [float(lo), float(hi)] == pytest.approx([float(x) for x in want])
    # per_calibration: held on other micro-batches
    assert [float(x) for x in c.update(r8 * 0.5, a)] == pytest.approx([float(lo), float(hi)])
    m = c.metrics()
    assert m["calib/alpha_achieved"] == pytest.approx(m["calib/alpha_target"], abs=1 / 900)
    c2 = CalibratedClipper(_cfg(calibrate_every=5, smoothing=0.0), eps_low=0.2, eps_high=0.28)
    c2.load_state_dict(c.state_dict())
    assert c2.state_dict()["targets"] == c.state_dict()["targets"]
    assert [float(x) for x in c2.update(r8 * 0.5, a)] == pytest.approx([float(lo), float(hi)])


def test_clipper_ema_and_per_microbatch_static():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(1000, generator=g)
    r1 = torch.exp(torch.randn(1000, generator=g) * 0.2)
    r2 = torch.exp(torch.randn(1000, generator=g) * 0.4)
    c = CalibratedClipper(_cfg(target_source="static", static_alpha=0.05, static_rho=1.0, bounds_update="per_microbatch", smoothing=0.5), eps_low=0.2, eps_high=0.28)
    t = CalibrationTargets.of(0.05, 1.0)
    kw = dict(eps_low=0.2, eps_high=0.28, lower_min=1e-3, upper_max=100.0)
    b1 = [float(x) for x in calibrate_bounds(r1, a, t, **kw)]
    b2 = [float(x) for x in calibrate_bounds(r2, a, t, previous=tuple(b1), **kw)]
    assert [float(x) for x in c.update(r1, a)] == pytest.approx(b1)
    assert [float(x) for x in c.update(r2, a)] == pytest.approx([0.5 * b1[0] + 0.5 * b2[0], 0.5 * b1[1] + 0.5 * b2[1]])
    assert not c.wants_shadow(0, 0)


def test_shadow_fraction_draw_is_deterministic():
    c = CalibratedClipper(_cfg(shadow_fraction=0.5, seed=7), eps_low=0.2, eps_high=0.2)
    draws = [c.wants_shadow(0, mb) for mb in range(200)]
    again = CalibratedClipper(_cfg(shadow_fraction=0.5, seed=7), eps_low=0.2, eps_high=0.2)
    assert draws == [again.wants_shadow(0, mb) for mb in range(200)]
    assert 60 < sum(draws) < 140


def test_config_errors_name_fields():
    with pytest.raises(ValueError, match="algo.calibration.static_alpha"):
        CalibrationConfig(target_source="static")
    from megatron_rl.config import RunConfig

    # single-field ranges are declared on the fields: pydantic names them by their path from the RunConfig
    with pytest.raises(ValueError, match="algo.calibration.upper_min"):
        RunConfig.model_validate({"algo": {"calibration": {"upper_min": 0.5}}})
    with pytest.raises(ValueError, match="algo.calibration.smoothing"):
        RunConfig.model_validate({"algo": {"calibration": {"smoothing": 1.0}}})


def test_bytes_per_call():
    spec = HistSpec(8192, -4, 4)
    h = calibration_bytes("histogram", world_size=8, tokens_per_rank=32768, hist_spec=spec)
    assert h == 2 * 7 * 4 * 8194 * 8 // 8
    ag = calibration_bytes("allgather", world_size=8, tokens_per_rank=32768, max_samples_per_rank=65536)
    assert ag == 7 * (8 + 32768 * 24)
    assert calibration_bytes("allgather", world_size=1, tokens_per_rank=10) == 0


def test_clipper_pools_shadow_microbatches_of_a_step():
    g = torch.Generator().manual_seed(5)
    r_hp = torch.exp(torch.randn(1200, generator=g) * 0.25)
    a = torch.randn(1200, generator=g)
    c = CalibratedClipper(_cfg(), eps_low=0.2, eps_high=0.28)
    c.begin_step(0)
    c.update(r_hp[:500], a[:500], ratio_hp=r_hp[:500])
    c.update(r_hp[500:], a[500:], ratio_hp=r_hp[500:])
    want = reference_targets(r_hp, a, eps_low=0.2, eps_high=0.28)
    assert float(c.targets.alpha) == float(want.alpha)
    assert float(c.targets.rho) == pytest.approx(float(want.rho), rel=1e-12)
    c.begin_step(20)  # a new step starts a new pool
    c.update(r_hp[:500], a[:500], ratio_hp=r_hp[:500])
    assert float(c.targets.alpha) == float(reference_targets(r_hp[:500], a[:500], eps_low=0.2, eps_high=0.28).alpha)


def test_make_clipper_and_histogram_backend():
    from megatron_rl.algo.clipper import make_clipper
    from megatron_rl.config.algo import AlgoConfig

    assert make_clipper(AlgoConfig()) is None
    cfg = AlgoConfig.model_validate({"policy_loss": {"eps_high": 0.28}, "calibration": {"enabled": True, "backend": "histogram", "smoothing": 0.0}})
    c = make_clipper(cfg)
    g = torch.Generator().manual_seed(2)
    r_hp = torch.exp(torch.randn(3000, generator=g) * 0.2)
    r8 = r_hp * torch.exp(torch.randn(3000, generator=g) * 0.1)
    a = torch.randn(3000, generator=g)
    c.begin_step(0)
    lo, hi = c.update(r8, a, ratio_hp=r_hp)
    exact = calibrate_bounds(r8, a, reference_targets(r_hp, a, eps_low=0.2, eps_high=0.28), eps_low=0.2, eps_high=0.28)
    assert abs(math.log(float(lo)) - math.log(float(exact[0]))) <= HistSpec().width * 1.001


def test_local_collectives_are_identity():
    from megatron_rl.parallel.collectives import all_gather_variable, all_reduce_sum, gather_samples, subsample_rows

    rows = torch.arange(12.0).reshape(6, 2)
    assert torch.equal(all_reduce_sum(rows, None), rows)
    out, counts = all_gather_variable(rows, None)
    assert torch.equal(out, rows) and counts.tolist() == [6]
    out, w = gather_samples(rows, 2, None)  # no group: nothing to cap
    assert torch.equal(out, rows) and w.tolist() == [1.0] * 6
    kept, weight = subsample_rows(rows, 4, torch.Generator().manual_seed(0))
    assert kept.shape == (4, 2) and weight == 1.5
    assert all(any(torch.equal(k, r) for r in rows) for k in kept)
