"""Embedded engines: batch-invariant samples under --enable-deterministic-inference, and exit when the trainer dies."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_rl.rollout.client import RolloutClient
from megatron_rl.engine.testing import ThreadedServer, make_tiny_model

# prompts of different lengths: batched together they are left-padded to the longest one
PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [10], [11, 12, 13], [14, 15, 16, 17, 18], [19, 20]]


def _params(k: int) -> dict:
    return {"max_new_tokens": 8, "n": 3, "temperature": 1.0, "sampling_seed": 1000 + k, "ignore_eos": True}


def test_deterministic_samples_do_not_depend_on_co_batched_requests(tmp_path):
    make_tiny_model(str(tmp_path / "m"), seed=0)
    with ThreadedServer(str(tmp_path / "m"), deterministic=True, batch_window_s=0.05) as srv:
        client = RolloutClient(srv.url, concurrency=len(PROMPTS))
        together = client.generate_batch_sync(PROMPTS, [_params(k) for k in range(len(PROMPTS))])
        assert srv.server.batches_run == len(PROMPTS)  # concurrent requests were never merged
        # reference: each request sent on its own, so nothing else can share its batch
        for k, p in enumerate(PROMPTS):
            alone = client.generate_sync(p, _params(k))
            assert [r.output_ids for r in alone] == [r.output_ids for r in together[k]]
            assert [r.logprobs for r in alone] == [r.logprobs for r in together[k]]  # bitwise


def test_concurrent_requests_are_batched_by_default(tmp_path):
    make_tiny_model(str(tmp_path / "m"), seed=0)
    with ThreadedServer(str(tmp_path / "m"), batch_window_s=0.05) as srv:
        client = RolloutClient(srv.url, concurrency=len(PROMPTS))
        client.generate_batch_sync(PROMPTS, [_params(k) for k in range(len(PROMPTS))])
        assert srv.server.batches_run < len(PROMPTS)


# the parent pid is read before the (slow, under load) import: read after it, a parent killed meanwhile
# would already be replaced by the reaper and the watchdog would watch the wrong process
CHILD = ("import os, time; parent = os.getppid(); from megatron_rl.engine.server import watch_parent; "
         "watch_parent(parent, 0.05); time.sleep(120)")
MIDDLE = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', sys.argv[1]]); "
          "print(p.pid, flush=True); time.sleep(120)")


def _alive(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) process."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_engine_watchdog_exits_when_its_parent_is_sigkilled():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, CHILD], stdout=subprocess.PIPE, text=True, env=env)
    child = int(middle.stdout.readline())
    time.sleep(3.0)  # let the child import and start watching
    assert _alive(child)
    os.kill(middle.pid, signal.SIGKILL)
    middle.wait(timeout=10)
    deadline = time.monotonic() + 30
    while _alive(child):
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            raise AssertionError("child outlived its SIGKILLed parent")
        time.sleep(0.1)
