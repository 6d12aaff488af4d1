"""The pinned upstream packages of the conformance tier, installed once into a cache of their own.

    python tests/conformance/conformance_packages.py      # fill the cache (prints where, and how long it took)

Pins: constraints/conformance.txt (sglang and the few packages its CPU-importable modules need; transformer-engine,
read as text). SGLang goes into `<cache>/sglang-<version>-<key>` with `pip install --no-deps --target` (its GPU
dependencies, its own torch among them, never come in; the trainer's torch and pydantic are used beside it) and is
imported only by a subprocess that puts that directory first on sys.path (tests/conformance/sglang_probe.py), so
the trainer's environment never sees it. transformer-engine's pure-Python wheel is unpacked, not installed, into
`<cache>/transformer-engine-<version>` and read with ast. `<key>` hashes the pins and the Python version, so a pin
change makes a new directory and an unchanged one is reused as it is.

The cache lives outside the checkout so fresh clones (CI) reuse it: $MEGATRON_RL_CONFORMANCE_CACHE, else
$XDG_CACHE_HOME/megatron_rl/conformance (default ~/.cache/...). Downloads go through pip, which reuses its own
wheel cache when present; without network and without a filled cache the setup fails with one message saying so.
Concurrent test workers wait on a file lock; a half-written directory is never used (written aside, then renamed).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PINS_FILE = ROOT / "constraints" / "conformance.txt"
SGLANG_SET = ("sglang", "pybase64", "triton", "msgspec", "pyzmq", "ipython", "traitlets")
"""What goes into the SGLang directory."""
COMPLETE = ".complete"


class ConformanceSetupError(RuntimeError):
    """The pinned packages could not be installed (offline, or a pin that does not exist)."""


def pins() -> dict[str, str]:
    """name -> version of constraints/conformance.txt."""
    out = {}
    for line in PINS_FILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


def trainer_pin(name: str) -> str:
    """The version constraints/cpu.txt pins for `name` (sglang-router, megatron-core: the trainer's own packages)."""
    for line in (ROOT / "constraints" / "cpu.txt").read_text().splitlines():
        if line.lower().startswith(name.lower() + "=="):
            return line.split("==", 1)[1].strip()
    raise KeyError(name)


def cache_root() -> Path:
    """Where the installed packages live (outside the checkout; see the module docstring)."""
    if os.environ.get("MEGATRON_RL_CONFORMANCE_CACHE"):
        return Path(os.environ["MEGATRON_RL_CONFORMANCE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron_rl" / "conformance"


def _key(names) -> str:
    p = pins()
    text = ";".join(f"{n}=={p[n]}" for n in sorted(names)) + f";py{sys.version_info[0]}{sys.version_info[1]}"
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _pip(args: list[str], what: str, target: Path) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--timeout", "20", "--retries", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(ln for ln in (proc.stdout + proc.stderr).splitlines() if "is ignored" not in ln)[-1500:]
        offline = any(s in tail for s in ("NewConnectionError", "Temporary failure in name resolution",
                                          "No matching distribution", "Network is unreachable", "ConnectionError"))
        raise ConformanceSetupError(
            f"conformance setup: cannot {what} into {target}"
            + (" (no network? the conformance tier downloads its pinned packages from PyPI once, then reuses "
               f"{cache_root()}; fill it on a machine with network: python tests/conformance/conformance_packages.py)"
               if offline else "") + f"\n{tail}")


def _filled(target: Path, fill) -> Path:
    """`target`, filled by `fill(tmp_dir)` once (under a lock, written aside and renamed)."""
    from filelock import FileLock

    if (target / COMPLETE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / COMPLETE).exists():
            return target
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            fill(tmp)
            (tmp / COMPLETE).write_text(PINS_FILE.read_text())
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def sglang_site() -> Path:
    """Directory holding sglang and the packages its CPU-importable modules need (installed on first use)."""
    p = pins()
    target = cache_root() / f"sglang-{p['sglang']}-{_key(SGLANG_SET)}"
    specs = [f"{n}=={p[n]}" for n in SGLANG_SET]
    return _filled(target, lambda tmp: _pip(["install", "-q", "--no-deps", "--no-compile", "--only-binary=:all:",
                                             "--target", str(tmp), *specs], f"install {' '.join(specs)}", target))


def te_source() -> Path:
    """Directory holding transformer-engine's Python sources (the pure-Python wheel, unpacked; never imported)."""
    version = pins()["transformer-engine"]
    target = cache_root() / f"transformer-engine-{version}-{_key(['transformer-engine'])}"

    def fill(tmp: Path) -> None:
        wheels = tmp / "wheels"
        _pip(["download", "-q", "--no-deps", "--only-binary=:all:", "--dest", str(wheels),
              f"transformer-engine=={version}"], f"download transformer-engine=={version}", target)
        for wheel in wheels.glob("transformer_engine-*.whl"):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(tmp)
        shutil.rmtree(wheels)
        if not (tmp / "transformer_engine" / "common" / "recipe" / "__init__.py").exists():
            raise ConformanceSetupError(f"transformer-engine=={version}: its wheel holds no transformer_engine/common/recipe")

    return _filled(target, fill)


def main() -> int:
    """Fill the cache; print the directories and the time taken."""
    t0 = time.perf_counter()
    try:
        paths = [sglang_site(), te_source()]
    except ConformanceSetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    print(f"{time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
