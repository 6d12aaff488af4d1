"""`megatron-rl` runs and distributed worker ranks of the tests, forked from a server that has their modules imported.

    proc = run_cli(["train", CONFIG, "run_dir=...", ...], env=cli_env(), stdout=OUT_PATH, stderr=ERR_PATH, timeout=600)
    rank = start(["--cases", SPEC], env, OUT_PATH, ERR_PATH, script=WORKER_PY)   # Popen-like: poll(), kill(), wait()

Why: a tiny run's trainer spends ~5 of its ~7 CPU-seconds importing torch, megatron-core, transformers and
this package (measured on the 2-core CI box), and the suite starts ~50 of them, which made process start-up
the largest single cost of `.ci/run`. The standard library's forkserver (`multiprocessing`, start method
"forkserver") imports those modules once per pytest worker (`set_forkserver_preload`) and forks one child per
run; the child runs `megatron_rl.cli` as `python -u -m megatron_rl.cli` does, or a worker script as `python -u
SCRIPT` does (runpy, as `__main__`, with the run's argv, environment and stdout / stderr files, unbuffered), and
exits as an interpreter would (non-daemon threads joined, atexit handlers run, streams flushed). The distributed
tests' ranks (tests/conftest.py: run_distributed) start the same way, ~4 CPU-s of imports saved per rank. Everything
after the imports is the run's own: a fresh torch.distributed state, its own engine subprocesses (started from
`sys.executable` as always), its own checkpoint writers.

What a fork does not exercise is the import itself (import-time warnings, the jit-fuser hook's order): the runs
that check those, runs under torchrun and the runs that are killed or inspected as process trees still start
fresh interpreters (`subprocess`), e.g. tests/test_loop.py, tests/test_resume.py, tests/test_save_kill_drill.py.
"""
from __future__ import annotations

import atexit
import io
import itertools
import multiprocessing
import os
import resource
import runpy
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

PRELOAD = (
    "megatron_rl",  # first: its import hook must see megatron.core's import (megatron_rl/jit_fuser_hook.py)
    "forkserver_preload",  # then the CLI's warning filters, as megatron_rl.cli.main sets them before its imports
    "megatron_rl.loop", "megatron_rl.runtime", "megatron_rl.trainer.learner",
    "megatron_rl.trainer.checkpoint", "megatron.core.dist_checkpointing", "megatron.core.optimizer",
    "transformers.models.auto.tokenization_auto", "torch._dynamo",
)
"""Modules every trainer and most worker ranks import (the heavy ones: ~5 CPU-s in a fresh process); a child imports
the rest itself. (The forkserver skips a preload that fails to import: tests/test_cli_forkserver.py imports each.)"""


_serial = itertools.count()

forked_cpu_seconds = 0.0
"""CPU-seconds of the children ended so far, their waited-for children included (tests/conftest.py's per-file table)."""


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


def _child(module: Optional[str], script: Optional[str], argv: Sequence[str], env: Mapping[str, str], stdout_path: str,
           stderr_path: str, cpu_path: str) -> None:
    """Body of the forked child: `python -u -m MODULE ARGV` or `python -u SCRIPT ARGV`, then an interpreter's exit."""
    for path, fd in ((stdout_path, 1), (stderr_path, 2)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    # -u: every write reaches the file at once (a rank killed because another failed keeps what it printed)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    code = 0
    try:
        if module is not None:
            sys.argv = [module, *argv]  # runpy puts the module's path at argv[0], as `-m` does
            # `-m` runs the module as __main__ without importing it under its own name first (a preloaded copy would
            # make runpy warn, and differ from a fresh run); whatever imports it later gets its own copy, as then
            sys.modules.pop(module, None)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *argv]
            sys.path.insert(0, str(Path(script).parent))  # as python puts a script's directory first
            runpy.run_path(script, run_name="__main__")
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


class Forked:
    """A started child (as subprocess.Popen: poll, wait, kill, returncode; negative: killed by that signal)."""

    def __init__(self, process, cpu_path: Path, what: str) -> None:
        self.process, self.cpu_path, self.what = process, cpu_path, what

    @property
    def returncode(self) -> Optional[int]:
        """Exit status, None while running."""
        return self.process.exitcode

    def poll(self) -> Optional[int]:
        """Exit status, None while running (its CPU-seconds are counted once it ended)."""
        if self.process.exitcode is not None:
            self._count_cpu()
        return self.process.exitcode

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Wait for the end (at most `timeout` seconds); the exit status, None if still running."""
        self.process.join(timeout)
        return self.poll()

    def kill(self) -> None:
        """SIGKILL it."""
        self.process.kill()

    def _count_cpu(self) -> None:
        global forked_cpu_seconds
        if self.cpu_path.exists():
            forked_cpu_seconds += float(self.cpu_path.read_text())
            self.cpu_path.unlink()


def start(argv: Sequence[str], env: Mapping[str, str], stdout: Path, stderr: Path, module: Optional[str] = None,
          script: Optional[str | os.PathLike] = None) -> Forked:
    """Start `python -u -m MODULE ARGV` (or `python -u SCRIPT ARGV`) as a child forked from the preloaded server, its
    output appended to the files `stdout` and `stderr`."""
    if (module is None) == (script is None):
        raise ValueError("start() takes a module or a script")
    cpu_path = Path(f"{stdout}.{os.getpid()}.{next(_serial)}.cpu_s")
    process = _context(env).Process(target=_child, args=(module, None if script is None else str(script), list(argv),
                                                         dict(env), str(stdout), str(stderr), str(cpu_path)))
    process.start()
    return Forked(process, cpu_path, f"{module or script} {' '.join(map(str, argv[:2]))}")


def run_ranks(nproc: int, argv: Sequence[str], env: Mapping[str, str], stdout: Path, stderr: Path, timeout: float,
              port: int, module: Optional[str] = None, script: Optional[str | os.PathLike] = None) -> int:
    """Run `nproc` forked ranks of MODULE / SCRIPT with torchrun's worker variables (env:// rendezvous at 127.0.0.1:
    `port`), output appended to `stdout` / `stderr`; like torchrun, the first rank to fail takes the others down.
    Returns the first failure's exit status, else 0; TimeoutError (all killed) past `timeout`."""
    for path in (stdout, stderr):
        Path(path).write_text("")
    procs: list[Forked] = []
    code, timed_out = 0, False
    try:
        for rank in range(nproc):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                            GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(start(argv, rank_env, stdout, stderr, module=module, script=script))
        deadline = time.monotonic() + timeout
        while None in [p.poll() for p in procs]:  # a list, not any(): every rank is polled, so a failure is seen
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed:
                code = failed[0]
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
        else:
            code = next((p.returncode for p in procs if p.returncode != 0), 0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if timed_out:
        raise TimeoutError(f"{module or script} x{nproc} still running after {timeout} s (killed)")
    return code


def run_cli(argv: Sequence[str], env: Mapping[str, str], stdout: Path, stderr: Path, timeout: float) -> CliResult:
    """Run `megatron-rl ARGV` in a child forked from the preloaded server, its output appended to the files `stdout` and
    `stderr`; TimeoutError (after killing it) past `timeout`."""
    proc = start(argv, env, stdout, stderr, module="megatron_rl.cli")
    if proc.wait(timeout) is None:
        proc.kill()
        proc.wait()
        raise TimeoutError(f"megatron-rl {' '.join(argv[:2])} still running after {timeout} s (killed)")
    return CliResult(proc.returncode)


def server_pid():
    """Pid of this process's forkserver (None before the first run): a helper that ends with this process."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)
