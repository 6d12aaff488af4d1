"""`megatron-rl` with a pause point, so a test can SIGKILL a run at a known place (tests/test_resume.py).

    RESUME_HOOK=train:2 RESUME_HOOK_MARKER=/tmp/m python tests/resume_hook.py train CONFIG overrides...

train:N       pauses inside step N's training, after its first mini-batch update changed the weights,
              optimizer and clipper in memory (none of which may leak into the resumed run);
checkpoint:N  pauses inside the checkpoint write after step N, with the shards written to the
              temporary directory but the checkpoint not yet published.
On pausing it writes the marker file {"pid": trainer pid, "engine_pids": [...], "children": [[pid, cmdline], ...]}
(every descendant of the trainer at that moment) and sleeps.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

_engine_pids: list[int] = []


def _pause() -> None:
    """Report where we are, then wait to be killed."""
    marker = Path(os.environ["RESUME_HOOK_MARKER"])
    tmp = marker.with_suffix(".partial")
    import psutil

    children = []
    for child in psutil.Process().children(recursive=True):
        try:
            children.append([child.pid, " ".join(child.cmdline())])
        except psutil.Error:
            pass
    tmp.write_text(json.dumps({"pid": os.getpid(), "engine_pids": _engine_pids, "children": children}))
    tmp.replace(marker)
    time.sleep(3600)


def install(spec: str) -> None:
    """Patch the pause point named by `spec` ('train:N' or 'checkpoint:N')."""
    import megatron_rl.loop as loop
    import megatron_rl.trainer.checkpoint as ckpt

    where, _, step_text = spec.partition(":")
    step = int(step_text)
    run_train = loop.train_on_batch

    def train_on_batch(session, batch, s, timers):
        """Remember the engines' pids; on step `step` pause before the second mini-batch update."""
        if session.cluster is not None:
            _engine_pids[:] = [e.proc.pid for e in session.cluster.engines]
        if where != "train" or s != step:
            return run_train(session, batch, s, timers)
        learner = session.learner
        original, calls = learner.train_step, [0]

        def train_step(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:
                _pause()
            return original(*args, **kwargs)

        learner.train_step = train_step
        try:
            return run_train(session, batch, s, timers)
        finally:
            learner.train_step = original

    loop.train_on_batch = train_on_batch
    if where == "checkpoint":
        publish = ckpt._publish

        def _publish(tmp, final, meta, rl_state):
            if meta["step"] == step:
                _pause()
            return publish(tmp, final, meta, rl_state)

        ckpt._publish = _publish
    elif where != "train":
        raise SystemExit(f"RESUME_HOOK={spec!r}: expected train:N or checkpoint:N")


if __name__ == "__main__":
    install(os.environ["RESUME_HOOK"])
    from megatron_rl.cli import main

    sys.exit(main(sys.argv[1:]))
