"""The RL loop under every loss aggregation mode, DAPO dynamic sampling, and a NaN injected mid-run, each a tiny
2-3 step run (high precision, no calibration) in one worker process against one in-process engine
(tests/loop_variants_worker.py)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from rl_runs import CONFIG, cli_env, read_rows, tiny_overrides, warm_start

from megatron_rl.algo.aggregation import AGG_MODES
from megatron_rl.trainer.checkpoint import list_checkpoints

WORKER = Path(__file__).with_name("loop_variants_worker.py")
AGG = AGG_MODES.names()
DAPO = "algo.dapo.dynamic_sampling=true,algo.policy_loss.eps_high=0.28"


def _dapo_train_file(warm: Path, out: Path) -> Path:
    """The warm start's training prompts, two of step 0's first four with an answer longer than
    rollout.sampling.max_new_tokens: no sample can be right, so those groups have no reward spread whatever the
    machine's rollouts, and DAPO must filter them and generate more (the prompt order is a seeded host shuffle)."""
    from megatron_rl.config import load_config
    from megatron_rl.data.jsonl import PromptRow, read_jsonl, write_jsonl
    from megatron_rl.phases.rollout import PromptStream

    cfg = load_config(CONFIG, tiny_overrides(warm))
    rows = read_jsonl(warm / "data" / "train.jsonl")
    unreachable = "9" * (cfg.rollout.sampling.max_new_tokens + 1)
    blocked = {r.prompt for r in PromptStream(rows, cfg.data.seed).take(cfg.train.prompts_per_step)[:2]}
    path = out / "dapo_train.jsonl"
    write_jsonl(path, [PromptRow(r.prompt, unreachable if r.prompt in blocked else r.answer, r.meta) for r in rows])
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """OUT dir holding one run directory (and result file) per case."""
    warm = warm_start(tmp_path_factory)
    out = tmp_path_factory.mktemp("variants")
    dapo = f"{DAPO},data.train_file={_dapo_train_file(warm, out)}"
    cases = [f"agg_{m}:algo.policy_loss.agg_mode={m}" for m in AGG] + [f"dapo:{dapo}", "nan:train.steps=3",
                                                                        "overflow:optim.lr=1e20,train.steps=5",
                                                                        "collapse:optim.lr=1e3,train.steps=3"]
    proc = subprocess.run([sys.executable, str(WORKER), str(warm), str(out), *cases], env=cli_env(), capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _rows(runs: Path, name: str) -> list[dict]:
    result = json.loads((runs / f"{name}.result.json").read_text())
    assert result == {"ok": True}, f"{name}: {result}"
    return read_rows(runs / name)


@pytest.mark.slow
@pytest.mark.parametrize("mode", AGG)
def test_every_agg_mode_trains_two_steps(runs, mode):
    rows = _rows(runs, f"agg_{mode}")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        for key in ("learner/loss", "learner/grad_norm", "entropy", "clipfrac"):
            assert isinstance(r.get(key), float) and math.isfinite(r[key]), f"{mode} step {r['step']}: {key}={r.get(key)}"
        assert r["learner/update_skipped"] == 0.0 and r["health/skipped_steps"] == 0.0
        assert r["rollout/weight_version"] == r["step"]  # every step's weights reached the engine


@pytest.mark.slow
def test_dapo_dynamic_sampling_refills_the_step_with_groups_that_have_spread(runs):
    rows = _rows(runs, "dapo")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["dapo/filtered_frac"] == r["groups/no_spread_frac"]
        # a filtered group leaves the first round short, so it must have been refilled by another round
        assert r["dapo/gen_batches"] >= (2 if r["dapo/filtered_frac"] > 0 else 1)
        # no zero-spread group reached the batch: every trained sample carries a GRPO signal
        assert r["adv/zero_frac"] == 0.0
        assert math.isfinite(r["learner/loss"])
    assert rows[0]["dapo/filtered_frac"] > 0 and rows[0]["dapo/gen_batches"] >= 2  # the two unanswerable prompts
    # plain GRPO keeps its zero-spread groups (zero advantages) in the batch
    grpo = _rows(runs, "agg_token-mean")
    assert grpo[0]["adv/zero_frac"] == pytest.approx(grpo[0]["groups/no_spread_frac"])


@pytest.mark.slow
def test_nan_mid_run_skips_the_step_and_the_run_continues(runs):
    rows = _rows(runs, "nan")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["health/step_skipped"] for r in rows] == [0.0, 1.0, 0.0]
    assert [r["health/skipped_steps"] for r in rows] == [0.0, 1.0, 1.0]
    assert rows[1]["learner/update_skipped"] > 0 and rows[0]["learner/update_skipped"] == rows[2]["learner/update_skipped"] == 0
    # step 1's weights never reached the engine (it still serves step 0's) nor a checkpoint
    assert rows[2]["rollout/weight_version"] == 1
    assert "sync/bytes" not in rows[1] and "sync/bytes" in rows[2]
    assert [step for step, _ in list_checkpoints(runs / "nan" / "checkpoints")] == [0, 2]


def _stopped(runs: Path, name: str) -> tuple[str, list[dict]]:
    result = json.loads((runs / f"{name}.result.json").read_text())
    assert "error" in result, f"{name} was meant to stop: {result}"
    return result["error"], read_rows(runs / name)


@pytest.mark.slow
def test_overflowing_lr_never_syncs_broken_weights_and_stops_after_consecutive_skips(runs):
    error, rows = _stopped(runs, "overflow")
    assert error.startswith("TrainingHealthError: training stopped at step 2: 3 consecutive steps")
    assert "train.health.max_consecutive_skips=3" in error and "newest checkpoint: none" in error
    assert [r["health/step_skipped"] for r in rows] == [1.0, 1.0, 1.0]
    assert all(r["rollout/weight_version"] == 0 for r in rows)  # the engine kept the warm start's weights
    assert not list_checkpoints(runs / "overflow" / "checkpoints")


@pytest.mark.slow
def test_policy_collapsed_to_uniform_is_caught_before_its_weights_leave(runs):
    error, rows = _stopped(runs, "collapse")
    assert "train.health.max_entropy_frac=0.9" in error and "the policy collapsed" in error
    last = rows[-1]
    assert last["health/entropy_frac"] > 0.9 and last["health/step_skipped"] == 0.0 and "sync/bytes" not in last
    assert [step for step, _ in list_checkpoints(runs / "collapse" / "checkpoints")] == list(range(len(rows) - 1))
