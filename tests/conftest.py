"""Shared test helpers: run a script under N gloo processes and collect each rank's JSON result.

Usage from a test:

    from conftest import run_distributed
    results = run_distributed(Path(__file__).with_name("my_worker.py"), nproc=2, args=["--case", "tp2"])
    # results[r] is whatever rank r passed to dist_report.report(...)

A worker script calls `report(obj)` from tests/distributed/dist_report.py (or writes
`{RUN_DISTRIBUTED_RESULT_DIR}/rank{RANK}.json` itself). Ranks are started as torchrun starts them (its
worker variables, env:// rendezvous on a free local port), without its agent process, one CPU thread each.

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


def _hypothesis_profiles() -> None:
    """Hypothesis profiles: `ci` (chosen when CI is set) draws the same examples on every run, so a red CI run repeats
    as it failed; `dev` (elsewhere) draws new ones each run and prints the seed and blob that reproduce a failure.
    HYPOTHESIS_PROFILE picks one explicitly. Per-test @settings (example counts) still apply on top."""
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None)
    settings.register_profile("dev", print_blob=True, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


_hypothesis_profiles()


PORT_RETRIES = 3
"""Launches tried with a fresh rendezvous port when rank 0's store found its port taken (probed free, then bound)."""


def _free_port() -> int:
    from megatron_rl.rollout.processes import free_port

    return free_port()


def _launch_ranks(script: Path, nproc: int, args: Sequence[str], env: dict[str, str], out: Path,
                  timeout: float) -> tuple[int, str, str]:
    """Start `nproc` ranks of `script` as torchrun would start them (its worker variables, env:// rendezvous at
    127.0.0.1, `python -u`), without torchrun's agent process (~2.4 CPU-seconds a launch) and forked from a server with
    torch / megatron-core imported (~4 CPU-seconds a rank; tests/cli_forkserver.py); like torchrun, the first
    rank to fail takes the others down. Returns (exit code: the first failure's, else 0; stdout; stderr)."""
    import cli_forkserver as forked

    # output to files, not pipes: a helper the ranks start (torch_shm_manager, for the tensor transport's shared
    # memory) lives as long as an engine maps its segments and would hold a pipe open after they exit
    stdout, stderr = out / "stdout", out / "stderr"
    try:
        code = forked.run_ranks(nproc, list(map(str, args)), env, stdout, stderr, timeout, port=_free_port(), script=script)
    except TimeoutError:
        raise subprocess.TimeoutExpired([str(script)], timeout, *(p.read_text() for p in (stdout, stderr))) from None
    return code, stdout.read_text(), stderr.read_text()


def run_distributed(
    script_path: str | os.PathLike,
    nproc: int,
    args: Sequence[str] = (),
    timeout: float = 180.0,
    env: Optional[dict[str, str]] = None,
) -> list[Any]:
    """Run `script_path` on `nproc` local processes as torchrun would; return the per-rank JSON results (index = global rank)."""
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
        for attempt in range(PORT_RETRIES):
            try:
                code, stdout, stderr = _launch_ranks(script, nproc, args, child_env, Path(out), timeout)
            except subprocess.TimeoutExpired as exc:
                raise AssertionError(f"{script.name} x{nproc} timed out after {timeout}s\n{(exc.stderr or '')[-4000:]}") from exc
            if code == 0 or "address already in use" not in stderr.lower():
                break
        if code != 0:
            raise AssertionError(
                f"{script.name} x{nproc} {' '.join(map(str, args))} failed (rc={code})\n"
                f"--- stdout ---\n{stdout[-3000:]}\n--- stderr ---\n{stderr[-6000:]}"
            )
        results = []
        for rank in range(nproc):
            path = Path(out) / f"rank{rank}.json"
            if not path.exists():
                raise AssertionError(f"rank {rank} of {script.name} reported no result\n{stderr[-4000:]}")
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


# The longest test files, longest first (seconds of test time summed per file in a full 3-worker run on 2 cores,
# load ~10 from the suite itself, 2026-12-03). pytest-xdist's --dist loadfile hands files out in collection order, so
# collected alphabetically the longest files could start last and leave one worker running alone for minutes while
# the other core idles; started first, the short files fill the gaps at the end. Files the warm start builds for
# (rl_runs.warm_start) are interleaved with files that do not need it, so workers do not all wait on its lock.
LONGEST_FILES_FIRST = (
    "tests/gpu/test_run_all.py",                          # 208 s, no warm start
    "tests/distributed/test_loop_parallel.py",            # 372 s
    "tests/distributed/test_checkpoint_reshard.py",       # 167 s, no warm start
    "tests/test_kv_scales_run.py",                        # 216 s
    "tests/test_study.py",                                # 149 s
    "tests/test_resume.py",                               # 139 s
    "tests/distributed/test_learner_parallel.py",         # 135 s
    "tests/test_hp_measure.py",                           # 122 s
    "tests/test_save_kill_drill.py",                      # 116 s
    "tests/distributed/test_colocated_tensor_sync.py",    # 109 s
    "tests/test_overlap_placement.py",                    # 102 s
    "tests/test_session_standin.py",                      # 102 s
    "tests/test_rollout_config_sweep.py",                 # 75 s
    "tests/distributed/test_weight_sync_parallel.py",     # 67 s
    "tests/distributed/test_health_guard.py",             # 63 s
    "tests/test_port_races.py",                           # 60 s
    "tests/conformance/test_conformance_sglang.py",       # 60 s
    "tests/test_loop.py",                                 # 58 s
    "tests/test_rollout_topology.py",                     # 57 s
    "tests/distributed/test_kv_amax_parallel.py",         # 55 s
)


def pytest_collection_modifyitems(session, config, items) -> None:
    """Run the longest files first (LONGEST_FILES_FIRST), the rest in collection order; order within a file is kept."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    position = {}
    for item in items:
        name = Path(str(item.fspath)).resolve().relative_to(REPO_ROOT).as_posix()
        position[item] = rank.get(name, len(rank))
    items.sort(key=position.__getitem__)  # stable: within a file, and among the other files, pytest's order stays


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
    # the runs' forkserver (tests/cli_forkserver.py) ends with pytest too, but the runs it forked are the tests' own
    forkserver = sys.modules.get("cli_forkserver")
    server = forkserver.server_pid() if forkserver is not None else None
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)
            elif child.pid != server and child.pid not in helpers and child.ppid() not in helpers:
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


CPU_REPORT_FILES = 25
"""How many test files the closing CPU-time table names (the files whose tests cost the most CPU-seconds)."""


def _cpu_seconds() -> float:
    """User + system CPU-seconds of this process and of its children that have ended and been waited for (the
    subprocesses a test runs: trainers, torchrun and its ranks, engines), forked runs included."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    # runs forked by tests/cli_forkserver.py are the server's children, not ours: they report their own CPU-seconds
    forkserver = sys.modules.get("cli_forkserver")
    forked = forkserver.forked_cpu_seconds if forkserver is not None else 0.0
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked


_CPU_START = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    """Note the CPU-seconds used so far when a test's setup starts."""
    item.stash[_CPU_START] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Put each test's CPU-seconds (setup, call and teardown, subprocesses included) into its teardown report."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown" and _CPU_START in item.stash:
        report.user_properties.append(("cpu_s", _cpu_seconds() - item.stash[_CPU_START]))


_CPU_BY_FILE: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    """Sum the CPU-seconds per test file (on the controller, whichever xdist worker ran the test)."""
    if report.when != "teardown":
        return
    cpu = dict(report.user_properties).get("cpu_s")
    if cpu is not None:
        name = report.nodeid.split("::")[0]
        _CPU_BY_FILE[name] = _CPU_BY_FILE.get(name, 0.0) + cpu


def pytest_terminal_summary(terminalreporter) -> None:
    """Close the run with the test files that cost the most CPU: what to trim when the suite is too slow (wall time
    per test, --durations, counts waiting too; this counts work)."""
    if not _CPU_BY_FILE:
        return
    total = sum(_CPU_BY_FILE.values())
    terminalreporter.write_sep("=", f"CPU-seconds per test file (subprocesses included): {total:.0f} in all")
    for name, cpu in sorted(_CPU_BY_FILE.items(), key=lambda kv: -kv[1])[:CPU_REPORT_FILES]:
        terminalreporter.write_line(f"{cpu:8.1f}  {100 * cpu / total:5.1f}%  {name}")
