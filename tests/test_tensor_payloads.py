"""The tensor transport's per-TP-rank payloads, as SGLang's `Engine._serialize_tensors_per_rank` builds them.

An embedded engine declaring TP=2 (`--tp-size 2`) opens entry r of `serialized_named_tensors` for rank r
only and requires every rank's payload to hold the same tensors, so the layout is checked on CPU: one
payload per rank, each decodable on its own; too few entries, or ranks that disagree, are refused.
The CUDA branch (device named by UUID) runs only with a GPU.

Run: pytest -q tests/test_tensor_payloads.py
"""
from __future__ import annotations

import base64
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_rl.engine.tensor_payload import deserialize_named_tensors
from megatron_rl.engine.testing import ThreadedServer, make_tiny_model
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.sync import TensorWeightSync
from megatron_rl.rollout.sync.serialization import DEVICE_ARG, serialize_per_rank
from megatron_rl.rollout.sync.tensor import update_tensor_body
from test_weight_receiver import greedy, post, session, weights_of


def test_one_payload_per_rank_each_decodable_alone():
    named = [("a", torch.arange(6.0).reshape(2, 3).share_memory_()), ("b", torch.ones(4, dtype=torch.bfloat16).share_memory_())]
    body = update_tensor_body(named, 3, final=True, weight_version=7)
    assert len(body["serialized_named_tensors"]) == 3 and body["weight_version"] == "7" and body["flush_cache"]
    for blob in body["serialized_named_tensors"]:
        back = deserialize_named_tensors(blob)
        assert [n for n, _ in back] == ["a", "b"]
        assert all(torch.equal(t, ref) and t.dtype == ref.dtype for (_, t), (_, ref) in zip(back, named))
    assert "weight_version" not in update_tensor_body(named, 1, final=False, weight_version=7)
    with pytest.raises(ValueError, match="tp_size"):
        serialize_per_rank(named, 0)


def test_an_engine_of_two_tp_ranks_opens_its_own_payloads(tmp_path):
    base = make_tiny_model(str(tmp_path / "base"), seed=0).state_dict()
    target = make_tiny_model(str(tmp_path / "target"), seed=4)
    tsd = [(n, t) for n, t in target.state_dict().items() if n != "lm_head.weight"]
    with ThreadedServer(str(tmp_path / "base"), tp_size=2) as srv:
        transport = TensorWeightSync([srv.url], bucket_mb=0.02, timeout_s=30)
        assert transport.engine_tp_sizes() == [2]
        name, tensor = tsd[1]
        one = [(name, (tensor + 1).share_memory_())]
        other = [(name, (tensor + 2).share_memory_())]
        with session(srv.url):
            status, body = post(srv.url, "/update_weights_from_tensor", update_tensor_body(one, 1, False, None))
            assert status == 400 and "1 entries for this engine's 2 TP ranks" in body["message"], body
            mixed = {"serialized_named_tensors": [update_tensor_body(one, 1, False, None)["serialized_named_tensors"][0],
                                                  update_tensor_body(other, 1, False, None)["serialized_named_tensors"][0]]}
            status, body = post(srv.url, "/update_weights_from_tensor", mixed)
            assert status == 400 and "TP rank 1's payload holds other tensors" in body["message"], body
        assert torch.equal(weights_of(srv.url, name), base[name])  # refused: the served weights are unchanged
        transport.begin("tp2")
        transport.begin_stage(0, 1, "tp2")
        for k in range(0, len(tsd), 8):
            transport.send_bucket(tsd[k:k + 8], final=k + 8 >= len(tsd))
        transport.finish()
        transport.close()
        assert all(torch.equal(weights_of(srv.url, n), t) for n, t in tsd)
        assert greedy(srv.url)["meta_info"]["weight_version"] == "tp2"
        status, body = post(srv.url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1, "world_size": 3, "backend": "gloo"})
        assert status == 400 and "--tp-size 1 for distributed updates" in body["message"]


def test_a_cpu_payload_names_its_device_and_only_an_engine_seeing_it_opens_it():
    """SGLang's `_device_from_maybe_uuid` (srt/utils/patch_torch.py) raises 'Invalid device_uuid=<uuid>' for a handle
    of a GPU its process does not see; the embedded engine's --visible-devices list does the same for CPU payloads."""
    from megatron_rl.engine.server import build_arg_parser
    from megatron_rl.rollout.sync.serialization import payload_devices, serialize_named_tensors

    named = [("a", torch.arange(6.0).reshape(2, 3).share_memory_())]
    blob = serialize_named_tensors(named, device="cpu:3")
    assert payload_devices(named, "cpu:3") == {"cpu:3"} and payload_devices(named) == set()
    for visible in (None, ["cpu:3"], ["cpu:0", "cpu:3"]):
        (name, got), = deserialize_named_tensors(blob, visible)
        assert name == "a" and torch.equal(got, named[0][1])
    with pytest.raises(ValueError) as refused:
        deserialize_named_tensors(blob, ["cpu:0"])
    assert str(refused.value) == "Invalid device_uuid=cpu:3"  # SGLang's text, word for word
    assert build_arg_parser().parse_args(["--model-path", "m", "--visible-devices", "cpu:0,cpu:1"]).visible_devices == "cpu:0,cpu:1"


def test_an_engine_refuses_a_payload_from_a_device_it_does_not_see(tmp_path):
    """The bug of one sender for every colocated engine, on CPU: engine 0 sees device cpu:0 only; a payload sent from
    cpu:1 is refused (HTTP 400, weights unchanged, the engine keeps serving) and its own device's payload loads."""
    from megatron_rl.rollout.sync.serialization import serialize_named_tensors

    base = make_tiny_model(str(tmp_path / "base"), seed=0).state_dict()
    target = make_tiny_model(str(tmp_path / "target"), seed=4).state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    update = [(name, target[name].clone().share_memory_())]
    with ThreadedServer(str(tmp_path / "base"), visible_devices=["cpu:0"], tp_size=2) as srv:
        assert RolloutClient(srv.url).server_info_sync()[0]["visible_devices"] == ["cpu:0"]
        with session(srv.url):
            other = {"serialized_named_tensors": [serialize_named_tensors(update, "cpu:0"),
                                                  serialize_named_tensors(update, "cpu:1")]}
            status, body = post(srv.url, "/update_weights_from_tensor", other)
            assert status == 400 and body["message"].endswith("TP rank 1's payload: Invalid device_uuid=cpu:1"), body
            assert torch.equal(weights_of(srv.url, name), base[name])
            own = {"serialized_named_tensors": [serialize_named_tensors(update, "cpu:0")] * 2, "weight_version": "own"}
            status, body = post(srv.url, "/update_weights_from_tensor", own)
            assert status == 200 and body["success"], body
        assert torch.equal(weights_of(srv.url, name), target[name])
        assert greedy(srv.url)["meta_info"]["weight_version"] == "own"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_payload_names_its_device_by_uuid_and_opens_in_another_process():
    from torch.multiprocessing import reductions

    from megatron_rl.rollout.sync.serialization import device_uuid

    t = torch.arange(12, dtype=torch.bfloat16, device="cuda").reshape(3, 4)
    _, args = reductions.reduce_tensor(t)
    assert isinstance(args[DEVICE_ARG], int)  # where torch puts the device, as SGLang's patch assumes
    blobs = serialize_per_rank([("w", t)], 2)
    # the reader maps the UUID back to its device index, as SGLang's patched rebuild_cuda_tensor does (its own patch
    # when sglang imports, the project's equivalent otherwise); the payload itself carries the UUID
    reader = textwrap.dedent("""
        import base64, sys, torch
        from multiprocessing.reduction import ForkingPickler
        from megatron_rl.rollout.sync.serialization import patch_torch_reductions
        patch_torch_reductions()
        for line in sys.stdin.read().split():
            (name, got), = ForkingPickler.loads(base64.b64decode(line))
            print(name, got.device.index, got.float().cpu().flatten().tolist())
    """)
    assert device_uuid(0).encode() in base64.b64decode(blobs[0])
    proc = subprocess.run([sys.executable, "-c", reader], input="\n".join(blobs), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("w 0 ") for line in lines), lines
    assert lines[0].split(" ", 2)[2] == str(t.float().cpu().flatten().tolist())
