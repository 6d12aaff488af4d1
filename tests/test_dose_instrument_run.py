"""The dose-response instrument and the malformed metric through `megatron-rl train`: a 2-step FP8 run with
Calibrated Clipping every step and algo.experimental.clip_error_scale = 4 logs, on every step, the clip fractions
under the unscaled low-precision and the high-precision ratios next to the ones the scaled decision produced, and
the malformed fraction of the addition task's answers at every step and before / after RL."""
from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest

from rl_runs import tiny_overrides, train, warm_start

from megatron_rl.trainer.checkpoint import RL_STATE_FILE, latest_checkpoint


@pytest.mark.slow
def test_two_steps_with_the_instrument_and_calibration(tmp_path_factory, tmp_path):
    warm = warm_start(tmp_path_factory)
    run_dir = tmp_path / "run"
    rows = train(run_dir, tiny_overrides(warm, "train.steps=2", "algo.experimental.clip_error_scale=4",
                                       "algo.calibration.shadow_fraction=1"))  # the instrument needs every hp ratio
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert 0.0 <= r["malformed/train"] <= 1.0
        for key in ("experimental/lp_clipfrac", "experimental/hp_clipfrac", "clipfrac", "hp/clipfrac"):
            assert key in r and math.isfinite(r[key]), (r["step"], key)
    state = pickle.loads((Path(latest_checkpoint(run_dir / "checkpoints")) / RL_STATE_FILE).read_bytes())
    assert 0.0 <= state["eval_malformed_before"] <= 1.0 and 0.0 <= state["eval_malformed_after"] <= 1.0
    assert "malformed answers, train" in (run_dir / "summary.txt").read_text()


@pytest.mark.slow
def test_a_high_precision_clip_decision_through_the_loop(tmp_path_factory, tmp_path):
    """algo.policy_loss.clip_decision=high_precision: a low-precision run whose every update clips exactly the tokens
    its high-precision ratios put outside the bounds (the loss's clip fractions are the high-precision ones, step by
    step). NVFP4: in two tiny steps FP8's ratios clip the same tokens as high precision, NVFP4's do not."""
    warm = warm_start(tmp_path_factory)
    rows = train(tmp_path / "run", tiny_overrides(warm, "train.steps=2", "algo.calibration.enabled=false",
                                                 "algo.policy_loss.clip_decision=high_precision", "precision.recipe=nvfp4"))
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        for side in ("clipfrac", "clipfrac_lower_neg", "clipfrac_upper_pos"):
            assert r[side] == pytest.approx(r[f"experimental/hp_{side}"], abs=1e-12), (r["step"], side)
    # the learner's own ratios would have clipped other tokens: the run makes the decision matter
    assert any(r["experimental/lp_clipfrac"] != r["experimental/hp_clipfrac"] for r in rows)
