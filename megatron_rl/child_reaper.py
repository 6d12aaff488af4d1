"""No child of the trainer outlives it, however the trainer dies: forked children die with it, and a small
watchdog process reaps the others.

Two kinds of children appear while the trainer saves a checkpoint (megatron-core's torch_dist writer,
megatron/core/dist_checkpointing/strategies/filesystem_async.py):

- forked writers: every save forks its shard writers (`write_preloaded_data_multiproc`, fork context),
  which live for the save only. One forked just before a SIGKILL of the trainer used to stay alive for
  good, blocked on a queue or lock the dead trainer held. `install_fork_guard` registers an at-fork
  hook: a child forked from the main thread of a guarded process arms PR_SET_PDEATHSIG(SIGKILL) first
  thing and kills itself if the parent is already gone (so there is no window between fork and prctl);
  nested forks inherit the hook. (The kernel signals when the *thread* that forked exits, hence
  main-thread forks only; children forked from other threads are left to the watchdog's sampling.)
- spawned helpers: a process-wide results queue served by a multiprocessing *spawn* Manager
  (`_get_write_results_queue`) and its resource tracker. They are exec'd (no at-fork hook runs in
  them), are shut down by Python's exit handlers, which a SIGKILLed trainer never runs, and do not
  watch their parent. No megatron or torch option avoids them and patching upstream is off the table.

So the trainer starts a watchdog (`ensure_reaper`, before its first checkpoint write), after putting a
mark unique to itself into its environment (`TRAINER_MARK_ENV` = pid:start time), which every process
it execs from then on inherits, whenever it starts and whoever started it:

- the watchdog runs in its own session, so a signal to the trainer's process group does not take it
  down first; every `poll_s` it records the trainer's descendants (pid + start time, via psutil);
- once the trainer is gone (its parent pid changes, or it died before the watchdog started), it SIGKILLs
  the recorded processes still alive (start time checked, so a recycled pid is never hit) and every
  process whose environment carries the trainer's mark (found even when it started an instant before
  the trainer died and was never sampled; looked for again for RESCANS x RESCAN_S, as a helper being
  spawned carries the mark only once exec'd), giving resource trackers a moment to exit by themselves
  first so they can clean up what they track; then it exits.

Run by hand: python -P megatron_rl/child_reaper.py PID [POLL_S [MARK]].
"""
from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

_REAPER: Optional[subprocess.Popen] = None
POLL_S = 0.5
TRACKER_GRACE_S = 2.0
RESCANS, RESCAN_S = 10, 0.2
PR_SET_PDEATHSIG = 1
TRAINER_MARK_ENV = "MEGATRON_RL_TRAINER_MARK"
"""Environment variable marking the processes a guarded trainer execs (value: its pid:start time)."""
_FORK = {"installed": False, "parent": 0, "main_thread": False, "libc": None}


# ---------------------------------------------------------------------------- forked children
def install_fork_guard() -> None:
    """From now on, a child forked from this process's main thread dies with this process (idempotent; Linux only)."""
    if _FORK["installed"] or not sys.platform.startswith("linux"):
        return
    _FORK["libc"] = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: the child only calls into it
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _FORK["installed"] = True


def _before_fork() -> None:
    """Parent, just before fork: remember who forks, and from which thread."""
    _FORK["parent"] = os.getpid()
    _FORK["main_thread"] = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    """Child, right after fork: SIGKILL when the parent dies; if it already died, now."""
    if not _FORK["main_thread"]:
        return
    _FORK["libc"].prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != _FORK["parent"]:  # the parent died between fork and prctl: nobody would signal us
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------- the watchdog
def trainer_mark(pid: Optional[int] = None) -> str:
    """The environment mark of the processes `pid` (default: this process) execs once guarded: 'pid:start time'."""
    import psutil

    proc = psutil.Process(pid)
    return f"{proc.pid}:{proc.create_time()!r}"


def watchdog_command(pid: int, poll_s: float, mark: str) -> list[str]:
    """argv of the watchdog of trainer `pid`: this file as a script under this interpreter."""
    # -P: not the script's directory first on sys.path, where megatron_rl/types.py would shadow the standard library's
    # `types` (ctypes imports it) in an interpreter whose site hooks have not imported it already (a venv without
    # setuptools' .pth files): the watchdog then died on start, silently
    return [sys.executable, "-P", os.path.abspath(__file__), str(pid), str(poll_s), mark]


def ensure_reaper() -> None:
    """Guard this process's forks, mark what it execs and start its watchdog, unless running (cheap before every checkpoint write)."""
    global _REAPER
    install_fork_guard()
    if _REAPER is not None and _REAPER.poll() is None:
        return
    mark = trainer_mark()
    os.environ[TRAINER_MARK_ENV] = mark  # before anything is spawned: the watchdog finds all of it by this mark
    _REAPER = subprocess.Popen(watchdog_command(os.getpid(), POLL_S, mark),
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    # on a normal exit Python's own handlers stop megatron's Manager: the watchdog is not needed then
    atexit.unregister(stop_reaper)
    atexit.register(stop_reaper)


def stop_reaper() -> None:
    """Stop this process's reaper (e.g. before a check for leftover child processes); a later save starts a new one."""
    global _REAPER
    if _REAPER is not None and _REAPER.poll() is None:
        _REAPER.terminate()
        try:
            _REAPER.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _REAPER.kill()
            _REAPER.wait()
    _REAPER = None


def reaper_pid() -> Optional[int]:
    """Pid of this process's running reaper (None when none runs)."""
    return _REAPER.pid if _REAPER is not None and _REAPER.poll() is None else None


def marked_processes(mark: str) -> list:
    """Live processes (psutil) whose environment carries `mark` (this process excepted)."""
    import psutil

    out = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(TRAINER_MARK_ENV) == mark:
                out.append(proc)
        except psutil.Error:  # exited, a zombie, or another user's
            continue
    return out


def _watch(trainer_pid: int, poll_s: float, mark: Optional[str] = None) -> None:
    """Record the trainer's descendants until it dies, then kill the survivors and every process carrying `mark`."""
    import psutil

    me = os.getpid()
    seen: dict[int, float] = {}
    try:
        trainer = psutil.Process(trainer_pid)
    except psutil.NoSuchProcess:  # it died before this watchdog got here: only its mark finds what it started
        trainer = None
    while trainer is not None and os.getppid() == trainer_pid:
        try:
            for child in trainer.children(recursive=True):
                if child.pid != me and child.pid not in seen:
                    seen[child.pid] = child.create_time()
        except psutil.Error:  # the trainer died during the scan
            break
        time.sleep(poll_s)
    survivors = []
    for pid, started in seen.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started:
                survivors.append(proc)
        except psutil.Error:
            continue
    _kill(survivors + (marked_processes(mark) if mark else []))
    # a helper the trainer was spawning as it died carries the mark only once exec'd: look again for a while
    for _ in range(RESCANS if mark else 0):
        time.sleep(RESCAN_S)
        _kill(marked_processes(mark))


def _kill(procs: list) -> None:
    """SIGKILL `procs`, giving multiprocessing resource trackers TRACKER_GRACE_S to exit by themselves first
    (one exits, cleaning up what it tracks, once every holder of its pipe is gone)."""
    import psutil

    def is_tracker(proc) -> bool:
        try:
            return "resource_tracker" in " ".join(proc.cmdline())
        except psutil.Error:
            return False

    trackers = [p for p in procs if is_tracker(p)]
    for proc in procs:
        if proc not in trackers:
            try:
                proc.kill()
            except psutil.Error:
                pass
    _, alive = psutil.wait_procs(trackers, timeout=TRACKER_GRACE_S)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    _watch(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else POLL_S, sys.argv[3] if len(sys.argv) > 3 else None)
