"""Clip decisions against high precision (megatron_rl/study/clip_agreement.py): counts by hand on a few tokens,
the bounds in force per step, and a run directory's dumps read end to end."""
import math

import numpy as np
import pytest

from megatron_rl.study.clip_agreement import SideCounts, bounds_in_force, run_agreement, side_counts


def test_side_counts_follow_the_definitions():
    # tokens:        A<0 moved   A<0 noise   A<0 missed  A<0 inside  A>0 moved  A>0 noise  no hp ratio
    ratio = np.array([0.5,        0.7,        0.9,        1.0,        1.5,       1.3,       0.1])
    ratio_hp = np.array([0.6,     0.95,       0.7,        1.0,        1.4,       1.0,       np.nan])
    adv = np.array([-1.0,         -1.0,       -1.0,       -1.0,       1.0,       1.0,       -1.0])
    lower, upper = np.full(7, 0.8), np.full(7, 1.2)
    neg, pos = side_counts(ratio, ratio_hp, adv, lower, upper, 0.2, 0.2)
    assert (neg.tokens, neg.hp_clipped, neg.clipped, neg.both) == (4, 2, 2, 1)
    assert neg.precision == 0.5 and neg.recall == 0.5 and neg.per_mille == 500.0
    assert (pos.tokens, pos.hp_clipped, pos.clipped, pos.both) == (2, 1, 2, 1)
    wide, _ = side_counts(ratio, ratio_hp, adv, np.full(7, 0.55), upper, 0.2, 0.2)
    assert (wide.clipped, wide.both) == (1, 1) and wide.recall == 0.5      # a wider L drops the noise-pushed token
    empty = SideCounts()
    assert math.isnan(empty.precision) and math.isnan(empty.recall) and math.isnan(empty.per_mille)


def test_bounds_in_force_are_the_previous_steps_held_bounds():
    rows = [{"step": 0, "calib/lower": 0.5, "calib/upper": 1.5}, {"step": 1, "calib/lower": None},
            {"step": 2, "calib/lower": 0.7, "calib/upper": 1.3}]
    lower, upper = bounds_in_force(rows, np.array([0, 1, 1, 2, 3]), 0.2, 0.28)
    assert lower.tolist() == pytest.approx([0.8, 0.5, 0.5, 0.8, 0.7])
    assert upper.tolist() == pytest.approx([1.28, 1.5, 1.5, 1.28, 1.3])


def test_run_agreement_reads_a_runs_dumps(tmp_path):
    cal = tmp_path / "calibration"
    cal.mkdir()
    np.savez(cal / "step_000001.rank0.npz", ratio=np.array([0.5, 0.7]), ratio_hp=np.array([0.6, 1.0]),
             adv=np.array([-1.0, -1.0]), minibatch=np.array([1, 1]))
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "calib/lower": 0.6, "calib/upper": 1.2}\n')
    got = run_agreement(tmp_path, {"algo": {"policy_loss": {"eps_low": 0.2, "eps_high": 0.2}}})
    neg_in_force, neg_vanilla = got["in force"][0], got["vanilla bounds"][0]
    assert (neg_in_force.clipped, neg_in_force.both) == (1, 1)       # L = 0.6 from step 0 keeps the 0.7 token
    assert (neg_vanilla.clipped, neg_vanilla.both) == (2, 1)
    assert run_agreement(tmp_path / "none", {}) is None
