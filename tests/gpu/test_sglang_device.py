"""pytest wrapper of the one-shot SGLang launcher check (tests/gpu/sglang_launch_check.py); skips without CUDA or SGLang."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang in this environment")
def test_sglang_launch_check():
    script = os.path.join(os.path.dirname(__file__), "sglang_launch_check.py")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=3600)
    print(proc.stdout[-20000:])
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
