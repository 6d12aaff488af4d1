"""The dose-response instrument and the malformed metric through `megatron-rl train`: a 2-step FP8 run with
Calibrated Clipping every step and algo.experimental.clip_error_scale = 0 logs, on every step, the clip fractions
under the unscaled low-precision and the high-precision ratios next to the ones the scaled decision produced, and
the malformed fraction of the addition task's answers at every step and before / after RL."""
from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest

from rl_runs import tiny_overrides, train, warm_start

from megatron_rl.trainer.checkpoint import RL_STATE_FILE, latest_checkpoint

WIDE_ERROR = ("precision.recipe=nvfp4", "algo.policy_loss.eps_low=0.01", "algo.policy_loss.eps_high=0.01")
"""NVFP4's ratio error at bounds 1 -/+ 0.05: the learner's and the high-precision ratios then clip sets of tokens
that differ by many tokens, on any CPU (at 1 -/+ 0.2 a few tiny steps could differ by one token)."""
MANY_TOKENS = 0.01
"""A clip-fraction gap, summed over a run's steps, of at least a token of a tiny step's ~100 (0.019 on ATen's plain
kernels at bounds 1 -/+ 0.05, more at 1 -/+ 0.01)."""


@pytest.mark.slow
@pytest.mark.trajectory
def test_two_steps_with_the_instrument_and_calibration(tmp_path_factory, tmp_path):
    warm = warm_start(tmp_path_factory)
    run_dir = tmp_path / "run"
    # NVFP4 at bounds 1 -/+ 0.05: its ratio error puts many tokens across a bound, so k matters by many tokens
    rows = train(run_dir, tiny_overrides(warm, "train.steps=2", "algo.experimental.clip_error_scale=0",
                                       *WIDE_ERROR, "algo.calibration.shadow_fraction=1"))  # every hp ratio
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert 0.0 <= r["malformed/train"] <= 1.0
        for key in ("experimental/lp_clipfrac", "experimental/hp_clipfrac", "clipfrac", "hp/clipfrac"):
            assert key in r and math.isfinite(r[key]), (r["step"], key)
    # k = 0 decides on the high-precision ratio: exactly its clip fractions, step by step (the r_k arithmetic of other
    # k is tests/algo/test_error_scale.py's); an ignored k would give the learner's own, which differ on this run
    for r in rows:
        for side in ("clipfrac", "clipfrac_lower_neg", "clipfrac_upper_pos"):
            assert r[side] == r[f"experimental/hp_{side}"], (r["step"], side)
    state = pickle.loads((Path(latest_checkpoint(run_dir / "checkpoints")) / RL_STATE_FILE).read_bytes())
    assert 0.0 <= state["eval_malformed_before"] <= 1.0 and 0.0 <= state["eval_malformed_after"] <= 1.0
    assert "malformed answers, train" in (run_dir / "summary.txt").read_text()


@pytest.fixture(scope="module")
def high_precision_decision_run(tmp_path_factory):
    """(run_dir, rows) of 3 NVFP4 steps with algo.policy_loss.clip_decision=high_precision and no calibration (the
    option that the default decision rule must train exactly as)."""
    warm = warm_start(tmp_path_factory)
    run_dir = tmp_path_factory.mktemp("hp_decision") / "run"
    return run_dir, train(run_dir, tiny_overrides(warm, "train.steps=3", *WIDE_ERROR,
                                                  "algo.calibration.enabled=false",
                                                  "algo.policy_loss.clip_decision=high_precision"))


@pytest.mark.slow
@pytest.mark.trajectory
def test_a_high_precision_clip_decision_through_the_loop(high_precision_decision_run):
    """algo.policy_loss.clip_decision=high_precision: a low-precision run whose every update clips exactly the tokens
    its high-precision ratios put outside the bounds (the loss's clip fractions are the high-precision ones, step by
    step). NVFP4: in a few tiny steps FP8's ratios clip the same tokens as high precision, NVFP4's do not."""
    _, rows = high_precision_decision_run
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        for side in ("clipfrac", "clipfrac_lower_neg", "clipfrac_upper_pos"):
            assert r[side] == pytest.approx(r[f"experimental/hp_{side}"], abs=1e-12), (r["step"], side)
    # the learner's own ratios would have clipped other tokens, many of them: the run makes the decision matter
    assert sum(abs(r["experimental/lp_clipfrac"] - r["experimental/hp_clipfrac"]) for r in rows) > MANY_TOKENS


@pytest.mark.slow
@pytest.mark.trajectory
def test_the_decision_rule_through_the_loop_is_the_high_precision_clip_decision(tmp_path_factory, tmp_path,
                                                                                 high_precision_decision_run):
    """algo.calibration.strength=decision (NVFP4, a calibration event every step): every step from the
    first decides its clips on high-precision ratios at 1 -/+ eps, and the run trains exactly as
    algo.policy_loss.clip_decision=high_precision without calibration: the events only measure (the same loss, clip
    fractions, rewards and held-out accuracy, step by step), while they log the learner's own distortion."""
    warm = warm_start(tmp_path_factory)
    decision = train(tmp_path / "decision", tiny_overrides(warm, "train.steps=3", *WIDE_ERROR,
                                                          "algo.calibration.strength=decision"))
    option_dir, option = high_precision_decision_run
    assert [r["step"] for r in decision] == [0, 1, 2]
    assert [r["calib/hp_decision"] for r in decision] == [1.0, 1.0, 1.0]  # from the first step, no gate to open
    for r, o in zip(decision, option):
        assert (r["calib/lower"], r["calib/upper"]) == (pytest.approx(0.99), pytest.approx(1.01)), r["step"]
        for side in ("clipfrac", "clipfrac_lower_neg", "clipfrac_upper_pos"):
            assert r[side] == pytest.approx(r[f"experimental/hp_{side}"], abs=1e-12), (r["step"], side)
        for key in ("loss/total", "learner/grad_norm", "clipfrac", "reward/mean", "entropy", "experimental/lp_clipfrac"):
            assert r[key] == o[key], (r["step"], key)
        assert "calib/gate_ratio" in r and "calib/hp_decision" not in o
    assert sum(abs(r["experimental/lp_clipfrac"] - r["experimental/hp_clipfrac"]) for r in decision) > MANY_TOKENS
    state = lambda d: pickle.loads((Path(latest_checkpoint(d / "checkpoints")) / RL_STATE_FILE).read_bytes())
    assert state(tmp_path / "decision")["eval_after"] == state(option_dir)["eval_after"]


@pytest.mark.slow
def test_the_targeted_decision_through_the_loop(tmp_path_factory, tmp_path, high_precision_decision_run):
    """algo.calibration.strength=targeted: at targeted_fraction 1 every off-policy answer is targeted and the run trains
    exactly as algo.policy_loss.clip_decision=high_precision (the same loss, clip fractions, rewards, held-out accuracy);
    at a small fraction only that share of the tokens is decided in high precision, and the run's clips are not the
    high-precision ones (they would be if the whole batch were forwarded)."""
    warm = warm_start(tmp_path_factory)
    whole = train(tmp_path / "whole", tiny_overrides(warm, "train.steps=3", *WIDE_ERROR, "algo.calibration.strength=targeted",
                                                     "algo.calibration.targeted_fraction=1"))
    option_dir, option = high_precision_decision_run
    assert [r["calib/hp_decision"] for r in whole] == [1.0, 1.0, 1.0]
    for r, o in zip(whole, option):
        for key in ("loss/total", "learner/grad_norm", "clipfrac", "reward/mean", "entropy", "experimental/lp_clipfrac"):
            assert r[key] == o[key], (r["step"], key)
    state = lambda d: pickle.loads((Path(latest_checkpoint(d / "checkpoints")) / RL_STATE_FILE).read_bytes())
    assert state(tmp_path / "whole")["eval_after"] == state(option_dir)["eval_after"]
    few = train(tmp_path / "few", tiny_overrides(warm, "train.steps=2", *WIDE_ERROR, "algo.calibration.strength=targeted",
                                                 "algo.calibration.targeted_fraction=0.2"))
    for r in few:
        assert 0.0 < r["calib/targeted_token_share"] < 0.5, r["step"]
        assert r.get("calib/alpha_target") is None or math.isnan(r["calib/alpha_target"])  # no event: nothing measured
