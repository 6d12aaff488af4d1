"""Kill drill of checkpoint saves (tests/test_save_kill_drill.py): a trainer is SIGKILLed at many points of a save;
no process it started may survive, and the next trainer resumes from the newest checkpoint.

    python tests/save_kill_drill.py CKPT_ROOT   # prints one JSON line: {"trials": [...]}

This process imports torch / megatron once and forks one trainer per kill point from its main thread (a kill
costs a fork, not an interpreter start). It is the child subreaper of everything below it, so whatever a
killed trainer leaves behind, forked or spawned, is reparented here: after each kill it waits until it has
no descendant left (reaping them), or reports and kills the ones still alive after SETTLE_S.

A trainer builds a tiny learner, loads the newest complete checkpoint under CKPT_ROOT (checking that its
weights are those saved at its step: base + step), then saves step after step (weights base + step) until
its kill point fires. A kill point is an event of the save (KILL_POINTS) in the trainer's first save (which
starts the watchdog and megatron's writer helpers) or its second, plus a delay: the trainer SIGKILLs
itself that long after the event (at once in the event's hook for 0), as an outside kill would land there.
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import sys
import threading
import time

PR_SET_CHILD_SUBREAPER = 36
SETTLE_S = 30.0
KILL_POINTS = [  # (event, save of this trainer: 0 first / 1 second, delay in ms)
    ("begin", 0, 0),        # before the save
    ("watchdog", 0, 0),     # the watchdog just started
    ("manager", 0, 0),      # megatron's spawn Manager just started (not yet seen by the watchdog's sampling)
    ("manager", 0, 30),
    ("fork", 0, 0),         # a shard writer just forked (its parent-death signal maybe not armed yet)
    ("fork", 0, 10),
    ("fork", 1, 0),
    ("fork", 1, 3),
    ("fork", 1, 30),        # mid-write
    ("publish", 1, 0),      # shards written, checkpoint not yet complete
    ("retention", 1, 0),    # checkpoint renamed into place, older ones not yet removed
    ("stuck_child", 0, 0),  # a forked child that would block for ever (as the writer did), then the kill
]
PUBLISHED = ("retention",)
"""Events after which the save's checkpoint is complete (resume starts from it)."""


def _learner():
    import torch

    from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig
    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.trainer.learner import Learner

    torch.set_num_threads(1)
    return Learner(ModelConfig(preset="tiny"), ParallelConfig(), OptimConfig(), PrecisionConfig(), vocab_size=64, seed=3)


def _die(delay_ms: int) -> None:
    """SIGKILL this process now (0) or `delay_ms` from now (a timer thread: the save goes on meanwhile)."""
    if delay_ms == 0:
        os.kill(os.getpid(), signal.SIGKILL)

    def later() -> None:
        time.sleep(delay_ms / 1000)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=later, daemon=True).start()


def _arm(event: str, save: int, delay_ms: int, current_save: list) -> None:
    """Install the hook that kills this trainer at `event` of its save number `save`."""
    import multiprocessing.managers

    from megatron_rl import child_reaper
    from megatron_rl.trainer import checkpoint as ckpt

    def fire() -> None:
        if current_save[0] == save:
            _die(delay_ms)

    def after(module, name: str) -> None:
        original = getattr(module, name)

        def wrapped(*args, **kwargs):
            out = original(*args, **kwargs)
            fire()
            return out

        setattr(module, name, wrapped)

    def before(module, name: str) -> None:
        original = getattr(module, name)

        def wrapped(*args, **kwargs):
            fire()
            return original(*args, **kwargs)

        setattr(module, name, wrapped)

    if event == "watchdog":
        after(child_reaper, "ensure_reaper")
    elif event == "manager":
        after(multiprocessing.managers.BaseManager, "start")
    elif event == "fork":
        os.register_at_fork(after_in_parent=fire)
    elif event == "publish":
        before(ckpt, "_publish")
    elif event == "retention":
        before(ckpt, "apply_retention")


def trainer(root: str, out: int, kill_point) -> None:
    """Resume from the newest checkpoint (checking its weights), then save until the kill point fires."""
    from megatron_rl.trainer import checkpoint as ckpt

    os.setpgid(0, 0)

    def say(*words) -> None:
        os.write(out, (" ".join(map(str, words)) + "\n").encode())

    learner = _learner()
    base = {k: v.clone() for k, v in learner.gather_full_state_dict().items()}
    start = 0
    latest = ckpt.latest_checkpoint(root)
    if latest is not None:
        step = int(ckpt.load_checkpoint(learner, latest)["step"])
        loaded = learner.gather_full_state_dict()
        same = all(bool((loaded[k] == base[k] + float(step)).all()) for k in base)
        say("resumed", step, int(same))
        start = step + 1
    else:
        say("fresh")
    if kill_point is None:
        return
    event, save, delay_ms = kill_point
    if event == "stuck_child":
        import multiprocessing

        from megatron_rl.child_reaper import ensure_reaper

        ensure_reaper()
        multiprocessing.get_context("fork").Process(target=time.sleep, args=(3600,)).start()
        _die(0)
    current_save = [-1]
    _arm(event, save, delay_ms, current_save)
    for k, step in enumerate(range(start, start + 100)):
        current_save[0] = k
        learner.load_full_state_dict({name: v + float(step) for name, v in base.items()})
        say("begin", step)
        if event == "begin" and k == save:
            _die(delay_ms)
        ckpt.save_checkpoint(learner, root, step, {"step": step}, keep_last=2)
        say("end", step)
    raise AssertionError(f"kill point {kill_point} never fired")


class Trainer:
    """One forked trainer and the lines it announced."""

    def __init__(self, root: str, kill_point) -> None:
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(r)
            code = 0
            try:
                trainer(root, w, kill_point)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        os.close(w)
        self.fd, self.lines = r, []

    def finish(self, timeout: float = 300.0) -> int:
        """Read what the trainer says until it ends (not until the pipe closes: a child it leaves may hold the pipe);
        its wait status."""
        buffer, deadline, status, open_ = b"", time.monotonic() + timeout, None, True
        while status is None:
            if open_ and select.select([self.fd], [], [], 0.05)[0]:
                data = os.read(self.fd, 1 << 16)
                buffer, open_ = buffer + data, bool(data)
            elif not open_:
                time.sleep(0.05)
            pid, wait_status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                status = wait_status
            elif time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
        while open_ and select.select([self.fd], [], [], 0)[0]:  # what it said just before it died
            data = os.read(self.fd, 1 << 16)
            buffer, open_ = buffer + data, bool(data)
        os.close(self.fd)
        self.lines = [line for line in buffer.decode().splitlines() if line.strip()]
        return status


def settle() -> list[str]:
    """Reap descendants until none is left (SETTLE_S at most); the ones still alive then are named and killed."""
    import psutil

    deadline = time.monotonic() + SETTLE_S
    me = psutil.Process()
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return []  # no child left at all
        if time.monotonic() > deadline:
            names = []
            for p in me.children(recursive=True):
                try:
                    names.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[:160]}")
                    p.kill()
                except psutil.Error:
                    pass
            settle()
            return names
        time.sleep(0.05)


def main() -> None:
    root = sys.argv[1]
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    import megatron_rl.trainer.checkpoint  # noqa: F401  (torch, megatron: imported once, before the forks)
    import psutil  # noqa: F401

    trials = []
    for kill_point in [*KILL_POINTS, None]:  # None: the last trainer only resumes
        t = Trainer(root, kill_point)
        status = t.finish()
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        trials.append({"kill_point": kill_point, "killed": killed, "exit": status, "said": t.lines, "left": settle()})
    print(json.dumps({"trials": trials, "published": PUBLISHED}), flush=True)


if __name__ == "__main__":
    main()
