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
    clipper = CalibratedClipper(CalibrationConfig(enabled=True, smoothing=0.0, relax_only=relax_only),
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
    clipper = CalibratedClipper(CalibrationConfig(enabled=True, smoothing=0.5, relax_only=False), eps_low=0.2, eps_high=0.2)
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
