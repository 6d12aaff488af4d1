"""tools/check_one_environment.py against the real, pinned SGLang wheel (installed without its dependencies into the
conformance cache): it reads the torch pin from sglang 0.5.23's own metadata, so on this CPU box, whose torch is
constraints/cpu.txt's 2.13.0, the rule that the engines' torch is SGLang's must fail naming both versions, while
SGLang itself is found at its pin and imports."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance_packages import ConformanceSetupError, pins, sglang_site

pytestmark = pytest.mark.conformance
ROOT = Path(__file__).resolve().parents[2]


def test_sglang_pins_a_torch_this_box_does_not_have():
    try:
        site = sglang_site()
    except ConformanceSetupError as exc:
        pytest.fail(str(exc), pytrace=False)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "check_one_environment.py"), "check",
                           "--sglang-version", pins()["sglang"], "--te-version", pins()["transformer-engine"],
                           "--megatron-core-version", "0.16.1"], capture_output=True, text=True, env=env, timeout=600)
    lines = {ln.split()[1]: ln for ln in proc.stdout.splitlines() if ln.startswith("[")}
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert lines["sglang_version"].startswith("[PASS]"), lines["sglang_version"]
    import torch

    pin = lines["sglang_torch_pin"]
    assert pin.startswith("[FAIL]") and "requires torch==2.14.1" in pin and torch.__version__ in pin, pin
