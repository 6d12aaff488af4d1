"""Embedded engines: batch-invariant samples under --enable-deterministic-inference, and exit when the trainer dies."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

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


@pytest.mark.trajectory
def test_deterministic_engine_generates_one_batched_call_as_one_batch(tmp_path):
    """A call packing several prompts runs as one batch, repeats bit for bit, matches the prompts sent alone up to
    float rounding (left padding), and is never merged with a concurrent call."""
    make_tiny_model(str(tmp_path / "m"), seed=0)
    params = [_params(k) for k in range(len(PROMPTS))]
    with ThreadedServer(str(tmp_path / "m"), deterministic=True, batch_window_s=0.05) as srv:
        packed = RolloutClient(srv.url, sequences_per_request=64)
        first = packed.generate_batch_sync(PROMPTS, params)
        assert srv.server.batches_run == 1
        again = packed.generate_batch_sync(PROMPTS, params)
        assert [[r.logprobs for r in g] for g in again] == [[r.logprobs for r in g] for g in first]  # bitwise
        alone = RolloutClient(srv.url).generate_batch_sync(PROMPTS, params)
        # left padding moves the last bits of the log-probs (< 1e-4), so a sampled token whose draw falls within that
        # of a boundary may differ, and the rest of its sequence with it: compare up to each first difference
        pairs = [(ra, rb) for ga, gb in zip(alone, first) for ra, rb in zip(ga, gb)]
        diffs = []
        for ra, rb in pairs:
            common = next((i for i, (a, b) in enumerate(zip(ra.output_ids, rb.output_ids)) if a != b),
                          min(len(ra.output_ids), len(rb.output_ids)))
            diffs += [abs(a - b) for a, b in zip(ra.logprobs[:common], rb.logprobs[:common])]
        assert diffs and max(diffs) < 1e-4
        # such a draw is a ~1e-4 chance a token: nearly every sequence is the same, whatever the CPU
        assert sum(ra.output_ids == rb.output_ids for ra, rb in pairs) >= 0.75 * len(pairs)
        # two packed calls in flight together: each still runs as a batch of its own, so each equals its answer alone
        halves = [(PROMPTS[:2], params[:2]), (PROMPTS[2:], params[2:])]
        solo = [packed.generate_batch_sync(h, hp) for h, hp in halves]
        before = srv.server.batches_run

        async def both_at_once():
            async with aiohttp.ClientSession() as session:
                sem = asyncio.Semaphore(2)
                return await asyncio.gather(*(packed._generate_call(session, sem, h, hp, True) for h, hp in halves))

        together = asyncio.run(both_at_once())
        assert srv.server.batches_run == before + 2
        assert [[[r.logprobs for r in g] for g in call] for call in together] == \
            [[[r.logprobs for r in g] for g in call] for call in solo]


def test_deterministic_engine_splits_a_call_at_max_batch_size(tmp_path):
    """A call larger than --max-batch-size runs as consecutive batches of whole requests, the same every time."""
    make_tiny_model(str(tmp_path / "m"), seed=0)
    params = [_params(k) for k in range(len(PROMPTS))]  # n = 3 each: 15 rows
    with ThreadedServer(str(tmp_path / "m"), deterministic=True, max_batch_size=7) as srv:
        client = RolloutClient(srv.url, sequences_per_request=64)
        first = client.generate_batch_sync(PROMPTS, params)
        assert srv.server.batches_run == 3  # [3+3], [3+3], [3]
        assert [[r.logprobs for r in g] for g in client.generate_batch_sync(PROMPTS, params)] == \
            [[r.logprobs for r in g] for g in first]


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
