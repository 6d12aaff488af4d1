"""The project's solve (RatioStats pooled over micro-batches + CalibratedClipper.solve) against the independent
numpy implementation of the spec in tests/calibration_spec.py, on random pooled token sets."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from calibration_spec import spec_solve
from megatron_rl.algo.calibration import HIST_BINS, HIST_LOG_MAX, HIST_LOG_MIN
from megatron_rl.algo.clipper import CalibratedClipper
from megatron_rl.algo.ratio_stats import SampleStats
from megatron_rl.config.algo import CalibrationConfig


def _tokens(seed: int, n: int, noise: float, hp_scale: float):
    g = torch.Generator().manual_seed(seed)
    r_hp = torch.exp(torch.randn(n, generator=g) * hp_scale)
    r8 = r_hp * torch.exp(torch.randn(n, generator=g) * noise)
    adv = torch.randn(n, generator=g)
    adv[torch.rand(n, generator=g) < 0.1] = 0.0  # tokens of groups without reward spread
    return r8.float(), r_hp.float(), adv.float()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 600), st.floats(0.0, 0.3), st.floats(0.01, 0.4), st.booleans(),
       st.integers(1, 5))
def test_solve_matches_the_spec(seed, n, noise, hp_scale, relax_only, parts):
    r8, r_hp, adv = _tokens(seed, n, noise, hp_scale)
    clipper = CalibratedClipper(CalibrationConfig(enabled=True, strength="full", smoothing=0.0, relax_only=relax_only),
                                eps_low=0.2, eps_high=0.28)
    stats = clipper.new_stats(reference=True)
    for idx in torch.arange(n).chunk(parts):  # micro-batches add locally, one solve
        stats.add(r8[idx], adv[idx], ratio_hp=r_hp[idx])
    sol = clipper.solve(stats)
    want = spec_solve(r8.numpy(), r_hp.numpy(), adv.numpy(), eps_low=0.2, eps_high=0.28, relax_only=relax_only)
    assert clipper.targets.alpha == want.alpha
    assert clipper.targets.rho == pytest.approx(want.rho, rel=1e-12) or (math.isinf(want.rho) and math.isinf(clipper.targets.rho))
    assert sol.lower == want.lower
    assert sol.lower_raw == want.lower_raw or (math.isnan(sol.lower_raw) and math.isnan(want.lower_raw))
    assert sol.upper == want.upper
    assert sol.upper_raw == want.upper_raw or (math.isnan(sol.upper_raw) and math.isnan(want.upper_raw))
    # what the loss then does with L: exactly floor(alpha |N|) negative ratios sit below the unclamped quantile
    neg = adv < 0
    if neg.any() and not relax_only and want.lower == want.lower_raw:
        assert int((r8[neg] < sol.lower).sum()) == round(want.alpha * int(neg.sum()))


def test_spec_checker_fails_on_a_wrong_quantile():
    r8, r_hp, adv = _tokens(3, 400, 0.1, 0.3)
    want = spec_solve(r8.numpy(), r_hp.numpy(), adv.numpy(), eps_low=0.2, eps_high=0.28, relax_only=False)
    negs = np.sort(r8.numpy()[adv.numpy() < 0])
    k = int(round(want.alpha * negs.size))
    assert want.lower_raw == negs[k]  # the (floor(alpha |N|) + 1)-th order statistic, 1-based
    assert want.lower_raw != negs[k - 1] and want.lower_raw != negs[k + 1]


def _event_rows(tmp_path, events):
    """Solve each pooled token set in turn with one clipper (EMA on), writing the dumps and metrics rows a run would."""
    clipper = CalibratedClipper(CalibrationConfig(enabled=True, strength="full", smoothing=0.5,
                                                  relax_only=False), eps_low=0.2, eps_high=0.2)
    rows = []
    for step, (r8, r_hp, adv) in enumerate(events):
        stats = clipper.new_stats(reference=True)
        stats.add(r8, adv, ratio_hp=r_hp)
        sol = clipper.solve(stats)
        keep = adv != 0
        np.savez(tmp_path / "calibration" / f"step_{step:06d}.rank0.npz", ratio=r8[keep].double().numpy(),
                 ratio_hp=r_hp[keep].double().numpy(), adv=adv[keep].double().numpy(),
                 minibatch=np.ones(int(keep.sum()), dtype=np.int64))
        rows.append({"step": step, **clipper.metrics(), **CalibratedClipper.solution_metrics(sol)})
    return rows


def test_events_missing_a_sign_keep_the_previous_targets(tmp_path):
    """Which signs a run's shadow rows hold depends on the machine's rollouts: the checker of run dumps must follow the
    spec in every case (both signs, negative only, positive only, no tokens), and fail on a target the spec does not keep."""
    from calibration_spec import check_run_dumps

    (tmp_path / "calibration").mkdir()
    r8, r_hp, adv = _tokens(7, 300, 0.1, 0.3)
    neg, pos = adv < 0, adv > 0
    events = [(r8, r_hp, adv), (r8, r_hp, adv * neg), (r8, r_hp, adv * pos), (r8[:0], r_hp[:0], adv[:0]),
              (r8.flip(0), r_hp, adv)]
    rows = _event_rows(tmp_path, events)
    assert check_run_dumps(tmp_path, rows, ranks=1, eps_low=0.2, eps_high=0.2, relax_only=False) == [0, 1, 2, 3, 4]
    # the negative-only event keeps event 0's rho (its own shadow pass would say 0): a checker that took rho from
    # the event's own tokens must fail here
    assert rows[1]["calib/rho_target"] == rows[0]["calib/rho_target"] > 0
    bad = [dict(r) for r in rows]
    bad[1]["calib/rho_target"] = 0.0
    with pytest.raises(AssertionError, match="step 1"):
        check_run_dumps(tmp_path, bad, ranks=1, eps_low=0.2, eps_high=0.2, relax_only=False)
    # the positive-only event keeps alpha, L and (no negative mass to balance) H
    assert rows[2]["calib/alpha_target"] == rows[1]["calib/alpha_target"]
    assert (rows[2]["calib/solve_lower"], rows[2]["calib/solve_upper"]) == (rows[1]["calib/lower"], rows[1]["calib/upper"])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 600), st.floats(0.0, 0.3), st.floats(0.01, 0.4), st.booleans(),
       st.integers(1, 5), st.floats(0.1, 1.0))
def test_per_step_solve_matches_the_spec(seed, n, noise, hp_scale, relax_only, parts, shadow):
    """per_step: an event's targets from the shadow rows only (hp_mask), its L and H from every row for the next step's
    tokens (type-6 quantile); the next, ordinary step solves its own tokens at those held targets."""
    r8, r_hp, adv = _tokens(seed, n, noise, hp_scale)
    known = torch.rand(n, generator=torch.Generator().manual_seed(seed + 1)) < shadow
    clipper = CalibratedClipper(CalibrationConfig(enabled=True, strength="full", relax_only=relax_only), eps_low=0.2, eps_high=0.28)
    stats = clipper.new_stats(reference=True)
    for idx in torch.arange(n).chunk(parts):
        stats.add(r8[idx], adv[idx], ratio_hp=r_hp[idx], hp_mask=known[idx])
    sol = clipper.solve(stats, smooth=False, quantile="next_tokens")
    hp = np.where(known.numpy(), r_hp.numpy(), np.nan)
    want = spec_solve(r8.numpy(), hp, adv.numpy(), eps_low=0.2, eps_high=0.28, relax_only=relax_only, quantile="next_tokens")
    assert clipper.targets.alpha == want.alpha
    assert clipper.targets.rho == pytest.approx(want.rho, rel=1e-12) or (math.isinf(want.rho) and math.isinf(clipper.targets.rho))
    assert (sol.lower, sol.upper) == (want.lower, want.upper)
    assert sol.lower_raw == want.lower_raw or (math.isnan(sol.lower_raw) and math.isnan(want.lower_raw))
    assert sol.upper_raw == want.upper_raw or (math.isnan(sol.upper_raw) and math.isnan(want.upper_raw))
    # the next step: FP8 statistics only, at the held targets
    r8b = r8 * torch.exp(torch.randn(n, generator=torch.Generator().manual_seed(seed + 2)) * 0.05)
    nxt = clipper.new_stats()
    nxt.add(r8b, adv)
    held = (clipper.targets.alpha, clipper.targets.rho)
    sol2 = clipper.solve(nxt, smooth=False, quantile="next_tokens")
    want2 = spec_solve(r8b.numpy(), None, adv.numpy(), eps_low=0.2, eps_high=0.28, relax_only=relax_only,
                       previous=(sol.lower, sol.upper), targets=held, quantile="next_tokens")
    assert (sol2.lower, sol2.upper, sol2.lower_raw) == (want2.lower, want2.upper, want2.lower_raw) or \
        (math.isnan(sol2.lower_raw) and (sol2.lower, sol2.upper) == (want2.lower, want2.upper))
    assert (clipper.lower, clipper.upper) == (sol2.lower, sol2.upper)  # per_step holds its solve unsmoothed


def test_type6_quantile_covers_alpha_of_unseen_tokens():
    """The reason for next_tokens: the k-th order statistic of n draws covers k / (n + 1) of new draws, so the
    same-tokens L (k = floor(alpha n) + 1) over-clips later tokens; the type-6 L clips alpha of them in expectation."""
    g = torch.Generator().manual_seed(0)
    alpha, n, trials = 0.05, 120, 400
    same, nxt = [], []
    for _ in range(trials):
        r = torch.exp(torch.randn(n, generator=g) * 0.1)
        new = torch.exp(torch.randn(2000, generator=g) * 0.1)
        stats = SampleStats(r, -torch.ones(n))
        same.append(float((new < stats.lower_quantile(alpha)).float().mean()))
        nxt.append(float((new < stats.predictive_lower_quantile(alpha)).float().mean()))
    assert np.mean(same) / alpha > 1.08  # (floor(6) + 1) / 121 = 0.0579
    assert abs(np.mean(nxt) / alpha - 1) < 0.04


@pytest.mark.parametrize("backend", ["allgather", "histogram"])
def test_alpha_zero_keeps_a_lower_trust_region(backend):
    """A shadow that clipped nothing (alpha = 0): per_step's next-token quantile lies below every negative ratio; L is
    held at the lowest FP8 negative ratio (clips none of the solved tokens), not left to fall to lower_min."""
    g = torch.Generator().manual_seed(3)
    n = 400
    adv = torch.where(torch.arange(n) % 2 == 0, -1.0, 1.0)
    r_hp = 1.0 + 0.02 * torch.randn(n, generator=g)  # nothing below 1 - eps_low: alpha = 0
    r8 = r_hp * torch.exp(0.15 * torch.randn(n, generator=g))
    cfg = CalibrationConfig(enabled=True, strength="full", backend=backend)
    clipper = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.28)
    stats = clipper.new_stats(reference=True)
    stats.add(r8, adv, ratio_hp=r_hp)
    sol = clipper.solve(stats, smooth=False, quantile="next_tokens")
    assert clipper.targets.alpha == 0.0
    lowest = float(r8[adv < 0].min())
    bin_width = (HIST_LOG_MAX - HIST_LOG_MIN) / HIST_BINS
    assert sol.lower == pytest.approx(lowest, rel=1e-6 if backend == "allgather" else 2 * bin_width)
    assert sol.lower > cfg.lower_min
    want = spec_solve(r8.numpy(), r_hp.numpy(), adv.numpy(), eps_low=0.2, eps_high=0.28, quantile="next_tokens")
    if backend == "allgather":
        assert (sol.lower, sol.upper) == (want.lower, want.upper)


def test_decision_counts_every_event_once_keeps_vanilla_bounds_and_resumes_with_the_counts():
    """strength=decision: the bounds stay 1 -/+ eps while every event adds its shadow tokens' high- and low-precision
    counts below 1 - eps_low to the run's totals, whose clip-fraction ratio is logged (calib/gate_ratio) and survives
    a resume; strength=full solves the same and moves its bounds, logging no such ratio, and targeted logs none either."""
    g = torch.Generator().manual_seed(7)

    def batch(n, noise):
        adv = torch.where(torch.arange(n) % 2 == 0, -1.0, 1.0)
        r_hp = torch.exp(0.1 * torch.randn(n, generator=g))
        return r_hp * torch.exp(noise * torch.randn(n, generator=g)), r_hp, adv

    events = [batch(300, 0.01) for _ in range(2)] + [batch(300, 0.3) for _ in range(2)]
    cfg = CalibrationConfig(enabled=True, strength="decision")
    clipper = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.2)
    full = CalibratedClipper(CalibrationConfig(enabled=True, strength="full"), eps_low=0.2, eps_high=0.2)
    assert math.isnan(clipper.metrics()["calib/gate_ratio"])  # before any evidence
    seen = []
    for e in events:
        sol = _event(clipper, *e)
        sol_full = _event(full, *e)
        seen.append(e)
        neg = torch.cat([x[2] < 0 for x in seen])
        hp, lp = torch.cat([x[1] for x in seen])[neg], torch.cat([x[0] for x in seen])[neg]
        hp_below, lp_below = int((hp < 0.8).sum()), int((lp < 0.8).sum())
        assert clipper.gate_counts == [hp_below, int(neg.sum()), lp_below, int(neg.sum())]
        logged = clipper.metrics()
        if hp_below:
            assert logged["calib/gate_ratio"] == pytest.approx(lp_below / hp_below)
        assert logged["calib/gate_hp_tokens"] == hp_below
        assert (sol.lower, sol.upper) == (sol_full.lower, sol_full.upper)  # the same solve; only what is applied differs
        assert (clipper.lower, clipper.upper) == (pytest.approx(0.8), pytest.approx(1.2))
        assert clipper.decides_on_high_precision() and not full.decides_on_high_precision()
    assert (full.lower, full.upper) != (clipper.lower, clipper.upper)
    assert "calib/gate_ratio" not in full.metrics()
    # targeted (the default) runs no calibration event, so it has no distortion to report
    assert "calib/gate_ratio" not in CalibratedClipper(CalibrationConfig(enabled=True), eps_low=0.2, eps_high=0.2).metrics()
    resumed = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.2)
    resumed.load_state_dict(clipper.state_dict())
    for c in (clipper, resumed):
        _event(c, *events[0])
    assert (resumed.gate_counts, resumed.metrics()) == (clipper.gate_counts, clipper.metrics())


def _event(clipper, r8, r_hp, adv):
    stats = clipper.new_stats(reference=True)
    stats.add(r8, adv, ratio_hp=r_hp)
    return clipper.solve(stats, smooth=False)


def test_a_checkpoint_resumes_only_under_the_strength_rule_it_was_written_with():
    """Resuming a run under another rule than it calibrated with would switch rules mid-run: loading its state names
    algo.calibration.strength instead; the same rule loads; a state of an unsupported rule or naming none is refused."""
    from megatron_rl.config import ConfigError

    g = torch.Generator().manual_seed(3)
    adv = torch.where(torch.arange(400) % 2 == 0, -1.0, 1.0)
    r_hp = torch.exp(0.1 * torch.randn(400, generator=g))
    r8 = r_hp * torch.exp(0.05 * torch.randn(400, generator=g))

    def clipper(strength):
        return CalibratedClipper(CalibrationConfig(enabled=True, strength=strength), eps_low=0.2, eps_high=0.2)

    full = clipper("full")
    _event(full, r8, r_hp, adv)
    with pytest.raises(ConfigError, match=r"algo\.calibration\.strength=decision.*strength=full.*set algo\.calibration\.strength=full"):
        clipper("decision").load_state_dict(full.state_dict())
    same = clipper("full")
    same.load_state_dict(full.state_dict())
    assert (same.lower, same.upper, same.targets, same.gate_counts) == (full.lower, full.upper, full.targets, full.gate_counts)
    for rule in ("gated", "excess"):
        with pytest.raises(ConfigError, match=rf"algo\.calibration\.strength={rule}, which this code does not support"):
            clipper("full").load_state_dict({**full.state_dict(), "strength_rule": rule})
    with pytest.raises(ConfigError, match="lower_target=agreement"):
        clipper("full").load_state_dict({**full.state_dict(), "agreement": {"lower": 0.7}})
    with pytest.raises(ConfigError, match="names no algo.calibration.strength"):
        clipper("full").load_state_dict({k: v for k, v in full.state_dict().items() if k != "strength_rule"})
