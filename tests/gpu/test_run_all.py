"""CI mirror of tests/gpu/run_all.sh and tests/gpu/run_image.sh: the same scripts in their CPU modes (each check's CPU
mode; SGLang through tests/fixtures/fake_sglang), one PASS / FAIL / SKIP line per check. On a GPU machine run the
scripts themselves (see their headers)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def parse(stdout: str) -> list[tuple[str, str, str]]:
    """(status, script, rest) of every check line."""
    out = []
    for ln in stdout.splitlines():
        head, _, rest = ln.partition(": ")
        parts = head.split()
        if len(parts) == 2 and parts[0] in ("PASS", "FAIL", "SKIP"):
            out.append((parts[0], parts[1], rest))
    return out


def checks(lines, script: str) -> dict[str, str]:
    """check name -> status for one script's lines (the name is the first word after 'script: ')."""
    return {rest.split()[0]: status for status, s, rest in lines if s == script and rest}


@pytest.mark.slow
def test_run_all_cpu_mirror(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", RUN_ALL_LOGS=str(tmp_path))
    proc = subprocess.run(["bash", str(ROOT / "tests" / "gpu" / "run_all.sh"), "--cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1500)
    lines = parse(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {s for st, s, _ in lines} == {"learner_device_check", "fp8_device_check", "calibration_device_check",
                                         "weight_sync_device_check", "sglang_launch_check"}
    assert checks(lines, "learner_device_check") == {
        "learner_step_distopt": "PASS", "checkpoint_resume_distopt": "PASS",
        # torch's CPU scaled matmul refuses block scales: a SKIP with torch's reason, never a PASS
        "blockwise_gemm_fprop": "SKIP", "blockwise_gemm_wgrad": "SKIP"}
    assert [st for st, s, _ in lines if s == "fp8_device_check"] == ["SKIP"]
    calibration = checks(lines, "calibration_device_check")
    assert set(calibration.values()) == {"PASS"} and {"loss_allgather", "loss_histogram", "train_per_calibration_allgather",
                                                      "train_per_minibatch_histogram"} <= set(calibration)
    sync = checks(lines, "weight_sync_device_check")
    assert sync.pop("nccl_broadcast_two_gpus") == "SKIP" and set(sync.values()) == {"PASS"} and len(sync) == 6
    assert checks(lines, "sglang_launch_check") == {"fp8-blockwise/fp8_e4m3": "PASS"}
    assert proc.stdout.splitlines()[-1] == f"{sum(st == 'PASS' for st, _, _ in lines)} passed, 0 failed, 4 skipped"
    assert "weight_version after sync '1'" in (tmp_path / "sglang_launch_check.log").read_text()


def _fake_python(tmp_path: Path, body: str) -> Path:
    """A PYTHON whose `-c` probes succeed (the dependency probe imports megatron: ~3 CPU-s that the mirror test above
    already spends for real) and whose check scripts behave as `body` says."""
    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\n[ "$1" = -c ] && exit 0\ncase "$*" in\n' + body + '\nesac\n')
    fake.chmod(0o755)
    return fake


def _run_all(tmp_path: Path, fake: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=str(fake), RUN_ALL_LOGS=str(tmp_path / "logs"), WHEELS=str(tmp_path / "none"))
    return subprocess.run(["bash", str(ROOT / "tests" / "gpu" / "run_all.sh"), "--cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_failing_check_is_reported_and_fails_the_run(tmp_path):
    """A [FAIL] line is a FAIL naming the script, the check and the log; a [SKIP] line a SKIP; exit 1."""
    fake = _fake_python(tmp_path, '*calibration_device_check*) echo "[PASS] a {}"; echo "[FAIL] loss_x {}"; exit 1;;\n'
                                  '*weight_sync*) echo "[SKIP] two_gpus needs 2 GPUs"; echo "[PASS] b {}"; exit 0;;\n'
                                  '*) echo "[PASS] y {}"; exit 0;;')
    proc = _run_all(tmp_path, fake)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    assert any(ln.startswith("FAIL calibration_device_check: loss_x") and "calibration_device_check.log" in ln for ln in out)
    assert "SKIP weight_sync_device_check: two_gpus needs 2 GPUs" in out
    # learner y, calibration a, weight_sync b, sglang y; fp8 (no CPU mode) and two_gpus skipped
    assert out[-1] == "4 passed, 1 failed, 2 skipped"


def test_a_crash_or_a_silent_script_is_a_fail(tmp_path):
    """Exit non-zero without a [FAIL] line (a crash, a timeout) and exit 0 without any check line both FAIL."""
    fake = _fake_python(tmp_path, '*learner_device_check*) echo "[PASS] z {}"; echo Traceback; exit 3;;\n'
                                  '*weight_sync*) echo "nothing to report"; exit 0;;\n'
                                  '*) echo "[PASS] y {}"; exit 0;;')
    proc = _run_all(tmp_path, fake)
    out = proc.stdout.splitlines()
    assert proc.returncode == 1
    assert any(ln.startswith("FAIL learner_device_check: exit 3") and "1 checks reported" in ln for ln in out), out
    assert any(ln.startswith("FAIL weight_sync_device_check: exit 0 but no check reported") for ln in out), out
    assert out[-1] == "3 passed, 2 failed, 1 skipped"


@pytest.mark.slow
def test_run_image_cpu_mirror(tmp_path):
    """run_image.sh --cpu: the FP8-vs-BF16 training check on emulated FP8 and the weight-sync checks through the fake
    SGLang; the CUDA-build checks are SKIPs with their reasons, and so is the launcher check (run_all.sh --cpu runs it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RUN_ALL_LOGS=str(tmp_path))
    proc = subprocess.run(["bash", str(ROOT / "tests" / "gpu" / "run_image.sh"), "--cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=2400)
    lines = parse(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [(st, s) for st, s, _ in lines if st == "SKIP"] == [("SKIP", "one_environment"), ("SKIP", "fp8_device_check"),
                                                                ("SKIP", "sglang_launch_check")]
    assert checks(lines, "te_training_check") == {"bf16_learns": "PASS", "blockwise_tracks_bf16": "PASS",
                                                  "broken_recipe_is_caught": "PASS"}
    assert checks(lines, "sglang_sync_check") == {"tensor_before_sync": "PASS", "tensor_sync": "PASS",
                                                  "distributed_before_sync": "PASS", "distributed_sync": "PASS"}
    assert proc.stdout.splitlines()[-1] == "7 passed, 0 failed, 3 skipped"
