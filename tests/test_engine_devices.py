"""Tensor weight sync against an engine started on other devices than the sender's or the layout's.

SGLang's scheduler exits on a CUDA-IPC handle of a GPU its process does not see (srt/utils/patch_torch.py), so the
senders ask each engine which devices it holds before the first bucket (rollout/engine_devices.py) and refuse a
mismatch with one line naming the engine and both device sets. On CPU the embedded engine stands in: its
--visible-devices is what it reports in /server_info, and it refuses another device's payload as SGLang does.

Run: pytest -q tests/test_engine_devices.py
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from megatron_rl.engine.testing import ThreadedServer, make_tiny_model
from megatron_rl.rollout import engine_devices
from megatron_rl.rollout.engine_devices import DevicesUnknown, tp_rank_devices, visible_devices
from megatron_rl.rollout.sync import TensorWeightSync
from test_weight_receiver import greedy, weights_of

torch.set_num_threads(1)
NAME = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("devices")
    base = make_tiny_model(str(root / "base"), seed=0).state_dict()
    target = make_tiny_model(str(root / "target"), seed=4).state_dict()
    return root, base, target


def sync_one(url, target, version):
    """One tensor sync of one tensor from this process (device cpu:0: no LOCAL_RANK) as a stage sender does it."""
    transport = TensorWeightSync([url], timeout_s=30)
    transport.begin(version)
    try:
        transport.begin_stage(0, 1, version)
        transport.send_bucket([(NAME, target[NAME].clone())], final=True)
    finally:
        transport.finish()
        transport.close()


@pytest.mark.parametrize("visible", [None, ["cpu:0"], ["cpu:3", "cpu:0"]])
def test_an_engine_that_sees_the_sender_gets_its_weights(models, visible, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    root, base, target = models
    with ThreadedServer(str(root / "base"), visible_devices=visible) as srv:
        sync_one(srv.url, target, "seen")
        assert torch.equal(weights_of(srv.url, NAME), target[NAME])
        assert greedy(srv.url)["meta_info"]["weight_version"] == "seen"


def test_an_engine_started_on_other_devices_is_refused_before_the_first_bucket(models, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    root, base, target = models
    with ThreadedServer(str(root / "base"), visible_devices=["cpu:5", "cpu:6"]) as srv:
        posted = []
        real = TensorWeightSync.engine_client

        def spy(self, urls):
            client = real(self, urls)
            call_all = client.call_all

            async def record(path, *args, **kwargs):
                posted.append(path)
                return await call_all(path, *args, **kwargs)
            client.call_all = record
            return client
        monkeypatch.setattr(TensorWeightSync, "engine_client", spy)
        with pytest.raises(RuntimeError) as refused:
            sync_one(srv.url, target, "other")
        line = str(refused.value)
        assert "\n" not in line and srv.url in line and "cpu:5, cpu:6" in line and "handles of cpu:0" in line, line
        assert "/update_weights_from_tensor" not in posted, "refused before any bucket was sent"
        assert torch.equal(weights_of(srv.url, NAME), base[NAME])
        assert greedy(srv.url)["meta_info"]["weight_version"] == "default"


def test_a_colocated_engine_holding_other_devices_than_the_layout_is_refused(models):
    root, _, _ = models
    with ThreadedServer(str(root / "base"), visible_devices=["cpu:1"]) as moved, \
            ThreadedServer(str(root / "base"), visible_devices=["cpu:0"]) as placed, \
            ThreadedServer(str(root / "base")) as sees_all:
        transport = TensorWeightSync([moved.url, placed.url, sees_all.url], timeout_s=30)
        transport.check_colocated_devices([(placed.url, ("cpu:0",)), (sees_all.url, ("cpu:2",))])
        with pytest.raises(ValueError) as refused:
            transport.check_colocated_devices([(moved.url, ("cpu:0",))])
        line = str(refused.value)
        assert "\n" not in line and moved.url in line and "device(s) cpu:1" in line and "handles of cpu:0" in line, line


def test_the_runtime_asks_the_engines_before_it_assigns_feeds(monkeypatch):
    """attach_colocated_feeders runs the check on the controller; its error reaches share_feeds (every rank)."""
    from megatron_rl import runtime
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.phases import colocated

    seen = {}

    class Transport:
        def check_colocated_devices(self, engines):
            seen["engines"] = engines
            raise ValueError("engine X holds device(s) cpu:9")

    def share(engines, error):
        seen["error"] = error
        raise ValueError(error)

    class Session:
        cfg = type("Cfg", (), {"rollout": RolloutConfig(placement="colocated", num_engines=1)})()
        transport = Transport()

    monkeypatch.setattr(colocated, "share_feeds", share)
    monkeypatch.setattr(runtime.state, "is_controller", lambda: True)
    with pytest.raises(ValueError, match="cpu:9"):
        runtime.attach_colocated_feeders(Session(), ["http://127.0.0.1:1"])
    assert seen["engines"] == [("http://127.0.0.1:1", ("cpu:0",))] and "cpu:9" in seen["error"]


def test_sglang_devices_come_from_the_engine_process_and_its_tp_placement(monkeypatch):
    """SGLang reports no GPU identity over HTTP: its CUDA_VISIBLE_DEVICES (its process) and base_gpu_id/gpu_id_step
    (its /server_info) decide; a process that cannot be read is DevicesUnknown, never a guess."""
    monkeypatch.setattr(engine_devices, "listener_environ", lambda port: {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb,GPU-cc"})
    info = {"device": "cuda", "tp_size": 2, "base_gpu_id": 1, "gpu_id_step": 1}
    seen = visible_devices("http://127.0.0.1:30000", info)
    assert seen == ("aa", "bb", "cc") and tp_rank_devices(info, seen) == ("bb", "cc")
    with pytest.raises(DevicesUnknown, match="tp_size 2 from base_gpu_id 2"):
        tp_rank_devices({**info, "base_gpu_id": 2}, seen)
    monkeypatch.setattr(engine_devices, "listener_environ", lambda port: None)
    with pytest.raises(DevicesUnknown, match="port 30000"):
        visible_devices("http://127.0.0.1:30000", info)
    assert visible_devices("http://h:1", {"engine": "embedded-cpu", "visible_devices": None}) is None


def test_the_listening_process_environment_is_read_from_proc():
    code = ("import socket,sys,time; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": "GPU-probe-7"})
    try:
        port = int(proc.stdout.readline())
        env = engine_devices.listener_environ(port)
        assert env is not None and env["CUDA_VISIBLE_DEVICES"] == "GPU-probe-7"
        assert visible_devices(f"http://127.0.0.1:{port}", {"device": "cuda"}) == ("probe-7",)
    finally:
        proc.kill()
        proc.wait()
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        assert engine_devices.listener_environ(free.getsockname()[1]) is None  # bound, not listening
