"""The RL loop under every loss aggregation mode, DAPO dynamic sampling, a NaN injected mid-run, and the health
stops (overflow, collapse toward uniform and toward deterministic, a reward drop judged against the weights that
generated the rewards, sync and one_step_off, then a resume), each a tiny run of a few steps (high precision, no
calibration), in one worker process against one in-process engine (tests/loop_variants_worker.py)."""
from __future__ import annotations

import json
import math
import re
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
DROP = "train.health.reward_drop=0.9,train.health.window=1"  # the dropK hook: rewards in [1, 1.1] before step K, 0 from it


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
                                                                        "collapse:optim.lr=1e3,train.steps=3",
                                                                        "lr2:optim.lr=2.0,train.steps=3",
                                                                        f"drop3:{DROP},train.steps=6",
                                                                        f"drop4off:{DROP},train.steps=6,rollout.overlap=one_step_off",
                                                                        "drop4off+resume:train.steps=3,rollout.overlap=one_step_off"]
    proc = subprocess.run([sys.executable, str(WORKER), str(warm), str(out), *cases], env=cli_env(), capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _rows(runs: Path, name: str) -> list[dict]:
    result = json.loads((runs / f"{name}.result.json").read_text())
    assert result.get("ok") is True, f"{name}: {result}"
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
@pytest.mark.trajectory
def test_the_agg_modes_train_different_losses_on_the_same_batch(runs):
    """Step 0 of every agg_mode case trains on the same rollouts (same warm start, seed and engine), so a mode the
    loss ignored would log the same loss as another: every pair must differ by far more than last bits."""
    first = {mode: _rows(runs, f"agg_{mode}")[0] for mode in AGG}
    assert len({r["reward/mean"] for r in first.values()}) == 1, {m: r["reward/mean"] for m, r in first.items()}
    losses = {mode: r["learner/loss"] for mode, r in first.items()}
    for a in AGG:
        for b in AGG:
            if a < b:
                assert abs(losses[a] - losses[b]) > 1e-4 * max(abs(losses[a]), abs(losses[b]), 1e-6), losses


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


def _after(runs: Path, name: str) -> dict:
    """What case `name` left: served_version, checkpoints (directory names), steps (logged), before later cases ran."""
    return json.loads((runs / f"{name}.result.json").read_text())


def _steps(runs: Path, name: str, prefix: str = "step_") -> list[int]:
    """Steps of the checkpoint directories case `name` left whose names start with `prefix` (complete or set aside)."""
    return [int(d.rsplit("_", 1)[1]) for d in _after(runs, name)["checkpoints"] if d.startswith(prefix)]


@pytest.mark.slow
def test_overflowing_lr_never_syncs_broken_weights_and_stops_after_consecutive_skips(runs):
    error, rows = _stopped(runs, "overflow")
    assert error.startswith("TrainingHealthError: training stopped at step 2: 3 consecutive steps")
    assert "train.health.max_consecutive_skips=3" in error and "newest checkpoint: none" in error
    assert [r["health/step_skipped"] for r in rows] == [1.0, 1.0, 1.0]
    assert all(r["rollout/weight_version"] == 0 for r in rows)  # the engine kept the warm start's weights
    assert not list_checkpoints(runs / "overflow" / "checkpoints")


@pytest.mark.slow
@pytest.mark.trajectory
def test_policy_collapsed_to_uniform_is_caught_before_its_weights_leave(runs):
    error, rows = _stopped(runs, "collapse")
    assert "train.health.max_entropy_frac=0.9" in error and "the policy collapsed" in error
    last = rows[-1]
    assert last["health/entropy_frac"] > 0.9 and last["health/step_skipped"] == 0.0 and "sync/bytes" not in last
    assert [step for step, _ in list_checkpoints(runs / "collapse" / "checkpoints")] == list(range(len(rows) - 1))


@pytest.mark.slow
@pytest.mark.trajectory
def test_collapse_toward_deterministic_stops_before_the_weights_leave(runs):
    """optim.lr=2.0 from the warm start drives the entropy toward 0 within a step or two (which step depends on the CPU's
    kernels): whenever the probe catches the one-step fall, that step's updated weights never reach the engine, and
    every version from the condemned one on is set aside (no checkpoint of them stays, the engine serves an older one)."""
    error, rows = _stopped(runs, "lr2")
    stopped_at = rows[-1]["step"]
    assert error.startswith(f"TrainingHealthError: training stopped at step {stopped_at}: "), error
    assert "policy entropy fell from" in error and "train.health.collapse_step_entropy_frac=0.02" in error, error
    assert [r["step"] for r in rows] == list(range(stopped_at + 1)) and "sync/bytes" not in rows[-1]
    assert rows[-1]["health/probe_entropy"] < 0.02 * rows[-1]["health/probe_entropy_before"]
    # the message names condemned versions only when earlier ones had left; otherwise only this step's were at stake
    named = re.search(r"weights from version (\d+) on", error)
    condemned = int(named.group(1)) if named else stopped_at + 1
    assert condemned <= stopped_at + 1  # at the latest the weights this step made (version step + 1)
    assert int(_after(runs, "lr2")["served_version"]) < condemned
    # a complete checkpoint step_N holds version N + 1: none of the condemned versions stays
    assert all(step + 1 < condemned for step, _ in list_checkpoints(runs / "lr2" / "checkpoints"))


@pytest.mark.slow
def test_reward_drop_condemns_the_weights_that_generated_the_rewards(runs):
    """Step 3's rollouts (version 3, the weights after step 2) score 0: the stop sets checkpoint step_2 aside, leaves
    step_1 (version 2, whose rollouts at step 2 scored) as the newest, and the engine serves version 2 again."""
    error, rows = _stopped(runs, "drop3")
    assert error.startswith("TrainingHealthError: training stopped at step 3: train reward collapsed"), error
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[3]["rollout/weight_version"] == 3
    assert "weights from version 3 on (after step 2) are condemned" in error and "rejected_step_00000002" in error
    assert _steps(runs, "drop3") == [1] and _steps(runs, "drop3", "rejected_step_") == [2]
    reason = (runs / "drop3" / "checkpoints" / "rejected_step_00000002" / "REJECTED").read_text()
    assert reason.startswith("training stopped at step 3") and "reward_drop=0.9" in reason
    assert f"newest checkpoint: {runs / 'drop3' / 'checkpoints' / 'step_00000001'}" in error
    assert "the engines serve version 2 again" in error and _after(runs, "drop3")["served_version"] == "2"


@pytest.mark.slow
def test_one_step_off_reward_drop_keeps_the_vouched_checkpoint_and_resumes_from_it(runs):
    """one_step_off: step 4 trains on rollouts of version 3 (generated while step 3 trained), which score 0. Versions 3
    and 4 (checkpoints step_2, step_3) are condemned; retention had kept step_1 (version 2, vouched by step 3's rollouts)
    beside keep_last=2, so it is the newest, and a resume starts from it."""
    stopped = _after(runs, "drop4off")
    assert "error" in stopped and stopped["steps"] == [0, 1, 2, 3, 4]
    error = stopped["error"]
    assert error.startswith("TrainingHealthError: training stopped at step 4: train reward collapsed"), error
    assert "weights from version 3 on (after step 2) are condemned" in error, error
    assert _steps(runs, "drop4off") == [1] and _steps(runs, "drop4off", "rejected_step_") == [2, 3]
    assert "the engines serve version 2 again" in error and stopped["served_version"] == "2"
    resumed = _after(runs, "drop4off+resume")
    assert resumed.get("ok") is True, resumed
    rows = read_rows(runs / "drop4off")
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 2 retrained from step_1's weights and its saved batch
    assert [r["rollout/weight_version"] for r in rows] == [0, 0, 1] and resumed["served_version"] == "3"
    assert _steps(runs, "drop4off+resume") == [1, 2]
