"""The launch checkpoint is built once per run_dir and source: concurrent starts, reuse, stale locks, a changed source."""
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.convert.shared_dir import MARKER
from megatron_rl.engine.testing import make_tiny_model
from megatron_rl.precision.rollout_formats import load_quantized_model, write_launch_checkpoint

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
BLOCKWISE = PrecisionConfig(rollout_quantization="fp8-blockwise")


def _tree(path: Path) -> dict:
    """relative path -> sha256 of every file under `path`."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _source(tmp_path: Path, seed: int = 1) -> str:
    hf = tmp_path / "hf"
    make_tiny_model(str(hf), seed=seed)
    (hf / "tokenizer.json").write_text("{}")
    return str(hf)


# Each process is started on its own (as `megatron-rl engines` is on every engine node), imports everything,
# says it is ready, then waits for the round's go file so that all of them call write_launch_checkpoint together.
_RACER = textwrap.dedent("""
    import json, os, sys, time, traceback
    import torch
    torch.set_num_threads(1)
    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.precision.rollout_formats import write_launch_checkpoint
    hf, root, sync, me, rounds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    for r in range(rounds):
        open(os.path.join(sync, f"ready-{r}-{me}"), "w").close()
        while not os.path.exists(os.path.join(sync, f"go-{r}")):
            time.sleep(0.001)
        try:
            out = {"path": write_launch_checkpoint(hf, PrecisionConfig(rollout_quantization="fp8-blockwise"),
                                                   os.path.join(root, f"round{r}", "weights"), poll_s=0.01)}
        except BaseException:
            out = {"error": traceback.format_exc()}
        with open(os.path.join(sync, f"result-{r}-{me}.json"), "w") as f:
            json.dump(out, f)
""")


def test_concurrent_starts_on_one_run_dir_build_it_once(tmp_path):
    hf = _source(tmp_path)
    reference = Path(write_launch_checkpoint(hf, BLOCKWISE, str(tmp_path / "alone")))
    expected = {k: v for k, v in _tree(reference).items() if k != MARKER}
    nproc, rounds = 3, 3
    sync = tmp_path / "sync"
    sync.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, hf, str(tmp_path / "runs"), str(sync), str(i), str(rounds)],
                              env=env) for i in range(nproc)]
    try:
        for r in range(rounds):
            deadline = time.monotonic() + 300
            while len(list(sync.glob(f"ready-{r}-*"))) < nproc:
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a racer died early"
                time.sleep(0.01)
            (sync / f"go-{r}").touch()
        for p in procs:
            assert p.wait(timeout=600) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r in range(rounds):
        weights = tmp_path / "runs" / f"round{r}" / "weights"
        results = [json.loads((sync / f"result-{r}-{i}.json").read_text()) for i in range(nproc)]
        assert all("error" not in x for x in results), [x.get("error") for x in results]
        assert {x["path"] for x in results} == {str(weights / "launch_fp8-blockwise")}
        out = weights / "launch_fp8-blockwise"
        got = _tree(out)
        assert {k: v for k, v in got.items() if k != MARKER} == expected  # the same bits as a lone writer's
        marker = json.loads((out / MARKER).read_text())
        assert marker["identity"]["format"] == "fp8-blockwise"
        # built by exactly one of them, and nothing left beside it (no lock, temp or stale directories)
        assert sorted(os.listdir(weights)) == ["launch_fp8-blockwise"]
        load_quantized_model(str(out))


def _stamp(path: Path) -> dict:
    return {str(p.relative_to(path)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in [path, *path.rglob("*")]}


def test_second_start_reuses_and_a_changed_source_is_rebuilt(tmp_path):
    hf = _source(tmp_path)
    root = str(tmp_path / "weights")
    out = Path(write_launch_checkpoint(hf, BLOCKWISE, root))
    before = _stamp(out)
    assert write_launch_checkpoint(hf, BLOCKWISE, root) == str(out)
    assert _stamp(out) == before  # not rewritten: same inodes and mtimes
    # the source re-exported with identical bytes (new mtimes, as a megatron init re-exported on restart): reused
    for p in Path(hf).iterdir():
        os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))
    assert write_launch_checkpoint(hf, BLOCKWISE, root) == str(out)
    assert _stamp(out) == before
    # other weights in the source: a new checkpoint with their bits
    old_bits = _tree(out)
    make_tiny_model(hf, seed=2)
    assert write_launch_checkpoint(hf, BLOCKWISE, root) == str(out)
    new_bits = _tree(out)
    assert new_bits["model.safetensors"] != old_bits["model.safetensors"]
    assert sorted(os.listdir(root)) == ["launch_fp8-blockwise"]
    # another scale format is another identity: rebuilt too
    ue8m0 = PrecisionConfig(rollout_quantization="fp8-blockwise", rollout_scale_fmt="ue8m0")
    write_launch_checkpoint(hf, ue8m0, root)
    assert json.loads((out / "config.json").read_text())["quantization_config"].get("scale_fmt") == "ue8m0"


def test_unmarked_output_of_older_code_is_replaced(tmp_path):
    hf = _source(tmp_path)
    out = tmp_path / "weights" / "launch_fp8-blockwise"
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"torn")
    (out / "leftover.bin").write_bytes(b"x")
    write_launch_checkpoint(hf, BLOCKWISE, str(tmp_path / "weights"))
    assert (out / MARKER).exists() and not (out / "leftover.bin").exists()
    load_quantized_model(str(out))


def test_a_dead_builders_lock_is_broken(tmp_path):
    import socket

    hf = _source(tmp_path)
    weights = tmp_path / "weights"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # a builder of this host that died holding the lock (its pid no longer exists), with its temp directory left
    lock = weights / "launch_fp8-blockwise.lock"
    lock.mkdir(parents=True)
    token = f"{socket.gethostname()}-{dead.pid}-0badf00d"
    (lock / "owner.json").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "token": token}))
    (weights / f"launch_fp8-blockwise.tmp-{token}").mkdir()
    t0 = time.monotonic()
    out = write_launch_checkpoint(hf, BLOCKWISE, str(weights), poll_s=0.01)
    assert time.monotonic() - t0 < 60
    assert sorted(os.listdir(weights)) == ["launch_fp8-blockwise"] and out.endswith("launch_fp8-blockwise")
    # another host's builder whose heartbeat stopped: broken once it has not changed for stale_after_s
    (weights / "launch_fp8-blockwise" / MARKER).unlink()
    lock.mkdir()
    (lock / "owner.json").write_text(json.dumps({"host": "elsewhere", "pid": 1, "token": "y"}))
    t0 = time.monotonic()
    write_launch_checkpoint(hf, BLOCKWISE, str(weights), poll_s=0.01, stale_after_s=0.5)
    assert 0.5 <= time.monotonic() - t0 < 60
    assert sorted(os.listdir(weights)) == ["launch_fp8-blockwise"]


def test_a_live_builder_is_waited_for(tmp_path, monkeypatch):
    """A lock whose heartbeat keeps changing is not broken: the waiter times out instead of building beside it.

    On a fake clock: the live builder beats once per poll, whatever the box's load (a real-time beater thread was
    starved past stale_after_s on a loaded box and the lock was rightly broken)."""
    from megatron_rl.convert import shared_dir

    hf = _source(tmp_path)
    weights = tmp_path / "weights"
    lock = weights / "launch_fp8-blockwise.lock"
    lock.mkdir(parents=True)
    (lock / "owner.json").write_text(json.dumps({"host": "elsewhere", "pid": 1, "token": "z"}))

    class LiveBuilderClock:
        """time for shared_dir: each sleep advances the clock by its length and the builder beats once."""
        now, beats = 0.0, 0

        def monotonic(self):
            return self.now

        def time(self):
            return self.now

        def sleep(self, seconds):
            self.now += seconds
            self.beats += 1
            (lock / "heartbeat").write_text(str(self.beats))

    clock = LiveBuilderClock()
    monkeypatch.setattr(shared_dir, "time", clock)
    with pytest.raises(TimeoutError, match="launch_fp8-blockwise.lock"):
        write_launch_checkpoint(hf, BLOCKWISE, str(weights), poll_s=0.01, stale_after_s=0.5, timeout_s=1.5)
    assert clock.beats >= 1.5 / 0.01  # it waited the whole timeout, seeing the lock alive at every poll
    assert not (weights / "launch_fp8-blockwise").exists()


def test_a_live_builders_lock_and_build_directory_are_left_alone(tmp_path):
    """A builder of this host that is alive keeps its lock however long its heartbeat stalls, and the next lock holder
    removes only the build directories of builders that are gone (dead here, or another host's whose directory the
    heartbeat stopped touching for stale_after_s by the filesystem's clock)."""
    import socket

    hf = _source(tmp_path)
    weights = tmp_path / "weights"
    host = socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        lock = weights / "launch_fp8-blockwise.lock"
        lock.mkdir(parents=True)
        (lock / "owner.json").write_text(json.dumps({"host": host, "pid": live.pid, "token": f"{host}-{live.pid}-aa"}))
        with pytest.raises(TimeoutError, match="launch_fp8-blockwise.lock"):  # no heartbeat, but alive: not broken
            write_launch_checkpoint(hf, BLOCKWISE, str(weights), poll_s=0.01, stale_after_s=0.2, timeout_s=1.0)
        assert (lock / "owner.json").exists()
        (lock / "owner.json").unlink()
        lock.rmdir()
        keep = [f"{host}-{live.pid}-11111111", "elsewhere-7-22222222"]  # alive here; another host's, touched now
        gone = [f"{host}-{dead.pid}-33333333", "elsewhere-8-44444444"]  # dead here; another host's, untouched for long
        for token in keep + gone:
            (weights / f"launch_fp8-blockwise.tmp-{token}").mkdir()
        old = time.time() - 3600
        os.utime(weights / f"launch_fp8-blockwise.tmp-{gone[1]}", (old, old))
        write_launch_checkpoint(hf, BLOCKWISE, str(weights), poll_s=0.01, stale_after_s=60)
        assert sorted(os.listdir(weights)) == sorted(["launch_fp8-blockwise"] + [f"launch_fp8-blockwise.tmp-{t}" for t in keep])
    finally:
        live.kill()
        live.wait()
