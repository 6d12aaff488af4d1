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
    clipper = CalibratedClipper(CalibrationConfig(enabled=True, strength="full", lower_target="event_alpha", smoothing=0.0, relax_only=relax_only),
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


def _event_rows(tmp_path, events, lower_target="event_alpha"):
    """Solve each pooled token set in turn with one clipper (EMA on), writing the dumps and metrics rows a run would."""
    clipper = CalibratedClipper(CalibrationConfig(enabled=True, strength="full", lower_target=lower_target, smoothing=0.5,
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


@pytest.mark.parametrize("lower_target", ["event_alpha", "agreement"])
def test_events_missing_a_sign_keep_the_previous_targets(tmp_path, lower_target):
    """Which signs a run's shadow rows hold depends on the machine's rollouts: the checker of run dumps must follow the
    spec in every case (both signs, negative only, positive only, no tokens), and fail on a target the spec does not keep;
    under lower_target=agreement it also recomputes each event's chosen L and the alpha the solves hold."""
    from calibration_spec import check_run_dumps

    (tmp_path / "calibration").mkdir()
    r8, r_hp, adv = _tokens(7, 300, 0.1, 0.3)
    neg, pos = adv < 0, adv > 0
    events = [(r8, r_hp, adv), (r8, r_hp, adv * neg), (r8, r_hp, adv * pos), (r8[:0], r_hp[:0], adv[:0]),
              (r8.flip(0), r_hp, adv)]
    rows = _event_rows(tmp_path, events, lower_target)
    if lower_target == "agreement":
        assert rows[0]["calib/alpha_solved"] != rows[0]["calib/alpha_target"]  # the agreement alpha, not the shadow's
        bad = [dict(r) for r in rows]
        bad[4]["calib/alpha_solved"] = rows[0]["calib/alpha_target"]
        with pytest.raises(AssertionError, match="step 4"):
            check_run_dumps(tmp_path, bad, ranks=1, eps_low=0.2, eps_high=0.2, relax_only=False)
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
    clipper = CalibratedClipper(CalibrationConfig(enabled=True, strength="full", lower_target="event_alpha", relax_only=relax_only), eps_low=0.2, eps_high=0.28)
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
@pytest.mark.parametrize("floor", ["lowest_ratio", "lower_min"])
def test_alpha_zero_keeps_a_lower_trust_region(backend, floor):
    """A shadow that clipped nothing (alpha = 0): per_step's next-token quantile lies below every negative ratio.
    lowest_ratio holds L at the lowest FP8 negative ratio (clips none of the solved tokens); lower_min lets it fall to
    the clamp, leaving the negative side without a trust region until the next solve."""
    g = torch.Generator().manual_seed(3)
    n = 400
    adv = torch.where(torch.arange(n) % 2 == 0, -1.0, 1.0)
    r_hp = 1.0 + 0.02 * torch.randn(n, generator=g)  # nothing below 1 - eps_low: alpha = 0
    r8 = r_hp * torch.exp(0.15 * torch.randn(n, generator=g))
    cfg = CalibrationConfig(enabled=True, strength="full", lower_target="event_alpha", backend=backend, lower_floor=floor)
    clipper = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.28)
    stats = clipper.new_stats(reference=True)
    stats.add(r8, adv, ratio_hp=r_hp)
    sol = clipper.solve(stats, smooth=False, quantile="next_tokens")
    assert clipper.targets.alpha == 0.0
    lowest = float(r8[adv < 0].min())
    if floor == "lower_min":
        assert sol.lower == pytest.approx(cfg.lower_min, rel=1e-6)  # float32
    else:
        bin_width = (cfg.hist_log_max - cfg.hist_log_min) / cfg.hist_bins
        assert sol.lower == pytest.approx(lowest, rel=1e-6 if backend == "allgather" else 2 * bin_width)
        assert sol.lower > cfg.lower_min
        want = spec_solve(r8.numpy(), r_hp.numpy(), adv.numpy(), eps_low=0.2, eps_high=0.28, quantile="next_tokens")
        if backend == "allgather":
            assert (sol.lower, sol.upper) == (want.lower, want.upper)


def test_excess_strength_is_the_share_of_clipping_beyond_the_tolerance():
    from megatron_rl.algo.clipper import excess_strength

    assert excess_strength(0.05, 0.08, 1.0) == 0.0  # 1.6x high precision: within the tolerated 2x
    assert excess_strength(0.05, 0.20, 1.0) == pytest.approx(0.5)  # 4x: half of the way
    assert excess_strength(0.05, 0.20, 0.0) == pytest.approx(0.75)
    assert excess_strength(0.0, 0.10, 1.0) == 1.0  # high precision clips nothing: all of it is excess
    assert excess_strength(0.05, 0.0, 1.0) == 0.0  # low precision clips nothing: no distortion to correct


@pytest.mark.parametrize("noise", [0.02, 0.4])
def test_excess_strength_keeps_vanilla_bounds_until_the_distortion_is_large(noise):
    """strength=excess applies the full solve's bounds w of the way from 1 -/+ eps in log space, w from the event's
    clip fractions: small ratio noise leaves the vanilla bounds, large noise moves them (the full solve's way)."""
    g = torch.Generator().manual_seed(11)
    n = 4000
    adv = torch.where(torch.arange(n) % 2 == 0, -1.0, 1.0)
    r_hp = torch.exp(0.12 * torch.randn(n, generator=g))
    r8 = r_hp * torch.exp(noise * torch.randn(n, generator=g))
    held = {}
    for strength in ("full", "excess"):
        clipper = CalibratedClipper(CalibrationConfig(enabled=True, strength=strength, lower_target="event_alpha"), eps_low=0.2, eps_high=0.2)
        stats = clipper.new_stats(reference=True)
        stats.add(r8, adv, ratio_hp=r_hp)
        sol = clipper.solve(stats, smooth=False)
        held[strength] = (clipper.lower, clipper.upper, clipper.strength, sol)
    lo_f, hi_f, w_full, sol = held["full"]
    lo_e, hi_e, w, sol_e = held["excess"]
    assert w_full == 1.0 and (lo_f, hi_f) == (sol.lower, sol.upper)
    assert (sol_e.lower, sol_e.upper) == (sol.lower, sol.upper)  # the same solve; only what is applied differs
    neg = adv < 0
    alpha_hp = float((r_hp[neg] < 0.8).double().mean())
    alpha_lp = float((r8[neg] < 0.8).double().mean())
    assert w == pytest.approx(max(0.0, 1.0 - 2.0 * alpha_hp / alpha_lp), abs=1e-9)
    if noise < 0.1:
        assert w == 0.0 and (lo_e, hi_e) == (pytest.approx(0.8), pytest.approx(1.2))
    else:
        assert 0.3 < w < 1.0
        assert lo_e == pytest.approx(math.exp((1 - w) * math.log(0.8) + w * math.log(sol.lower)), rel=1e-6)
        assert lo_f < lo_e < 0.8


def test_gate_opens_on_the_runs_pooled_excess_only():
    from megatron_rl.algo.clipper import gate_strength

    assert gate_strength(40, 1000, 70, 1000, 1.0, 30) == 0.0   # 1.75x high precision: within the tolerated 2x
    assert gate_strength(40, 1000, 90, 1000, 1.0, 30) == 1.0   # 2.25x
    assert gate_strength(20, 1000, 90, 1000, 1.0, 30) == 0.0   # 4.5x, but only 20 tokens of evidence
    assert gate_strength(40, 1000, 90, 2000, 1.0, 30) == 0.0   # fractions, not counts: 0.045 against 0.04 is 1.1x
    assert gate_strength(40, 1000, 50, 1000, 0.1, 30) == 1.0   # a smaller tolerance
    assert gate_strength(0, 1000, 90, 1000, 1.0, 0) == 0.0     # high precision clipped nothing: no ratio to judge


def test_gated_strength_counts_every_event_once_and_resumes_with_the_counts():
    """strength=gated: w is 0 (vanilla bounds) until the low-precision fraction below 1 - eps_low, pooled over every
    event so far, exceeds (1 + excess_tolerance) times the shadow's on at least gate_min_tokens shadow-clipped tokens,
    then 1 (the full solve); the counts sum each event once whatever target_events pools, and survive a resume."""
    g = torch.Generator().manual_seed(7)

    def batch(n, noise):
        adv = torch.where(torch.arange(n) % 2 == 0, -1.0, 1.0)
        r_hp = torch.exp(0.1 * torch.randn(n, generator=g))
        return r_hp * torch.exp(noise * torch.randn(n, generator=g)), r_hp, adv

    small, large = [batch(300, 0.01) for _ in range(3)], [batch(300, 0.3) for _ in range(3)]
    cfg = CalibrationConfig(enabled=True, strength="gated", lower_target="event_alpha", target_events=2,
                            gate_min_tokens=15, gate_opens_to="solved_bounds")
    clipper = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.2)
    full = CalibratedClipper(CalibrationConfig(enabled=True, strength="full", lower_target="event_alpha", target_events=2),
                             eps_low=0.2, eps_high=0.2)
    seen = []
    for e in small + large:
        sol = _event(clipper, *e)
        sol_full = _event(full, *e)
        seen.append(e)
        neg = torch.cat([x[2] < 0 for x in seen])
        hp, lp = torch.cat([x[1] for x in seen])[neg], torch.cat([x[0] for x in seen])[neg]
        hp_below, lp_below = int((hp < 0.8).sum()), int((lp < 0.8).sum())
        assert clipper.gate_counts == [hp_below, int(neg.sum()), lp_below, int(neg.sum())]
        want = 1.0 if hp_below >= 15 and lp_below > 2 * hp_below else 0.0
        assert clipper.strength == want
        logged = clipper.metrics()
        assert logged["calib/gate_ratio"] == pytest.approx((lp_below / int(neg.sum())) / (hp_below / int(neg.sum())))
        assert logged["calib/gate_hp_tokens"] == hp_below
        assert (sol.lower, sol.upper) == (sol_full.lower, sol_full.upper)  # the same solve; only what is applied differs
        if want == 0.0:
            assert (clipper.lower, clipper.upper) == (pytest.approx(0.8), pytest.approx(1.2))
        else:
            assert (clipper.lower, clipper.upper) == (full.lower, full.upper)
    assert clipper.strength == 1.0  # three large-noise events outweigh the three small ones
    fresh = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.2)
    assert fresh.strength == 0.0 and math.isnan(fresh.metrics()["calib/gate_ratio"])  # closed before any evidence
    assert "calib/gate_ratio" not in full.metrics()
    resumed = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.2)
    resumed.load_state_dict(clipper.state_dict())
    for c in (clipper, resumed):
        _event(c, *small[0])
    assert (resumed.gate_counts, resumed.strength, resumed.lower) == (clipper.gate_counts, clipper.strength, clipper.lower)


def _event(clipper, r8, r_hp, adv):
    stats = clipper.new_stats(reference=True)
    stats.add(r8, adv, ratio_hp=r_hp)
    return clipper.solve(stats, smooth=False)


def test_target_events_pool_the_last_events_counts_and_resume_with_them():
    """target_events=2: alpha, rho and w come from the summed counts of the last two events (not their mean, not
    older ones); 1 reproduces each event alone; the pool survives state_dict / load_state_dict."""
    g = torch.Generator().manual_seed(5)
    events = []
    for n, noise in ((600, 0.3), (200, 0.5), (900, 0.2)):
        adv = torch.where(torch.arange(n) % 2 == 0, -1.0, 1.0)
        r_hp = torch.exp(0.15 * torch.randn(n, generator=g))
        events.append((r_hp * torch.exp(noise * torch.randn(n, generator=g)), r_hp, adv))
    one = CalibratedClipper(CalibrationConfig(enabled=True, strength="excess", lower_target="event_alpha"), eps_low=0.2, eps_high=0.2)
    two = CalibratedClipper(CalibrationConfig(enabled=True, strength="excess", lower_target="event_alpha", target_events=2), eps_low=0.2, eps_high=0.2)
    for e in events:
        _event(one, *e)
        _event(two, *e)
    last = events[-1]
    neg = last[2] < 0
    assert one.targets.alpha == pytest.approx(float((last[1][neg] < 0.8).double().mean()))
    assert one.alpha_lp == pytest.approx(float((last[0][neg] < 0.8).double().mean()))
    pooled_neg = torch.cat([e[2] < 0 for e in events[1:]])
    pooled_hp, pooled_lp = torch.cat([e[1] for e in events[1:]]), torch.cat([e[0] for e in events[1:]])
    alpha_hp = float((pooled_hp[pooled_neg] < 0.8).double().mean())
    alpha_lp = float((pooled_lp[pooled_neg] < 0.8).double().mean())
    assert two.targets.alpha == pytest.approx(alpha_hp) and two.targets.num_neg == int(pooled_neg.sum())
    assert two.alpha_lp == pytest.approx(alpha_lp)
    assert two.strength == pytest.approx(max(0.0, 1.0 - 2.0 * alpha_hp / alpha_lp), abs=1e-12)
    assert two.targets.alpha != pytest.approx(one.targets.alpha)
    resumed = CalibratedClipper(CalibrationConfig(enabled=True, strength="excess", lower_target="event_alpha", target_events=2), eps_low=0.2, eps_high=0.2)
    resumed.load_state_dict(two.state_dict())
    nxt = events[0]
    _event(two, *nxt)
    _event(resumed, *nxt)
    assert (resumed.lower, resumed.upper, resumed.strength, resumed.targets) == (two.lower, two.upper, two.strength, two.targets)


def test_deflated_target_follows_each_steps_own_low_precision_fraction():
    """lower_target=deflated: a calibration event measures the share of the low-precision clipping below 1 - eps_low
    that high precision does on the same tokens (with deflate_prior_tokens pseudo-tokens on both sides); every later
    solve puts that share of its OWN tokens' low-precision fraction below L, so a step that moved further clips more
    (the held alpha clips the same fraction whatever the step did). The deflation survives a resume."""
    from megatron_rl.algo.clipper import deflation

    assert deflation(0.05, 0.10, 1000, 0.0) == pytest.approx(0.5)
    assert deflation(0.0, 0.05, 40, 4.0) == pytest.approx(4 / 6)  # 0 of 40 shadow tokens: shrunk toward 1, not 0
    assert deflation(0.2, 0.1, 1000, 4.0) == 1.0  # never tightens
    assert deflation(0.0, 0.0, 0, 0.0) == 1.0  # nothing measured: no deflation
    g = torch.Generator().manual_seed(3)

    def tokens(n, move, noise):
        adv = torch.where(torch.arange(n) % 2 == 0, -1.0, 1.0)
        r_hp = torch.exp(move * torch.randn(n, generator=g))
        return r_hp * torch.exp(noise * torch.randn(n, generator=g)), r_hp, adv

    cfg = CalibrationConfig(enabled=True, strength="full", lower_target="deflated", deflate_prior_tokens=0.0)
    clipper = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.2)
    r8, r_hp, adv = tokens(4000, 0.15, 0.1)
    _event(clipper, r8, r_hp, adv)
    neg = adv < 0
    alpha_hp, alpha_lp = float((r_hp[neg] < 0.8).double().mean()), float((r8[neg] < 0.8).double().mean())
    assert clipper.deflation == pytest.approx(alpha_hp / alpha_lp) and clipper.deflation < 1
    held = CalibratedClipper(cfg.model_copy(update={"lower_target": "event_alpha"}), eps_low=0.2, eps_high=0.2)
    _event(held, r8, r_hp, adv)
    for move in (0.05, 0.3):  # later steps that moved less, then more, than the event's
        nxt, _, adv2 = tokens(4000, move, 0.1)
        neg2 = adv2 < 0
        alpha_now = float((nxt[neg2] < 0.8).double().mean())
        for c in (clipper, held):
            stats = c.new_stats()
            stats.add(nxt, adv2)
            c.solve(stats, smooth=False, quantile="next_tokens")
        assert clipper.alpha_solved == pytest.approx(alpha_now * clipper.deflation)
        assert held.alpha_solved == pytest.approx(alpha_hp)
        clipped = float((nxt[neg2] < clipper.lower).double().mean())
        assert clipped == pytest.approx(alpha_now * clipper.deflation, abs=2e-3)
    resumed = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.2)
    resumed.load_state_dict(clipper.state_dict())
    assert resumed.deflation == clipper.deflation


def _f_beta_reference(r8, r_hp, adv, grid, beta, eps_low=0.2):
    """Independent numpy scoring of lower_target=agreement: every grid L's clips against the shadow's, token by token."""
    neg = adv < 0
    lp, hp_clipped = np.asarray(r8, np.float64)[neg], np.asarray(r_hp, np.float64)[neg] < 1.0 - eps_low
    best = None
    for L in grid:
        clipped = lp < L
        tp = float((clipped & hp_clipped).sum())
        score = (1 + beta ** 2) * tp / (beta ** 2 * hp_clipped.sum() + clipped.sum())
        if best is None or score >= best[0]:  # ties: the larger L
            best = (score, L, float(clipped.mean()), tp / max(clipped.sum(), 1), tp / hp_clipped.sum())
    return best


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(50, 800), st.floats(0.0, 0.4), st.sampled_from([0.5, 1.0, 2.0]),
       st.integers(1, 4))
def test_agreement_picks_the_bound_whose_clips_agree_best_with_the_shadow(seed, n, noise, beta, parts):
    """lower_target=agreement: the event's chosen L is the grid candidate with the best F_beta of its low-precision
    clip decisions against the shadow's (brute force over the tokens here), and the alpha later solves hold is the
    fraction of negative tokens below it; without noise that is the shadow's own alpha at the vanilla bound."""
    from megatron_rl.algo.calibration import agreement_grid

    r8, r_hp, adv = _tokens(seed, n, noise, 0.15)
    neg = (adv < 0).numpy()
    if not (r_hp.numpy()[neg] < 0.8).any():
        return  # the shadow clips nothing: test_agreement_without_shadow_clipping covers it
    cfg = CalibrationConfig(enabled=True, strength="full", lower_target="agreement", agreement_beta=beta, agreement_points=48)
    clipper = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.28)
    stats = clipper.new_stats(reference=True)
    for idx in torch.arange(n).chunk(parts):
        stats.add(r8[idx], adv[idx], ratio_hp=r_hp[idx])
    clipper.solve(stats, smooth=False)
    grid = agreement_grid(0.05, 0.8, 48)
    assert grid[-1] == 0.8 and len(grid) == 48
    score, L, alpha, precision, recall = _f_beta_reference(r8.numpy(), r_hp.numpy(), adv.numpy(), grid, beta)
    got = clipper.agreement
    assert got.lower == pytest.approx(L, rel=1e-12)
    assert got.alpha == pytest.approx(alpha, rel=1e-12)
    assert got.recall == pytest.approx(recall, rel=1e-12)
    assert clipper.alpha_solved == pytest.approx(alpha, rel=1e-12)  # the solve puts that fraction below L
    if noise == 0.0:
        assert got.lower == 0.8 and got.precision == got.recall == 1.0
        assert got.alpha == pytest.approx(clipper.targets.alpha, rel=1e-12)


def test_agreement_without_shadow_clipping_targets_none_and_pools_and_resumes():
    """An event where high precision clips nothing has no agreement to score: alpha 0 (every clip would be wrong),
    and lower_floor keeps the lowest ratio; target_events=2 pools the counts (= one event on the concatenated tokens);
    the choice survives a resume and the metrics report it."""
    g = torch.Generator().manual_seed(7)

    def tokens(n, move, noise):
        adv = torch.where(torch.arange(n) % 2 == 0, -1.0, 1.0)
        r_hp = torch.exp(move * torch.randn(n, generator=g))
        return r_hp * torch.exp(noise * torch.randn(n, generator=g)), r_hp, adv

    cfg = CalibrationConfig(enabled=True, strength="full", lower_target="agreement")
    quiet = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.2)
    r8, r_hp, adv = tokens(400, 0.01, 0.2)
    assert not (r_hp < 0.8).any() and (r8[adv < 0] < 0.8).any()
    _event(quiet, r8, r_hp, adv)
    assert quiet.agreement.alpha == 0.0 and math.isnan(quiet.agreement.lower)
    assert quiet.lower == pytest.approx(float(r8[adv < 0].min()))
    a, b = tokens(500, 0.15, 0.2), tokens(700, 0.2, 0.1)
    pooled = CalibratedClipper(cfg.model_copy(update={"target_events": 2}), eps_low=0.2, eps_high=0.2)
    _event(pooled, *a)
    _event(pooled, *b)
    whole = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.2)
    _event(whole, *(torch.cat([x, y]) for x, y in zip(a, b)))
    assert pooled.agreement.lower == whole.agreement.lower
    assert pooled.agreement.alpha == pytest.approx(whole.agreement.alpha, rel=1e-12)
    alone = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.2)
    _event(alone, *b)
    assert alone.agreement != pooled.agreement
    resumed = CalibratedClipper(cfg.model_copy(update={"target_events": 2}), eps_low=0.2, eps_high=0.2)
    resumed.load_state_dict(pooled.state_dict())
    assert resumed.agreement == pooled.agreement
    nxt = tokens(600, 0.1, 0.15)
    for c in (pooled, resumed):
        stats = c.new_stats()
        stats.add(nxt[0], nxt[2])
        c.solve(stats, smooth=False, quantile="next_tokens")
    assert (resumed.lower, resumed.upper) == (pooled.lower, pooled.upper)
    m = pooled.metrics()
    assert m["calib/agreement_lower"] == pooled.agreement.lower and m["calib/alpha_solved"] == pooled.agreement.alpha
    assert "calib/agreement_lower" not in CalibratedClipper(CalibrationConfig(enabled=True, lower_target="event_alpha"), eps_low=0.2, eps_high=0.2).metrics()


def test_agreement_histogram_backend_is_within_a_bin_of_the_exact_one():
    """The histogram backend counts each candidate's clips within one bin of the exact samples: same choice or a
    neighbour of nearly the same score."""
    r8, r_hp, adv = _tokens(11, 3000, 0.15, 0.2)
    got = {}
    for backend in ("allgather", "histogram"):
        c = CalibratedClipper(CalibrationConfig(enabled=True, strength="full", lower_target="agreement", backend=backend), eps_low=0.2, eps_high=0.2)
        _event(c, r8, r_hp, adv)
        got[backend] = c.agreement
    exact, hist = got["allgather"], got["histogram"]
    assert abs(math.log(hist.lower) - math.log(exact.lower)) <= 2 * math.log(0.8 / 0.05) / 63
    assert hist.alpha == pytest.approx(exact.alpha, abs=0.01)


def test_a_checkpoint_resumes_only_under_the_strength_rule_it_was_written_with():
    """The default strength changed (full -> gated): resuming a run under another rule than it calibrated with would
    switch rules mid-run, so loading its state names algo.calibration.strength instead; the same rule loads, and a
    checkpoint from before the gate existed (no counts, no recorded rule) resumes under full but not under gated."""
    from megatron_rl.config import ConfigError

    g = torch.Generator().manual_seed(3)
    adv = torch.where(torch.arange(400) % 2 == 0, -1.0, 1.0)
    r_hp = torch.exp(0.1 * torch.randn(400, generator=g))
    r8 = r_hp * torch.exp(0.05 * torch.randn(400, generator=g))

    def clipper(strength):
        return CalibratedClipper(CalibrationConfig(enabled=True, strength=strength), eps_low=0.2, eps_high=0.2)

    full = clipper("full")
    _event(full, r8, r_hp, adv)
    with pytest.raises(ConfigError, match=r"algo\.calibration\.strength=gated.*strength=full"):
        clipper("gated").load_state_dict(full.state_dict())
    same = clipper("full")
    same.load_state_dict(full.state_dict())
    assert (same.lower, same.upper, same.strength) == (full.lower, full.upper, full.strength)
    before_gate = {k: v for k, v in full.state_dict().items() if k not in ("strength_rule", "gate_counts")}
    clipper("full").load_state_dict(before_gate)
    clipper("excess").load_state_dict(before_gate)
    with pytest.raises(ConfigError, match="full or excess"):
        clipper("gated").load_state_dict(before_gate)
    clipper("gated").load_state_dict({**before_gate, "targets": None})  # never calibrated: nothing to switch
    # a gated run from before gate_opens_to existed moved the bounds when its gate opened: not resumed under the new
    # default (high_precision_decision), resumed under the form it ran
    gated = clipper("gated")
    _event(gated, r8, r_hp, adv)
    older = {k: v for k, v in gated.state_dict().items() if k != "gate_opens_to"}
    with pytest.raises(ConfigError, match=r"algo\.calibration\.gate_opens_to=high_precision_decision.*solved_bounds"):
        clipper("gated").load_state_dict(older)
    CalibratedClipper(CalibrationConfig(enabled=True, strength="gated", gate_opens_to="solved_bounds"),
                      eps_low=0.2, eps_high=0.2).load_state_dict(older)
