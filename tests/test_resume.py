"""Exact resume: a tiny FP8 calibrated RL run SIGKILLed mid-step (or mid-checkpoint-write) and rerun with the
same command produces, step for step, the metrics of an uninterrupted run with the same seed (bitwise on CPU)."""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl_runs import cli_env, comparable, read_rows, tiny_overrides, train, train_command, warm_start

HOOK = Path(__file__).with_name("resume_hook.py")
STEPS = 4
KILL_STEP = 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(overrides, rows of the uninterrupted reference run)."""
    warm = warm_start(tmp_path_factory)
    # a calibration event at steps 0 and 3 only: the killed step 2 and the step before it are ordinary per_step
    # solves at targets held from step 0, so the resume must restore held targets and bounds, not only an event's
    overrides = tiny_overrides(warm, f"train.steps={STEPS}", "checkpoint.save_every=1", "tracking.log_samples=16",
                               "algo.calibration.calibrate_every=3")
    reference = train(tmp_path_factory.mktemp("resume") / "reference", overrides)
    assert [r["step"] for r in reference] == list(range(STEPS))
    assert [("hp/clipfrac" in r, "calib/solve_lower" in r) for r in reference] == [(True, True), (False, True),
                                                                                  (False, True), (True, True)]
    return overrides, reference


def _alive(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) process."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def _kill_group(pgid: int) -> None:
    """SIGKILL whatever is left of a process group (started with start_new_session=True)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run_until_paused(run_dir: Path, overrides: list[str], hook: str) -> tuple[subprocess.Popen, dict]:
    """Start the run under the pause hook in its own process group; return it once paused, with the marker data."""
    marker = run_dir.parent / f"{run_dir.name}.paused"
    env = {**cli_env(), "RESUME_HOOK": hook, "RESUME_HOOK_MARKER": str(marker)}
    cmd = train_command(run_dir, overrides)
    cmd[1:3] = [str(HOOK)]  # python tests/resume_hook.py train CONFIG ... instead of python -m megatron_rl.cli
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 400
    while not marker.exists():
        if proc.poll() is not None:
            _kill_group(proc.pid)
            raise AssertionError(f"run exited (rc={proc.returncode}) before pausing:\n{proc.stderr.read()[-4000:]}")
        if time.monotonic() > deadline:
            _kill_group(proc.pid)
            raise AssertionError("run did not reach the pause point")
        time.sleep(0.1)
    return proc, json.loads(marker.read_text())


def _assert_same_steps(reference: list[dict], resumed: list[dict]) -> None:
    assert [r["step"] for r in resumed] == [r["step"] for r in reference]
    for ref, got in zip(reference, resumed):
        ref, got = comparable(ref), comparable(got)
        diff = sorted(k for k in set(ref) | set(got) if ref.get(k) != got.get(k))
        assert not diff, f"step {ref['step']} differs from the uninterrupted run in {diff[:12]}"


def _resume(run_dir: Path, overrides: list[str]) -> tuple[list[dict], str]:
    proc = subprocess.run(train_command(run_dir, overrides), env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"resumed run failed:\n{proc.stderr[-6000:]}"
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]  # loading the checkpoint warns no more than a first run
    return read_rows(run_dir), proc.stdout


@pytest.mark.slow
def test_sigkill_during_training_step_resumes_exactly(setup, tmp_path):
    overrides, reference = setup
    run_dir = tmp_path / "killed"
    proc, paused = _run_until_paused(run_dir, overrides, f"train:{KILL_STEP}")
    try:
        # SIGKILL the trainer alone: nothing runs its cleanup, so its engine must notice and exit by itself
        os.kill(paused["pid"], signal.SIGKILL)
        proc.wait(timeout=30)
        assert paused["engine_pids"], "the hook saw no embedded engine"
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in paused["engine_pids"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in paused["engine_pids"] if _alive(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        assert not left, "the embedded engine outlived its SIGKILLed trainer"
    finally:
        # the rest of the killed trainer's process group (its checkpoint-writer worker and multiprocessing's
        # resource tracker) has no parent left to stop it
        _kill_group(proc.pid)
    assert [r["step"] for r in read_rows(run_dir)] == list(range(KILL_STEP))
    from megatron_rl.trainer.checkpoint import RL_STATE_FILE, latest_checkpoint

    first_session = pickle.loads((Path(latest_checkpoint(str(run_dir / "checkpoints"))) / RL_STATE_FILE).read_bytes())
    resumed, stdout = _resume(run_dir, overrides)
    assert f"at step {KILL_STEP}" in stdout
    _assert_same_steps(reference, resumed)
    # the summary's wall time covers both sessions, not only the resumed one
    wall = next(line for line in (run_dir / "summary.txt").read_text().splitlines() if line.startswith("wall time"))
    assert "summed over 2 sessions" in wall
    assert float(wall.split(": ")[1].split()[0]) > first_session["wall_s"] > 0


@pytest.mark.slow
def test_sigkill_during_checkpoint_write_leaves_no_child_and_resumes_from_previous(setup, tmp_path):
    overrides, reference = setup
    from megatron_rl.trainer.checkpoint import latest_checkpoint, step_dir_name

    run_dir = tmp_path / "killed_in_save"
    proc, paused = _run_until_paused(run_dir, overrides, f"checkpoint:{KILL_STEP}")
    children = dict(paused["children"])
    # megatron's checkpoint writer keeps a spawn Manager (and a resource tracker) alive: the kill must not orphan them
    assert any("multiprocessing" in cmd for cmd in children.values()), children
    os.kill(paused["pid"], signal.SIGKILL)  # the trainer alone: none of its exit handlers run
    proc.wait(timeout=30)
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = {p: cmd for p, cmd in children.items() if _alive(p)}
    for p in survivors:
        os.kill(p, signal.SIGKILL)
    _kill_group(proc.pid)  # whatever else the trainer's process group still holds (the engine exits by its watchdog)
    assert not survivors, f"children outlived their SIGKILLed trainer: {survivors}"
    ckpts = run_dir / "checkpoints"
    assert (ckpts / f".tmp_step_{KILL_STEP}").exists(), "the kill was meant to land inside the write"
    assert latest_checkpoint(str(ckpts)) == str(ckpts / step_dir_name(KILL_STEP - 1))
    # step KILL_STEP's metrics row was written before the save; the rerun must redo the step
    assert [r["step"] for r in read_rows(run_dir)] == list(range(KILL_STEP + 1))
    resumed, stdout = _resume(run_dir, overrides)
    assert f"{step_dir_name(KILL_STEP - 1)} at step {KILL_STEP}" in stdout
    _assert_same_steps(reference, resumed)
    assert not (ckpts / f".tmp_step_{KILL_STEP}").exists()
