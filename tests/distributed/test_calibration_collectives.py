"""Calibration statistics over 3 gloo ranks (uneven counts, one rank empty) vs one process on the concatenation."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import run_distributed
from megatron_rl.algo.calibration import calibrate_bounds, reference_targets
from megatron_rl.algo.clipper import CalibratedClipper
from megatron_rl.algo.ratio_stats import HistSpec, SampleStats
from megatron_rl.config.algo import CalibrationConfig

WORKER = Path(__file__).with_name("calibration_worker.py")


@pytest.mark.distributed
def test_global_calibration_matches_single_process():
    import calibration_worker as w  # noqa: PLC0415  (on sys.path via conftest's PYTHONPATH only in children)

    world = len(w.COUNTS)
    results = run_distributed(WORKER, nproc=world, timeout=240)
    r_hp, r_fp8, adv = w.make_data()
    t = reference_targets(r_hp, adv, eps_low=w.EPS_LOW, eps_high=w.EPS_HIGH)
    exact = [float(x) for x in calibrate_bounds(r_fp8, adv, t, eps_low=w.EPS_LOW, eps_high=w.EPS_HIGH, **w.CLAMPS)]
    stats = SampleStats(r_fp8[adv != 0], adv[adv != 0])
    width = HistSpec().width
    for res in results:
        assert res["alpha"] == float(t.alpha)
        assert res["rho"] == pytest.approx(float(t.rho), rel=1e-12)
        assert res["allgather"] == exact  # exact: nothing subsampled
        assert (res["num_neg"], res["num_pos"]) == (stats.num_neg, stats.num_pos)
        lo_h, hi_h = res["histogram"]
        assert abs(math.log(lo_h) - math.log(exact[0])) <= width * 1.001
        hi_e = stats.smallest_upper(float(t.rho) * stats.neg_mass_from(lo_h))
        assert abs(math.log(hi_h) - math.log(hi_e)) <= width * 1.001
        # capped at 300 rows per rank: the weights still carry the true token count
        assert res["subsampled_rows"] == sum(min(c, 300) for c in w.COUNTS)
        assert res["subsampled_weight_sum"] == pytest.approx(sum(w.COUNTS), rel=1e-9)
    # the clipper's pooled solve over the group equals one process solving the concatenation
    for backend in ("allgather", "histogram"):
        clip = CalibratedClipper(CalibrationConfig(enabled=True, strength="full", smoothing=0.0, backend=backend, **w.CLAMPS),
                                 eps_low=w.EPS_LOW, eps_high=w.EPS_HIGH)
        stats = clip.new_stats(reference=True)
        stats.add(r_fp8, adv, ratio_hp=r_hp)
        sol = clip.solve(stats)
        want = [sol.lower, sol.upper, clip.targets.alpha, clip.targets.rho]
        for res in results:
            got = res[f"clipper_{backend}"]
            assert got[:3] == want[:3], backend
            assert got[3] == pytest.approx(want[3], rel=1e-12)
        # per_step: FP8 statistics of every token, targets from the shadow tokens only, then a solve at held targets
        known = torch.cat([w.shadow_mask(r, world) for r in range(world)])
        want = w.per_step_solves(backend, r_fp8, r_hp, adv, known, None)
        for res in results:
            got = res[f"per_step_{backend}"]
            assert got[:3] + got[4:] == want[:3] + want[4:], backend
            assert got[3] == pytest.approx(want[3], rel=1e-12)
