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
    kw.setdefault("relax_only", False)
    return CalibrationConfig(enabled=True, strength="full", lower_min=1e-3, upper_max=100.0, **kw)


def _event(c: CalibratedClipper, r8, a, r_hp=None, parts: int = 1):
    """The clipper's statistics of one pooled token set, added in `parts` micro-batches."""
    stats = c.new_stats(reference=r_hp is not None)
    for idx in torch.arange(r8.numel()).chunk(parts):
        stats.add(r8[idx], a[idx], ratio_hp=None if r_hp is None else r_hp[idx])
    return stats


def test_clipper_targets_bounds_and_state_round_trip():
    g = torch.Generator().manual_seed(0)
    r_hp = torch.exp(torch.randn(2000, generator=g) * 0.2)
    r8 = r_hp * torch.exp(torch.randn(2000, generator=g) * 0.15)
    a = torch.randn(2000, generator=g)
    c = CalibratedClipper(_cfg(calibrate_every=5, smoothing=0.0), eps_low=0.2, eps_high=0.28)
    assert c.solve(_event(c, r8, a)) is None  # FP8 statistics but no targets yet: nothing to solve at
    assert [float(x) for x in c.bounds()] == pytest.approx([0.8, 1.28])
    sol = c.solve(_event(c, r8, a, r_hp, parts=3))
    t = reference_targets(r_hp, a, eps_low=0.2, eps_high=0.28)
    assert (c.targets.alpha, c.targets.rho) == (pytest.approx(t.alpha, rel=1e-12), pytest.approx(t.rho, rel=1e-12))
    want = [float(x) for x in calibrate_bounds(r8, a, t, eps_low=0.2, eps_high=0.28, lower_min=1e-3, upper_max=100.0)]
    assert [float(x) for x in c.bounds()] == want == [sol.lower, sol.upper]
    m = c.metrics()
    assert m["calib/alpha_achieved"] == pytest.approx(m["calib/alpha_target"], abs=1 / 900)
    assert CalibratedClipper.solution_metrics(sol)["calib/solve_lower"] == want[0]
    # a resumed clipper logs exactly what the original logs (achieved alpha/rho too) and holds its bounds
    c2 = CalibratedClipper(_cfg(calibrate_every=5, smoothing=0.0), eps_low=0.2, eps_high=0.28)
    c2.load_state_dict(c.state_dict())
    assert c2.metrics() == m and c2.targets == c.targets and c2.last == c.last
    assert [float(x) for x in c2.bounds()] == want
    assert torch.equal(c2.generator.get_state(), c.generator.get_state())


def test_clipper_ema_once_per_solve_and_unsmoothed_solve():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(1000, generator=g)
    r1 = torch.exp(torch.randn(1000, generator=g) * 0.2)
    r2 = torch.exp(torch.randn(1000, generator=g) * 0.4)
    c = CalibratedClipper(_cfg(smoothing=0.5), eps_low=0.2, eps_high=0.28)
    t = c.targets = CalibrationTargets.of(0.05, 1.0)  # held targets, as between calibration events
    kw = dict(eps_low=0.2, eps_high=0.28, lower_min=1e-3, upper_max=100.0)
    b1 = [float(x) for x in calibrate_bounds(r1, a, t, **kw)]
    b2 = [float(x) for x in calibrate_bounds(r2, a, t, previous=tuple(b1), **kw)]
    c.solve(_event(c, r1, a, parts=4))  # the first solve of a run is taken as is
    assert [float(x) for x in c.bounds()] == pytest.approx(b1)
    c.solve(_event(c, r2, a, parts=7))  # one EMA update per solve, however many micro-batches fed it
    assert [float(x) for x in c.bounds()] == pytest.approx([0.5 * b1[0] + 0.5 * b2[0], 0.5 * b1[1] + 0.5 * b2[1]], rel=1e-6)
    c.solve(_event(c, r1, a), smooth=False)  # per_minibatch pre-pass: the solution itself
    assert [float(x) for x in c.bounds()] == pytest.approx(b1)


@pytest.mark.parametrize("backend", ["allgather", "histogram"])
def test_pooled_statistics_equal_one_shot_on_the_concatenation(backend):
    g = torch.Generator().manual_seed(5)
    r_hp = torch.exp(torch.randn(1200, generator=g) * 0.25)
    r8 = r_hp * torch.exp(torch.randn(1200, generator=g) * 0.1)
    a = torch.randn(1200, generator=g)
    c = CalibratedClipper(_cfg(backend=backend, smoothing=0.0), eps_low=0.2, eps_high=0.28)
    reduced = _event(c, r8, a, r_hp, parts=5).reduce(None)
    want = reference_targets(r_hp, a, eps_low=0.2, eps_high=0.28)
    assert reduced.targets.alpha == want.alpha and reduced.targets.rho == pytest.approx(want.rho, rel=1e-12)
    one = gather_ratio_stats(r8, a, backend=backend)
    assert reduced.fp8.num_neg == one.num_neg and reduced.fp8.lower_quantile(0.1) == one.lower_quantile(0.1)
    assert reduced.fp8.neg_mass_from(0.9) == pytest.approx(one.neg_mass_from(0.9), rel=1e-12)
    # a new event starts from its own tokens: the targets describe that event only
    c.solve(_event(c, r8[:500], a[:500], r_hp[:500]))
    assert c.targets.alpha == reference_targets(r_hp[:500], a[:500], eps_low=0.2, eps_high=0.28).alpha


def test_empty_side_of_an_event_keeps_the_previous_targets():
    c = CalibratedClipper(_cfg(smoothing=0.0), eps_low=0.2, eps_high=0.28)
    r = torch.tensor([0.5, 0.7, 0.9, 1.1, 1.3])
    c.solve(_event(c, r, torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0]), r))
    before = c.targets
    c.solve(_event(c, r[3:], torch.tensor([1.0, 1.0]), r[3:]))  # positives only: alpha and rho say nothing
    assert (c.targets.alpha, c.targets.rho) == (before.alpha, before.rho)


def test_non_finite_tokens_never_reach_the_bounds():
    c = CalibratedClipper(_cfg(smoothing=0.0), eps_low=0.2, eps_high=0.28)
    r = torch.tensor([0.5, 0.7, 0.9, 1.1, 1.3, float("nan"), float("inf")])
    a = torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 1.0])
    hp = torch.tensor([0.6, 0.75, 0.95, 1.1, 1.2, 0.5, float("nan")])
    stats = c.new_stats(reference=True, record=True)
    stats.add(r, a, ratio_hp=hp)
    assert stats.dump_arrays()["ratio"].tolist() == pytest.approx([0.5, 0.7, 0.9, 1.1, 1.3])  # dumps hold the finite ones
    sol = c.solve(stats)
    assert all(math.isfinite(x) for x in (sol.lower, sol.upper, c.targets.alpha, c.targets.rho))
    assert c.targets.alpha == pytest.approx(2 / 3)  # the NaN token is not one of N


def test_relax_only_guard_rail_order():
    # alpha = 0 (the shadow pass clipped nothing): L would be the smallest FP8 ratio, above 1 - eps_low
    r = torch.tensor([0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2], dtype=torch.float64)
    a = torch.tensor([-1.0, -1.0, -2.0, -1.0, 1.0, 2.0, 1.0], dtype=torch.float64)
    t = CalibrationTargets.of(0.0, 0.5)
    kw = dict(eps_low=0.2, eps_high=0.28, lower_min=0.05, lower_max=1.0, upper_min=1.0, upper_max=10.0)
    stats = gather_ratio_stats(r, a)
    tight = solve_bounds(stats, t, relax_only=False, **kw)
    assert tight.lower == pytest.approx(0.85) and tight.lower_raw == pytest.approx(0.85)
    relaxed = solve_bounds(stats, t, relax_only=True, **kw)
    assert relaxed.lower == pytest.approx(0.8, rel=1e-6) and relaxed.lower_raw == pytest.approx(0.85)
    # H comes from the rule at the relaxed L (C-(0.8) counts every negative token), then relax_only lifts it
    c_minus = sum(-float(a[i] * r[i]) for i in range(len(r)) if a[i] < 0 and r[i] >= 0.8)
    raw_h = stats.smallest_upper(0.5 * c_minus)
    assert relaxed.upper_raw == pytest.approx(raw_h) and raw_h < 1.28
    assert relaxed.upper == pytest.approx(1.28, rel=1e-6)
    # clamps act before relax_only: lower_max 0.9 then relax -> 0.8; lower_min above 1 - eps_low cannot win
    assert solve_bounds(stats, t, relax_only=True, **{**kw, "lower_min": 0.82, "lower_max": 0.9}).lower == pytest.approx(0.8, rel=1e-6)
    # a widening solve is untouched by relax_only
    wide = solve_bounds(gather_ratio_stats(r * 0.5, a), CalibrationTargets.of(0.5, 5.0), relax_only=True, **kw)
    assert wide.lower < 0.8 and wide.lower == pytest.approx(wide.lower_raw, rel=1e-7)


def test_plan_decides_events_off_policy_updates_and_rows():
    from megatron_rl.algo.calibration_plan import CalibrationPlan
    from megatron_rl.config.train import TrainConfig

    train = TrainConfig(num_minibatches=3, ppo_epochs=2)
    cfg = _cfg(calibrate_every=4, bounds_update="per_calibration", shadow_fraction=1.0)
    p0, p1 = CalibrationPlan.build(0, cfg, train, 24), CalibrationPlan.build(1, cfg, train, 24)
    assert p0.event and p0.shadow and not p1.event and not p1.shadow and not p0.per_minibatch
    updates = [(e, k) for e in range(2) for k in range(3)]
    assert [p0.off_policy(e, k) for e, k in updates] == [False] + [True] * 5
    assert [p0.collects(e, k) for e, k in updates] == [False] + [True] * 5
    assert not any(p1.collects(e, k) or p1.shadow_forward(e, k) or p1.prepass(e, k) for e, k in updates)
    assert p0.all_rows and p0.shadow_rows == tuple(range(24))
    assert (p0.solves, p1.solves, p0.smooth, p0.quantile) == (True, False, True, "same_tokens")
    # per_step (the default): every step solves, unsmoothed, for the next step's tokens; shadow forwards on events only
    ps = [CalibrationPlan.build(s, _cfg(calibrate_every=4), train, 24) for s in (0, 1)]
    assert CalibrationConfig().bounds_update == "per_step" and all(p.per_step and p.solves for p in ps)
    assert [ps[1].collects(e, k) for e, k in updates] == [False] + [True] * 5
    assert ps[0].shadow and not ps[1].shadow and not any(ps[1].shadow_forward(e, k) for e, k in updates)
    assert (ps[1].smooth, ps[1].quantile) == (False, "next_tokens")
    # the first update only trains at the clipper's on-policy bounds
    assert [ps[1].open_bounds(e, k) for e, k in updates] == [True] + [False] * 5
    assert [p0.open_bounds(e, k) for e, k in updates] == [True] + [False] * 5  # in every bounds_update mode
    index = torch.tensor([3, 7])
    assert ps[1].fp8_row_mask(index, 2).tolist() == [True, True]  # per_step: every row feeds the FP8 statistics
    pm = CalibrationPlan.build(1, _cfg(calibrate_every=4, bounds_update="per_minibatch"), train, 24)
    assert [pm.prepass(e, k) for e, k in updates] == [False] + [True] * 5 and not pm.event
    assert not CalibrationPlan.build(0, CalibrationConfig(), train, 24).event
    assert not CalibrationPlan.build(0, CalibrationConfig(), train, 24).solves  # calibration off: nothing at all


def test_shadow_rows_are_a_seeded_rank_independent_draw():
    from megatron_rl.algo.calibration_plan import CalibrationPlan
    from megatron_rl.config.train import TrainConfig

    train = TrainConfig(num_minibatches=2)
    plans = [CalibrationPlan.build(s, _cfg(shadow_fraction=0.25, calibrate_every=1), train, 64) for s in range(4)]
    again = [CalibrationPlan.build(s, _cfg(shadow_fraction=0.25, calibrate_every=1), train, 64) for s in range(4)]
    assert plans == again  # what every rank computes
    assert all(len(p.shadow_rows) == 16 and not p.all_rows for p in plans)
    assert len({p.shadow_rows for p in plans}) == 4  # a fresh draw every step
    index = torch.tensor([5, plans[0].shadow_rows[0], 63])
    assert plans[0].row_mask(index, 3).tolist() == [5 in plans[0].shadow_rows, True, 63 in plans[0].shadow_rows]
    assert len(CalibrationPlan.build(0, _cfg(shadow_fraction=0.01), train, 8).shadow_rows) == 1  # never empty
    # a step decided on high-precision ratios: the shadow takes every candidate row (on-policy-only skipped)
    whole = CalibrationPlan.build(0, _cfg(shadow_fraction=0.25, calibrate_every=1), train, 64,
                                  skip_rows=(0, 1), whole_shadow=True)
    assert whole.shadow_rows == tuple(range(2, 64))
    with pytest.raises(ValueError, match="sample_index"):
        plans[0].row_mask(None, 4)


def test_config_errors_name_fields():
    with pytest.raises(ValueError, match=r"algo\.calibration\.bounds_update=per_microbatch was removed.*per_minibatch"):
        CalibrationConfig(bounds_update="per_microbatch")
    from megatron_rl.config import RunConfig

    # single-field ranges are declared on the fields: pydantic names them by their path from the RunConfig
    with pytest.raises(ValueError, match="algo.calibration.upper_max"):
        RunConfig.model_validate({"algo": {"calibration": {"upper_max": 0.5}}})
    with pytest.raises(ValueError, match="algo.calibration.smoothing"):
        RunConfig.model_validate({"algo": {"calibration": {"smoothing": 1.0}}})


def test_bytes_per_call():
    spec = HistSpec(8192, -4, 4)
    h = calibration_bytes("histogram", world_size=8, tokens_per_rank=32768, hist_spec=spec)
    assert h == 2 * 7 * 4 * 8194 * 8 // 8
    ag = calibration_bytes("allgather", world_size=8, tokens_per_rank=32768, max_samples_per_rank=65536)
    assert ag == 7 * (8 + 32768 * 24)
    assert calibration_bytes("allgather", world_size=1, tokens_per_rank=10) == 0


def test_make_clipper_and_histogram_backend():
    from megatron_rl.algo.clipper import make_clipper
    from megatron_rl.config.algo import AlgoConfig

    assert make_clipper(AlgoConfig()) is None
    cfg = AlgoConfig.model_validate({"policy_loss": {"eps_high": 0.28}, "calibration": {"enabled": True, "backend": "histogram", "smoothing": 0.0}})
    c = make_clipper(cfg)
    assert c.cfg.relax_only  # the default guard rail
    g = torch.Generator().manual_seed(2)
    r_hp = torch.exp(torch.randn(3000, generator=g) * 0.2)
    r8 = r_hp * torch.exp(torch.randn(3000, generator=g) * 0.1)
    a = torch.randn(3000, generator=g)
    sol = c.solve(_event(c, r8, a, r_hp, parts=3))
    exact = calibrate_bounds(r8, a, reference_targets(r_hp, a, eps_low=0.2, eps_high=0.28), eps_low=0.2, eps_high=0.28,
                             relax_only=True)
    assert abs(math.log(sol.lower) - math.log(float(exact[0]))) <= HistSpec().width * 1.001


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


@pytest.mark.parametrize("weighted", [False, True])
def test_hp_mask_counts_only_the_shadow_tokens_in_the_targets(weighted):
    """per_step with shadow_fraction < 1: the FP8 statistics take every token, the targets only those with a shadow
    ratio (hp_mask), weighted or not; what lies outside the mask (zeros, NaN) never reaches them."""
    g = torch.Generator().manual_seed(9)
    n = 500
    r8 = torch.exp(torch.randn(n, generator=g) * 0.3)
    r_hp = torch.exp(torch.randn(n, generator=g) * 0.3)
    a = torch.randn(n, generator=g)
    known = torch.rand(n, generator=g) < 0.4
    w = torch.rand(n, generator=g) * 2 if weighted else None
    c = CalibratedClipper(_cfg(), eps_low=0.2, eps_high=0.28)
    stats = c.new_stats(reference=True, weighted=weighted)
    garbage = torch.where(known, r_hp, torch.full_like(r_hp, float("nan")))  # outside the mask: anything
    stats.add(r8, a, ratio_hp=garbage, hp_mask=known, weight=w)
    got = stats.reduce(None)
    sub = c.new_stats(reference=True, weighted=weighted)
    sub.add(r8[known], a[known], ratio_hp=r_hp[known], weight=None if w is None else w[known])
    want = sub.reduce(None).targets
    assert (got.targets.alpha, got.targets.num_neg) == (pytest.approx(want.alpha, rel=1e-12), pytest.approx(want.num_neg))
    assert got.targets.rho == pytest.approx(want.rho, rel=1e-12)
    every = c.new_stats(weighted=weighted)
    every.add(r8, a, weight=w)
    assert got.fp8.num_neg == pytest.approx(every.reduce(None).fp8.num_neg)  # FP8: every token
    assert got.fp8.lower_quantile(0.1) == every.reduce(None).fp8.lower_quantile(0.1)
