"""The CPU kernel pins (megatron_rl/cpu_kernels.py): which machines get them, user values win, the launchers pass
them on, and torch really switches its kernel path when they are set."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl import cpu_kernels
from megatron_rl.cpu_kernels import PINNED_CPU_KERNELS, has_avx2, pinned_env

REPO = Path(__file__).resolve().parents[1]


def test_has_avx2_reads_the_flags_line():
    assert has_avx2("processor : 0\nflags : fpu sse2 avx avx2 fma\n")
    assert not has_avx2("processor : 0\nflags : fpu sse2 avx fma\n")
    assert not has_avx2("model name : avx2 in the name only\nflags : fpu sse2\n")


def test_pinned_env_adds_missing_keys_and_keeps_user_values():
    env = pinned_env({"PATH": "/bin", "MKL_CBWR": "AUTO"}, avx2=True)
    assert env == {"PATH": "/bin", "MKL_CBWR": "AUTO", "ATEN_CPU_CAPABILITY": PINNED_CPU_KERNELS["ATEN_CPU_CAPABILITY"]}
    assert pinned_env({"PATH": "/bin"}, avx2=False) == {"PATH": "/bin"}


def test_study_children_get_the_pins(tmp_path, monkeypatch):
    from megatron_rl.study import load_study
    from megatron_rl.study.runner import child_env

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"base: {REPO / 'examples/configs/tiny_grpo.yaml'}\noutput_dir: {tmp_path / 'out'}\nsteps: 2\n"
                    "arms: [{name: hp}]\n")
    for key in PINNED_CPU_KERNELS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(cpu_kernels, "has_avx2", lambda cpuinfo=None: True)
    env = child_env(load_study(spec))
    assert {k: env[k] for k in PINNED_CPU_KERNELS} == PINNED_CPU_KERNELS and env["OMP_NUM_THREADS"] == "1"


def test_run_tiny_exports_the_pins():
    assert 'eval "$(.venv/bin/python -m megatron_rl.cpu_kernels)"' in (REPO / "scripts/run_tiny.sh").read_text()
    env = {k: v for k, v in os.environ.items() if k not in PINNED_CPU_KERNELS}
    out = subprocess.run([sys.executable, "-m", "megatron_rl.cpu_kernels"], env=env, capture_output=True, text=True,
                         check=True).stdout
    expected = [f"export {k}={v}" for k, v in PINNED_CPU_KERNELS.items()] if has_avx2() else []
    assert out.splitlines() == expected


@pytest.mark.skipif(not has_avx2(), reason="the pins apply only to x86-64 CPUs with AVX2")
def test_torch_runs_the_pinned_kernel_path():
    env = pinned_env({k: v for k, v in os.environ.items() if k not in PINNED_CPU_KERNELS})
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == "AVX2"


def test_kernel_path_env_sets_and_removes_the_variables():
    from megatron_rl.cpu_kernels import KERNEL_PATHS, kernel_path_env

    user = {"PATH": "/bin", "ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "AUTO"}
    assert kernel_path_env(user, "native") == {"PATH": "/bin"}
    assert kernel_path_env(user, "plain") == {"PATH": "/bin", **KERNEL_PATHS["plain"]}
    assert kernel_path_env({}, "avx2") == PINNED_CPU_KERNELS
    with pytest.raises(ValueError, match="unknown kernel path 'avx9'; valid: native, avx2, plain"):
        kernel_path_env({}, "avx9")


def test_study_arms_choose_their_kernel_path_and_per_run_warm_starts(tmp_path):
    from megatron_rl.study import load_study
    from megatron_rl.study.runner import child_env
    from megatron_rl.study.spec import StudyError

    spec = tmp_path / "spec.yaml"
    body = (f"base: {REPO / 'examples/configs/tiny_grpo.yaml'}\noutput_dir: {tmp_path / 'out'}\nsteps: 2\nwarm_start: per_run\n"
            "arms: [{name: plain, kernels: plain, overrides: {sft.steps: 30}}, {name: pinned}]\n")
    spec.write_text(body)
    study = load_study(spec)
    assert {k: child_env(study, "plain").get(k) for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")} == \
        {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE,STRICT"}
    # per_run: the runs share the data, each trains its own SFT (no init checkpoint), so arms may change sft.*
    warm = study.warm_overrides()
    assert all(o.startswith("data.") for o in warm) and warm
    assert study.run_config("plain", 1, warm).model.init_checkpoint is None
    assert study.run_config("plain", 1, warm).sft.steps == 30
    spec.write_text(body.replace("kernels: plain", "kernels: avx9"))
    with pytest.raises(StudyError, match="arms.0.kernels: .*unknown kernel path 'avx9'"):
        load_study(spec)
    spec.write_text(body.replace("warm_start: per_run\n", ""))  # shared: an arm may not change the shared SFT
    with pytest.raises(StudyError, match="sft.steps.*would change the warm start"):
        load_study(spec)


def test_kernel_report_names_what_this_process_runs():
    import torch

    from megatron_rl.cpu_kernels import cpu_model, kernel_report

    line = kernel_report({"MKL_CBWR": "COMPATIBLE"})
    assert line.startswith(f"ATen {torch.backends.cpu.get_cpu_capability()}, MKL_CBWR=COMPATIBLE, ")
    assert f", {torch.get_num_threads()} thread" in line and line.endswith(cpu_model())
    assert cpu_model("model name : Some CPU\nflags : fpu avx2 avx512f amx_tile\n") == "Some CPU (avx2, avx512f, amx_tile)"
