"""A 2-process learner (PP=2 with the `distributed` transport over gloo, then TP=2 with `tensor`) streams FP8
weights into two embedded engines: one in the default SGLang 0.5.23 mode (it refuses updates outside a
weight-update session), one in 0.5.8 mode (no sessions). tests/distributed/test_loop_parallel.py runs the
other pairings (distributed under TP=2 and PP=2 is there, tensor under DP=2).

Afterwards every tensor each engine serves is bit-identical to what the disk transport wrote (and to
the blockwise quantization of the target weights), greedy generation equals the W8A8 reference built
from that checkpoint, the weight version is the pushed one, and the 0.5.23 engine received the sync
inside one session. Between layouts the engines are reset to other weights, so each layout has to move
every tensor itself.

Run: pytest -q -m distributed tests/distributed/test_weight_sync_parallel.py
"""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch

from conftest import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = Path(__file__).with_name("weight_sync_worker.py")
PROMPT = [5, 9, 14, 3, 27]


def _post(url: str, path: str, body: dict):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _get(url: str, path: str):
    with urllib.request.urlopen(url + path, timeout=60) as resp:
        return json.loads(resp.read())


def _hf_model(arch, seed: int):
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.presets import hf_config

    torch.manual_seed(seed)
    config = hf_config(arch, initializer_range=0.2)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), config


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Two engines serving FP8 weights A; target weights B as an HF directory."""
    from weight_sync_worker import architecture

    from megatron_rl.precision.hf_fp8 import save_fp8_checkpoint
    from megatron_rl.rollout.launcher import EngineSpec, engine_command, start_cluster

    root = tmp_path_factory.mktemp("wsync")
    arch = architecture()
    initial, config = _hf_model(arch, seed=1)
    target, _ = _hf_model(arch, seed=2)
    target.save_pretrained(str(root / "target"))
    save_fp8_checkpoint(initial.state_dict(), config.to_dict(), root / "initial_fp8")
    args = ["--weight-update-timeout-s", "60"]
    specs = [EngineSpec(lambda port, extra=extra: engine_command(str(root / "initial_fp8"), port, extra_args=args + extra))
             for extra in ([], ["--sglang-compat", "0.5.8"])]
    cluster = start_cluster(specs, log_dir=str(root / "logs"))
    try:
        yield root, cluster.worker_urls, target
    finally:
        cluster.stop()


@pytest.mark.parametrize("layout,transport", [(["--pp", "2"], "distributed"), (["--tp", "2"], "tensor")],
                         ids=["pp2-distributed", "tp2-tensor"])
def test_learner_streams_fp8_weights_into_engines(setup, tmp_path, layout, transport):
    from megatron_rl.precision.hf_fp8 import load_fp8_checkpoint, quantize_state_dict
    from megatron_rl.engine.generation import load_hf_model
    from megatron_rl.engine.testing import teacher_forced_logprobs

    root, urls, target = setup
    reset = {u: _post(u, "/update_weights_from_disk", {"model_path": str(root / "initial_fp8"), "weight_version": "A"})
             for u in urls}
    assert all(r["success"] for r in reset.values()), reset
    version = "v-" + layout[0].strip("-") + layout[1]
    results = run_distributed(WORKER, 2, [*layout, "--target", str(root / "target"), "--urls", ",".join(urls),
                                          "--version", version, "--out", str(tmp_path), "--transport", transport],
                              timeout=300)
    infos = [_get(u, "/server_info") for u in urls]
    assert [i["version"] for i in infos] == ["0.5.23", "0.5.8"]
    sync_events = [e["event"] for e in infos[0]["events"] if e["event"] != "generate"]
    assert sync_events[-3:] == ["session_begin", "update", "session_end"]  # the whole sync in one session
    assert not any(e["event"].startswith("session") for e in infos[1]["events"])
    if transport == "distributed":  # every stage's sender had its own group
        assert [r["group"] for r in results] == ["weight_update_group_pp0", "weight_update_group_pp1"]
    else:  # TP rank 1 only took part in the gathers
        assert [r["sender"] for r in results] == [True, False]
    metrics = results[0]["metrics"]
    assert metrics["sync/buckets"] > 4 and metrics["sync/bytes"] > 0

    disk, _ = load_fp8_checkpoint(tmp_path / "disk")
    expected = quantize_state_dict({k: v for k, v in target.state_dict().items() if k != "lm_head.weight"})
    assert disk.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(disk[name].view(torch.uint8), t.view(torch.uint8)), name
    reference = load_hf_model(str(tmp_path / "disk"))
    for url in urls:
        for name, t in disk.items():
            served = torch.tensor(_post(url, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 20}))
            assert torch.equal(served, t.float()), f"{url} {name}"
        out = _post(url, "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
        assert out["meta_info"]["weight_version"] == version
        ref = teacher_forced_logprobs(reference, PROMPT, out["output_ids"])
        assert out["output_ids"] == ref.argmax(-1).tolist()
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, ref.max(-1).values, atol=1e-4)
