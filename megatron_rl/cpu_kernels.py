"""Pin the CPU kernel paths of torch and MKL so a tiny CPU run gives the same bits on every x86-64 machine.

torch picks its vectorized ATen kernels (AVX-512, AVX2 or plain) and MKL its GEMM code path from the CPU
it runs on. Those paths sum in different orders, and the tiny warm start is chaotic: on one AVX-512 box the
same 800-step SFT reached 67% held-out accuracy with the native kernels, 61% with the AVX2 ones and 44%
with the plain ones (docs/RESULTS.md). Thread count did not change a bit (1, 2 and 4 threads gave identical
weights). So the main job and the study runner run with the AVX2 paths, which every x86-64 CPU of the last
decade has: ATen's own AVX2 kernels (`ATEN_CPU_CAPABILITY`) and MKL's conditional numerical
reproducibility mode (`MKL_CBWR=AVX2,STRICT`: bitwise-identical GEMM results on any AVX2 processor, STRICT
also across thread counts). Both libraries are configured only through these environment variables, and they
must be set before the process starts (MKL and ATen read them once), so launchers set them for their children:
`scripts/run_tiny.sh` exports the same values, the study runner passes them to every run. Values the user has
already set win. Non-x86 machines (and x86 without AVX2) are left alone: their numbers differ by the spread
RESULTS.md reports.

    python -m megatron_rl.cpu_kernels      # prints the `export ...` lines that apply on this machine
"""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Mapping, Optional

PINNED_CPU_KERNELS: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"}
"""Environment of a pinned run (the values scripts/run_tiny.sh exports)."""


def has_avx2(cpuinfo: Optional[str] = None) -> bool:
    """True on an x86-64 CPU whose flags include avx2 (from /proc/cpuinfo text; read when not given)."""
    if cpuinfo is None:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return False
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return any(line.startswith("flags") and "avx2" in line.split() for line in cpuinfo.splitlines())


def pinned_env(env: Mapping[str, str], avx2: Optional[bool] = None) -> dict[str, str]:
    """A copy of `env` with PINNED_CPU_KERNELS added where unset (nothing added without AVX2)."""
    out = dict(env)
    if has_avx2() if avx2 is None else avx2:
        for key, value in PINNED_CPU_KERNELS.items():
            out.setdefault(key, value)
    return out


if __name__ == "__main__":  # the exports that apply here; variables the user has set are left out
    for key, value in pinned_env(os.environ).items():
        if key not in os.environ:
            print(f"export {key}={value}")
