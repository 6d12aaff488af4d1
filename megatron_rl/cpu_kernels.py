"""The CPU kernel paths of torch and MKL: what a run pins, the paths a study can select, and what a run reports.

torch picks its vectorized ATen kernels (AVX-512, AVX2 or plain) and MKL its GEMM code path from the CPU it runs
on; the paths sum in different orders, so the same run gives different last bits on different kernel paths, and
training amplifies them. The main job and the study runner pin the AVX2 paths, which every x86-64 CPU of the last
decade has: ATen's own AVX2 kernels (`ATEN_CPU_CAPABILITY=avx2`) and MKL's conditional numerical reproducibility
mode (`MKL_CBWR=AVX2,STRICT`). With the pins a run repeats bit for bit on one machine, at any thread count; it
does NOT repeat across CPU vendors: an Intel Xeon and an AMD EPYC gave different warm starts under the same pins
(MKL's code paths differ by vendor, which CBWR does not cover; tools/op_digest.py lists the ops that move with
each setting one machine can switch, docs/miniatures.md the findings). So the main job is built to give the same
outcome, not the same bits, on every CPU: its numbers are stated as ranges over seeds and kernel paths.

Both libraries read these variables once, at start, so launchers set them for their children:
`scripts/run_tiny.sh` exports PINNED_CPU_KERNELS, the study runner passes them (or an arm's `kernels` path from
KERNEL_PATHS) to every run. Values the user has already set win over the pins. Non-x86 machines (and x86 without
AVX2) are left alone.

    python -m megatron_rl.cpu_kernels      # prints the `export ...` lines that apply on this machine
"""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Mapping, Optional

PINNED_CPU_KERNELS: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"}
"""Environment of a pinned run (the values scripts/run_tiny.sh exports)."""

KERNEL_PATHS: dict[str, dict[str, Optional[str]]] = {
    "native": {"ATEN_CPU_CAPABILITY": None, "MKL_CBWR": None},
    "avx2": dict(PINNED_CPU_KERNELS),
    "plain": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE,STRICT"},
}
"""Kernel paths one x86-64 machine can select: `native` (what the CPU picks: both variables unset), `avx2` (the
pins), `plain` (ATen's non-vectorized kernels, MKL's SSE2-era compatible path). None removes a variable."""


def kernel_path_env(env: Mapping[str, str], name: str) -> dict[str, str]:
    """A copy of `env` running the kernel path `name` of KERNEL_PATHS (its variables set or removed)."""
    if name not in KERNEL_PATHS:
        raise ValueError(f"unknown kernel path {name!r}; valid: {', '.join(KERNEL_PATHS)}")
    out = dict(env)
    for key, value in KERNEL_PATHS[name].items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def has_avx2(cpuinfo: Optional[str] = None) -> bool:
    """True on an x86-64 CPU whose flags include avx2 (from /proc/cpuinfo text; read when not given)."""
    if cpuinfo is None:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return False
        cpuinfo = _cpuinfo()
    return any(line.startswith("flags") and "avx2" in line.split() for line in cpuinfo.splitlines())


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def pinned_env(env: Mapping[str, str], avx2: Optional[bool] = None) -> dict[str, str]:
    """A copy of `env` with PINNED_CPU_KERNELS added where unset (nothing added without AVX2)."""
    out = dict(env)
    if has_avx2() if avx2 is None else avx2:
        for key, value in PINNED_CPU_KERNELS.items():
            out.setdefault(key, value)
    return out


def cpu_model(cpuinfo: Optional[str] = None) -> str:
    """The CPU's model name and its widest vector extensions (from /proc/cpuinfo; the platform name elsewhere)."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name or platform.processor() or platform.machine()}" + (f" ({', '.join(shown)})" if shown else "")


def kernel_report(env: Optional[Mapping[str, str]] = None) -> str:
    """One line naming the kernel path this process runs: ATen's capability in use, MKL_CBWR, threads, CPU."""
    import torch

    env = os.environ if env is None else env
    parts = [f"ATen {torch.backends.cpu.get_cpu_capability()}", f"MKL_CBWR={env.get('MKL_CBWR', 'unset')}"]
    for key in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"):
        if key in env:
            parts.append(f"{key}={env[key]}")
    threads = torch.get_num_threads()
    parts += [f"{threads} thread{'s' if threads != 1 else ''}", cpu_model()]
    return ", ".join(parts)


if __name__ == "__main__":  # the exports that apply here; variables the user has set are left out
    for key, value in pinned_env(os.environ).items():
        if key not in os.environ:
            print(f"export {key}={value}")


def reexec_pinned() -> None:
    """Start this script again under the pinned kernels and one thread unless it already runs so (both libraries
    pick their kernels when they load, so a running process cannot switch)."""
    import sys

    env = pinned_env(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if env != dict(os.environ):
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
