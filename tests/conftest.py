"""Shared test helpers: run a script under N gloo processes and collect each rank's JSON result.

Usage from a test:

    from conftest import run_distributed
    results = run_distributed(Path(__file__).with_name("my_worker.py"), nproc=2, args=["--case", "tp2"])
    # results[r] is whatever rank r passed to dist_report.report(...)

A worker script calls `report(obj)` from tests/distributed/dist_report.py (or writes
`{RUN_DISTRIBUTED_RESULT_DIR}/rank{RANK}.json` itself). Processes are started with
`python -m torch.distributed.run --standalone`, one CPU thread each.

At the end of the run, a test session that leaves a process behind fails, naming it (`pytest_sessionfinish`):
pytest makes itself the subreaper of its descendants (Linux), so a grandchild orphaned by a killed parent
(a SIGKILLed trainer's checkpoint writer, say) is still found among its children.
"""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

RESULT_DIR_ENV = "RUN_DISTRIBUTED_RESULT_DIR"


def run_distributed(
    script_path: str | os.PathLike,
    nproc: int,
    args: Sequence[str] = (),
    timeout: float = 180.0,
    env: Optional[dict[str, str]] = None,
) -> list[Any]:
    """Run `script_path` on `nproc` local processes via torchrun; return the per-rank JSON results (index = global rank)."""
    script = Path(script_path)
    if not script.exists():
        raise FileNotFoundError(script)
    with tempfile.TemporaryDirectory(prefix="run_distributed_") as out:
        child_env = dict(os.environ)
        child_env.update(env or {})
        child_env[RESULT_DIR_ENV] = out
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), str(script.parent), child_env.get("PYTHONPATH", "")) if p
        )
        child_env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(script), *map(str, args),
        ]
        # output to files, not pipes: a helper the ranks start (torch_shm_manager, for the tensor transport's shared
        # memory) lives as long as an engine maps its segments and would hold a pipe open after the ranks exit
        with open(Path(out) / "stdout", "w+") as stdout, open(Path(out) / "stderr", "w+") as stderr:
            try:
                proc = subprocess.run(cmd, env=child_env, stdout=stdout, stderr=stderr, text=True, timeout=timeout)
            except subprocess.TimeoutExpired as exc:
                stderr.seek(0)
                raise AssertionError(f"{script.name} x{nproc} timed out after {timeout}s\n{stderr.read()[-4000:]}") from exc
            stdout.seek(0)
            stderr.seek(0)
            proc.stdout, proc.stderr = stdout.read(), stderr.read()
        if proc.returncode != 0:
            raise AssertionError(
                f"{script.name} x{nproc} {' '.join(map(str, args))} failed (rc={proc.returncode})\n"
                f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
            )
        results = []
        for rank in range(nproc):
            path = Path(out) / f"rank{rank}.json"
            if not path.exists():
                raise AssertionError(f"rank {rank} of {script.name} reported no result\n{proc.stderr[-4000:]}")
            results.append(json.loads(path.read_text()))
        return results


def run_distributed_cases(script_path: str | os.PathLike, nproc: int, cases: Sequence[Sequence[str]], spec: Path,
                          timeout: float = 600.0) -> list[list[Any]]:
    """Run every case (a worker argument list) in one `nproc`-process launch of a worker whose main is
    dist_report.report_cases (the case list goes to `spec` as JSON); returns each case's per-rank reports."""
    spec.write_text(json.dumps([list(map(str, args)) for args in cases]))
    reports = run_distributed(script_path, nproc, ["--cases", str(spec)], timeout=timeout)
    return [[rank[i] for rank in reports] for i in range(len(cases))]


@pytest.fixture
def distributed_runner():
    """The `run_distributed` function, as a fixture."""
    return run_distributed


LEFTOVER_GRACE_S = 5.0
"""How long processes still exiting at the end of the run get before they count as left behind."""


def pytest_configure(config) -> None:
    """Become the child subreaper (Linux), so orphaned descendants are reparented to pytest and found at the end."""
    if sys.platform.startswith("linux"):
        pr_set_child_subreaper = 36
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)


def _helpers_ending_with_pytest() -> set[int]:
    """Pids of this process's own process-wide helpers, which end with it, so are not left behind by a test:
    its multiprocessing resource tracker (exits when pytest closes its pipe), multiprocessing Manager servers
    it started (Python's exit handlers shut them down; megatron-core's checkpoint writer keeps one for the life
    of the process that saved), megatron_rl's child reaper (exits with the process it watches), and torch's
    torch_shm_manager (started by the first shared-memory tensor under the file_system strategy, as the tensor
    weight-sync transport makes; it exits when its last client disconnects, even after a SIGKILL)."""
    import multiprocessing
    from multiprocessing import resource_tracker

    pids = {p.pid for p in multiprocessing.active_children() if "Manager" in p.name}
    tracker = getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)
    if tracker:
        pids.add(tracker)
    try:
        import psutil

        pids.update(c.pid for c in psutil.Process().children() if c.name() == "torch_shm_manager")
    except Exception:  # psutil missing or the helper just exited: nothing to exempt
        pass
    reaper = sys.modules.get("megatron_rl.child_reaper")
    if reaper is not None and hasattr(reaper, "reaper_pid") and reaper.reaper_pid():
        pids.add(reaper.reaper_pid())
    return pids


def _live_children() -> list:
    """Descendants of this process still running, less its own helpers and theirs (zombies are reaped: they exited)."""
    import psutil

    helpers = _helpers_ending_with_pytest()
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)
            elif child.pid not in helpers and child.ppid() not in helpers:
                alive.append(child)
        except (psutil.NoSuchProcess, ChildProcessError):
            pass
    return alive


def _describe(proc) -> str:
    import psutil

    try:
        return f"pid {proc.pid} {proc.name()}: {' '.join(proc.cmdline())[:200]}"
    except psutil.Error:
        return f"pid {proc.pid} (exited)"


@pytest.hookimpl(trylast=True)  # after session-scoped fixtures are torn down (they may own servers)
def pytest_sessionfinish(session, exitstatus) -> None:
    """Fail the run when a test left a process behind: name each one, then kill it."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    left = _live_children()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _live_children()
    if not left:
        return
    lines = [_describe(p) for p in left]
    for proc in left:
        try:
            proc.kill()
        except Exception:
            pass
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = "error: the tests left processes behind (killed now; find the test that started them):\n  " + "\n  ".join(lines)
    if reporter is not None:
        reporter.write_line(message, red=True, bold=True)
    else:
        print(message, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="module", autouse=True)
def _fresh_process_group_per_module():
    """Tear down a world-of-1 process group a module leaves behind (learners built in-process keep one), so the next
    module starts without one whichever pytest-xdist worker runs it. Autouse fixtures are set up first, so this one
    is torn down after the module's own fixtures."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from megatron_rl.parallel import state

        state.destroy_distributed()
        if dist.is_initialized():  # created outside parallel/state (a test's own init_process_group)
            dist.destroy_process_group()
