"""No child of the trainer outlives it: a small watchdog process that reaps the trainer's descendants when it dies.

megatron-core's torch_dist checkpoint writer keeps a process-wide results queue served by a
multiprocessing *spawn* Manager (megatron/core/dist_checkpointing/strategies/filesystem_async.py,
`_get_write_results_queue`), which also starts a multiprocessing resource tracker. Both are shut
down by Python's exit handlers, which a SIGKILLed (or otherwise crashed) trainer never runs, and
neither watches its parent: they stay alive indefinitely. No megatron or torch option avoids the
Manager, and patching upstream is off the table, so the trainer starts this watchdog instead (once
per process, before its first checkpoint write, see `ensure_reaper`):

- it runs in its own session, so a signal to the trainer's process group does not take it down first;
- every `poll_s` it records the trainer's descendants (pid + start time, via psutil);
- once the trainer is gone (its parent pid changes), it SIGKILLs the recorded processes still alive
  (start time checked, so a recycled pid is never hit), giving resource trackers a moment to exit
  by themselves first so they can clean up what they track; then it exits.

A child started less than `poll_s` before the trainer dies can be missed; the checkpoint writer's
Manager lives for the whole run, far longer. Run by hand: python megatron_rl/child_reaper.py PID.
"""
from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from typing import Optional

_REAPER: Optional[subprocess.Popen] = None
POLL_S = 0.5
TRACKER_GRACE_S = 2.0


def ensure_reaper() -> None:
    """Start this process's reaper unless it is already running (cheap to call before every checkpoint write)."""
    global _REAPER
    if _REAPER is not None and _REAPER.poll() is None:
        return
    _REAPER = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid()), str(POLL_S)],
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


def _watch(trainer_pid: int, poll_s: float) -> None:
    """Record the trainer's descendants until it dies, then kill the survivors."""
    import psutil

    me = os.getpid()
    seen: dict[int, float] = {}
    try:
        trainer = psutil.Process(trainer_pid)
    except psutil.NoSuchProcess:
        return
    while os.getppid() == trainer_pid:
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

    def is_tracker(proc) -> bool:
        try:
            return "resource_tracker" in " ".join(proc.cmdline())
        except psutil.Error:
            return False

    trackers = [p for p in survivors if is_tracker(p)]
    for proc in survivors:
        if proc not in trackers:
            try:
                proc.kill()
            except psutil.Error:
                pass
    # a resource tracker exits by itself (cleaning up) once every holder of its pipe is gone
    _, alive = psutil.wait_procs(trackers, timeout=TRACKER_GRACE_S)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    _watch(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else POLL_S)
