"""`megatron-rl` runs of the end-to-end tests, forked from a server that has the trainer's modules imported.

    proc = run_cli(["train", CONFIG, "run_dir=...", ...], env=cli_env(), stdout=OUT_PATH, stderr=ERR_PATH, timeout=600)

Why: a tiny run's trainer spends ~5 of its ~7 CPU-seconds importing torch, megatron-core, transformers and
this package (measured on the 2-core CI box), and the suite starts ~50 of them, which made process start-up
the largest single cost of `.ci/run`. The standard library's forkserver (`multiprocessing`, start method
"forkserver") imports those modules once per pytest worker (`set_forkserver_preload`) and forks one child per
run; the child runs `megatron_rl.cli` as `python -m megatron_rl.cli` does (runpy, as `__main__`, with the
run's argv, environment and stdout / stderr files) and exits as an interpreter would (non-daemon threads
joined, atexit handlers run, streams flushed). Everything after the imports is the run's own: a fresh
torch.distributed state, its own engine subprocesses (started from `sys.executable` as always), its own
checkpoint writers.

What a fork does not exercise is the import itself (import-time warnings, the jit-fuser hook's order): the runs
that check those, runs under torchrun and the runs that are killed or inspected as process trees still start
fresh interpreters (`subprocess`), e.g. tests/test_loop.py, tests/test_resume.py, tests/test_save_kill_drill.py.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import resource
import runpy
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

PRELOAD = (
    "megatron_rl",  # first: its import hook must see megatron.core's import (megatron_rl/jit_fuser_hook.py)
    "forkserver_preload",  # then the CLI's warning filters, as megatron_rl.cli.main sets them before its imports
    "megatron_rl.loop", "megatron_rl.runtime", "megatron_rl.trainer.learner",
    "megatron_rl.trainer.checkpoint", "megatron.core.dist_checkpointing", "megatron.core.optimizer",
    "transformers.models.auto.tokenization_auto", "torch._dynamo",
)
"""Modules every trainer imports (the heavy ones: ~5 CPU-s in a fresh process); the rest it imports itself."""


forked_cpu_seconds = 0.0
"""CPU-seconds of the runs forked so far, their waited-for children included (tests/conftest.py's per-file table)."""


@dataclass
class CliResult:
    """Exit status of one run (as subprocess.CompletedProcess's returncode)."""

    returncode: int


def _context(env: Mapping[str, str]):
    """The forkserver context, its server started (once per process) with the runs' environment: torch reads
    OMP_NUM_THREADS when the server imports it."""
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    saved = dict(os.environ)
    try:
        os.environ.update({k: env[k] for k in ("OMP_NUM_THREADS", "PYTHONPATH") if k in env})
        # the server imports PRELOAD before it takes the caller's sys.path: tests/ (forkserver_preload) goes in here
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")) if p)
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return ctx


def _child(argv: Sequence[str], env: Mapping[str, str], stdout_path: str, stderr_path: str, cpu_path: str) -> None:
    """Body of the forked child: the CLI as `python -m megatron_rl.cli ARGV` runs it, then an interpreter's exit."""
    for path, fd in ((stdout_path, 1), (stderr_path, 2)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["megatron_rl.cli", *argv]  # runpy puts the module's path at argv[0], as `-m` does
    # `-m` runs the module as __main__ without importing it under its own name first (a preloaded copy would make
    # runpy warn, and differ from a fresh run); whatever imports megatron_rl.cli later gets its own copy, as then
    sys.modules.pop("megatron_rl.cli", None)
    code = 0
    try:
        runpy.run_module("megatron_rl.cli", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # an uncaught exception: traceback and exit 1, as the interpreter does
        import traceback

        traceback.print_exc()
        code = 1
    # the interpreter's own exit sequence (multiprocessing's would skip atexit): threads, atexit, streams
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    # this process and the children it waited for (engines, checkpoint writers): the caller's CPU accounting
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    Path(cpu_path).write_text(repr(own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime))
    os._exit(code)


def run_cli(argv: Sequence[str], env: Mapping[str, str], stdout: Path, stderr: Path, timeout: float) -> CliResult:
    """Run `megatron-rl ARGV` in a child forked from the preloaded server, its output appended to the files `stdout` and
    `stderr`; TimeoutError (after killing it) past `timeout`."""
    global forked_cpu_seconds
    cpu_path = Path(f"{stdout}.cpu_s")
    proc = _context(env).Process(target=_child, args=(list(argv), dict(env), str(stdout), str(stderr), str(cpu_path)))
    proc.start()
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise TimeoutError(f"megatron-rl {' '.join(argv[:2])} still running after {timeout} s (killed)")
    if cpu_path.exists():
        forked_cpu_seconds += float(cpu_path.read_text())
        cpu_path.unlink()
    return CliResult(proc.exitcode)


def server_pid():
    """Pid of this process's forkserver (None before the first run): a helper that ends with this process."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)
