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
