"""pytest wrapper of the weight-sync device check (tests/gpu/weight_sync_device_check.py); skips without CUDA."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_weight_sync_device_check():
    script = os.path.join(os.path.dirname(__file__), "weight_sync_device_check.py")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=900)
    print(proc.stdout[-20000:])
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
