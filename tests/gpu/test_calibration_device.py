"""pytest wrappers of tests/gpu/calibration_device_check.py: on CUDA when present (marked gpu), and the same
checks on CPU (so the prepared GPU script cannot rot while no GPU is lent)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "calibration_device_check.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core (tests/gpu/fetch_wheels.sh)")
def test_calibration_device_check_on_cuda():
    proc = _run()
    print(proc.stdout[-20000:])
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]


@pytest.mark.slow
def test_calibration_device_check_runs_on_cpu():
    proc = _run("--device", "cpu")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[PASS]")]
    names = {ln.split()[1] for ln in lines}
    assert {"loss_allgather", "loss_histogram", "train_per_step_allgather", "train_per_calibration_allgather",
            "train_per_minibatch_histogram"} <= names
