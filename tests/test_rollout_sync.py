"""Disk weight sync: atomic versioned checkpoints, pruning, and engines actually serving the pushed weights."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.rollout.client import RolloutClient, RolloutServerError
from megatron_rl.rollout.sync import TRANSPORTS, DiskWeightSync, get_transport
from megatron_rl.engine.testing import ThreadedServer, make_tiny_model, teacher_forced_logprobs

torch.set_num_threads(1)


def test_registry():
    assert TRANSPORTS["disk"] is DiskWeightSync and get_transport("disk") is DiskWeightSync
    with pytest.raises(ValueError, match="transport='nccl'.*disk"):
        get_transport("nccl")


def test_write_is_complete_and_keeps_latest_k(tmp_path):
    model = make_tiny_model(str(tmp_path / "hf"), seed=0)
    sync = DiskWeightSync(str(tmp_path / "sync"), str(tmp_path / "hf"), ["http://127.0.0.1:9"], keep_last=2)
    sd = model.state_dict()
    paths = []
    for v in range(4):
        sd2 = {k: t + v for k, t in sd.items()}
        paths.append(sync.write(sd2, v, config_updates={"note": v}))
        os.utime(paths[-1], ns=(v * 10**9, v * 10**9))  # deterministic order regardless of fs timestamp resolution
        sync.prune(keep=paths[-1])
    assert [os.path.basename(p) for p in sync.versions()] == ["weights_2", "weights_3"]
    assert not any(n.startswith(".tmp") for n in os.listdir(tmp_path / "sync"))
    loaded = load_file(os.path.join(paths[3], "model.safetensors"))
    for k, t in sd.items():
        assert torch.equal(loaded[k], t + 3)
    cfg = json.load(open(os.path.join(paths[3], "config.json")))
    assert cfg["note"] == 3 and cfg["model_type"] == "qwen3"
    assert os.path.isfile(os.path.join(paths[3], "generation_config.json"))


def test_write_failure_leaves_no_partial_version(tmp_path):
    make_tiny_model(str(tmp_path / "hf"), seed=0)
    sync = DiskWeightSync(str(tmp_path / "sync"), str(tmp_path / "hf"), ["http://127.0.0.1:9"])
    with pytest.raises(TypeError, match="'bad'"):
        sync.write({"ok": torch.zeros(2), "bad": [1, 2]}, "v1")
    assert os.listdir(tmp_path / "sync") == []
    with pytest.raises(ValueError, match="weight_version"):
        sync.write({"ok": torch.zeros(2)}, "../evil")


def test_tied_and_shared_tensors_are_written(tmp_path):
    make_tiny_model(str(tmp_path / "hf"), seed=0)
    sync = DiskWeightSync(str(tmp_path / "sync"), str(tmp_path / "hf"), ["http://127.0.0.1:9"])
    base = torch.arange(12.0).view(3, 4)
    path = sync.write({"a": base, "b": base, "c": base[1]}, "s")
    out = load_file(os.path.join(path, "model.safetensors"))
    assert torch.equal(out["a"], base) and torch.equal(out["b"], base) and torch.equal(out["c"], base[1])


def test_push_makes_engines_serve_new_weights(tmp_path):
    initial = make_tiny_model(str(tmp_path / "hf"), seed=0)
    target = make_tiny_model(str(tmp_path / "other"), seed=5)  # only its tensors are used
    prompt = [3, 4, 5, 6]
    with ThreadedServer(str(tmp_path / "hf")) as s1, ThreadedServer(str(tmp_path / "hf")) as s2:
        sync = DiskWeightSync(str(tmp_path / "sync"), str(tmp_path / "hf"), [s1.url, s2.url], keep_last=1)
        path = sync.push(target.state_dict(), 1)
        for url in (s1.url, s2.url):
            r = RolloutClient(url).generate_sync(prompt, {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})[0]
            assert r.weight_version == "1"
            ref = teacher_forced_logprobs(target, prompt, r.output_ids)
            assert r.output_ids == ref.argmax(-1).tolist()
            assert torch.allclose(torch.tensor(r.logprobs), ref.max(-1).values, atol=1e-4)
            before = teacher_forced_logprobs(initial, prompt, r.output_ids).max(-1).values
            assert (before - torch.tensor(r.logprobs)).abs().max() > 1e-2  # the test models really differ
        sync.push(initial.state_dict(), 2)
        assert [os.path.basename(p) for p in sync.versions()] == ["weights_2"] and not os.path.exists(path)
        missing = {k: v for k, v in initial.state_dict().items() if k != "model.layers.0.mlp.up_proj.weight"}
        with pytest.raises(RolloutServerError, match="missing: model.layers.0.mlp.up_proj.weight"):
            sync.push(missing, 3)
        wrong = dict(initial.state_dict())
        wrong["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
        with pytest.raises(RolloutServerError, match="update_weights_from_disk"):
            sync.push(wrong, 4)
        r = RolloutClient(s1.url).generate_sync(prompt, {"max_new_tokens": 2})[0]
        assert r.weight_version == "2"  # failed pushes leave the served version alone
