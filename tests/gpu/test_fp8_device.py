"""pytest wrapper of the one-shot FP8 device check (tests/gpu/fp8_device_check.py); skips without CUDA."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs transformer-engine")
def test_fp8_device_check():
    script = os.path.join(os.path.dirname(__file__), "fp8_device_check.py")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600)
    print(proc.stdout[-20000:])
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
