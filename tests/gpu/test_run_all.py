"""CI mirror of tests/gpu/run_all.sh: the same script in its CPU mode (each check's CPU mode; the SGLang launcher
check through tests/fixtures/fake_sglang). On a GPU machine run the script itself (see its header)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_run_all_cpu_mirror(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", RUN_ALL_LOGS=str(tmp_path))
    proc = subprocess.run(["bash", str(ROOT / "tests" / "gpu" / "run_all.sh"), "--cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = {ln.split()[1].rstrip(":"): ln.split()[0] for ln in lines if ln.split()[:1] in (["PASS"], ["FAIL"], ["SKIP"])}
    assert status == {"fp8_device_check": "SKIP", "calibration_device_check": "PASS", "weight_sync_device_check": "PASS",
                      "sglang_launch_check": "PASS"}, proc.stdout
    assert lines[-1] == "3 passed, 0 failed, 1 skipped"
    calibration = (tmp_path / "calibration_device_check.log").read_text()
    names = {ln.split()[1] for ln in calibration.splitlines() if ln.startswith("[PASS]")}
    assert {"loss_allgather", "loss_histogram", "train_per_calibration_allgather", "train_per_minibatch_histogram"} <= names
    assert "weight_version after sync '1'" in (tmp_path / "sglang_launch_check.log").read_text()


def test_a_failing_check_is_reported_and_fails_the_run(tmp_path):
    """A check that exits non-zero gives a FAIL line naming it and exit 1 (PYTHON stands in for a broken check)."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\n[ "$1" = -c ] && exec {sys.executable} "$@"\n'
                    'case "$*" in *calibration_device_check*) echo "[FAIL] loss_x {}"; exit 1;; '
                    '*) echo "[PASS] y {}"; exit 0;; esac\n')
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), RUN_ALL_LOGS=str(tmp_path / "logs"), WHEELS=str(tmp_path / "none"))
    proc = subprocess.run(["bash", str(ROOT / "tests" / "gpu" / "run_all.sh"), "--cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert any(ln.startswith("FAIL calibration_device_check: exit 1") and "loss_x" in ln for ln in proc.stdout.splitlines())
    assert proc.stdout.splitlines()[-1] == "2 passed, 1 failed, 1 skipped"
