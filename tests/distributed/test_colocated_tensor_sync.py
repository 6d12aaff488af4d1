"""Colocated tensor sync with two engines and PP=2, on gloo: each engine sees only its own device.

Two embedded engines stand in for colocated SGLang engines on two GPUs: engine e is started with
--visible-devices cpu:e and refuses a payload naming another device with SGLang's "Invalid device_uuid=...".
A 2-process learner (PP=2: stage 0 on device cpu:0, stage 1 on cpu:1) syncs FP8 target weights:

- one sender per stage posting to every engine (the layout that killed colocated SGLang engines) is refused
  before its first bucket, from the devices the engine of the other device reports, every rank raises, and both
  engines keep serving the previous weights;
- with the run's colocated start-up (rank e feeds engine e) every tensor each engine serves is bit-identical
  to the single-process reference (the blockwise quantization of the target weights, one process, no
  parallelism), greedy generation equals the W8A8 reference model's, the whole sync ran inside one
  weight-update session per engine, and rank e (stage e) fed engine e: stage 1's layers reached engine 0
  through rank 0, which holds none of them;
- one TP-2 engine on both devices gets TP rank r's payload from rank r (the two ranks' buckets agree).

Run: pytest -q -m distributed tests/distributed/test_colocated_tensor_sync.py
"""
from __future__ import annotations

import pytest
import torch

from conftest import run_distributed
from test_weight_sync_parallel import PROMPT, WORKER, _get, _hf_model, _post

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
COLOCATED = WORKER.with_name("colocated_sync_worker.py")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Two engines serving FP8 weights A, engine e seeing device cpu:e only; target weights B as an HF directory."""
    from weight_sync_worker import architecture

    from megatron_rl.precision.hf_fp8 import save_fp8_checkpoint
    from megatron_rl.rollout.launcher import EngineSpec, engine_command, start_cluster

    root = tmp_path_factory.mktemp("colocated")
    arch = architecture()
    initial, config = _hf_model(arch, seed=1)
    target, _ = _hf_model(arch, seed=2)
    target.save_pretrained(str(root / "target"))
    save_fp8_checkpoint(initial.state_dict(), config.to_dict(), root / "initial_fp8")
    # engines 0 and 1 on one device each; engine 2, TP=2, spans both (a layout of its own, run separately)
    devices = [["--visible-devices", "cpu:0"], ["--visible-devices", "cpu:1"],
               ["--visible-devices", "cpu:0,cpu:1", "--tp-size", "2"]]
    specs = [EngineSpec(lambda port, extra=extra: engine_command(str(root / "initial_fp8"), port, extra_args=[
        "--weight-update-timeout-s", "60", *extra])) for extra in devices]
    cluster = start_cluster(specs, log_dir=str(root / "logs"))
    try:
        yield root, cluster.worker_urls[:2], target, cluster.worker_urls[2]
    finally:
        cluster.stop()


def _reset(root, urls) -> None:
    for u in urls:
        r = _post(u, "/update_weights_from_disk", {"model_path": str(root / "initial_fp8"), "weight_version": "A"})
        assert r["success"], r


def _served(url: str, name: str) -> torch.Tensor:
    return torch.tensor(_post(url, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 20}))


def _updates(url: str) -> list[dict]:
    return [e for e in _get(url, "/server_info")["events"] if e["event"] != "generate"]


def test_one_sender_per_stage_is_refused_by_the_engine_of_the_other_device(engines, tmp_path):
    from megatron_rl.precision.hf_fp8 import load_fp8_checkpoint

    root, urls, _, _ = engines
    _reset(root, urls)
    results = run_distributed(COLOCATED, 2, ["--target", str(root / "target"), "--urls", ",".join(urls),
                                             "--version", "bad", "--run-dir", str(tmp_path), "--mode", "stage-senders"],
                              timeout=300)
    errors = [r["error"] for r in results]
    assert all(errors), results  # every rank raised, none hung
    # stage 0's sender (device cpu:0) asks the engines first: engine 1 reports cpu:1 only, so nothing is sent
    assert (f"engine {urls[1]} holds device(s) cpu:1" in errors[0] and "handles of cpu:0" in errors[0]
            and errors[0] == errors[1]), errors
    initial, _ = load_fp8_checkpoint(root / "initial_fp8")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight"):
        assert torch.equal(_served(urls[1], name), initial[name].float()), name  # engine 1 refused everything
    for url in urls:  # HTTP 400s, not crashes: both still serve the version they had
        assert _get(url, "/model_info")["weight_version"] == "A"
        assert _get(url, "/server_info")["visible_devices"] == [f"cpu:{urls.index(url)}"]


def test_each_engine_is_fed_from_its_own_device_and_serves_the_reference_weights(engines, tmp_path):
    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.engine.generation import load_hf_model
    from megatron_rl.engine.testing import teacher_forced_logprobs
    from megatron_rl.phases.weights import rollout_payload
    from megatron_rl.precision.hf_fp8 import save_fp8_checkpoint

    root, urls, target, _ = engines
    _reset(root, urls)
    before = [len(_updates(u)) for u in urls]
    results = run_distributed(COLOCATED, 2, ["--target", str(root / "target"), "--urls", ",".join(urls),
                                             "--version", "colo", "--run-dir", str(tmp_path)], timeout=300)
    assert [r["error"] for r in results] == [None, None], results
    # rank e (stage e, device cpu:e) feeds engine e's only TP rank: the layout came from the topology
    assert [r["stage"] for r in results] == [0, 1]
    assert [r["feed"] for r in results] == [{"url": urls[e], "tp_rank": 0, "devices": [f"cpu:{e}"], "feeders": [e]}
                                            for e in range(2)]
    metrics = results[0]["metrics"]
    # single-process reference: the target's HF weights quantized in this process
    hf = {k: v for k, v in target.state_dict().items() if k != "lm_head.weight"}
    expected, _ = rollout_payload(hf, PrecisionConfig(rollout_quantization="fp8-blockwise"))
    save_fp8_checkpoint(target.state_dict(), target.config.to_dict(), tmp_path / "reference")
    reference = load_hf_model(str(tmp_path / "reference"))
    for e, url in enumerate(urls):
        updates = _updates(url)[before[e]:]
        kinds = [u["event"] for u in updates]
        # both stages' layers reached both engines, bucket by bucket, inside one session
        assert kinds[0] == "session_begin" and kinds[-1] == "session_end" and kinds.count("session_begin") == 1, kinds
        assert kinds[-2] == "update" and updates[-2]["weight_version"] == "colo", updates[-2:]
        for name, t in expected.items():
            assert torch.equal(_served(url, name), t.float()), f"{url} {name}"
        out = _post(url, "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
        assert out["meta_info"]["weight_version"] == "colo"
        ref = teacher_forced_logprobs(reference, PROMPT, out["output_ids"])
        assert out["output_ids"] == ref.argmax(-1).tolist()
    assert metrics["sync/buckets"] > 8 and metrics["sync/bytes"] > 0  # each engine took many buckets


def test_a_tp2_engine_gets_each_ranks_payload_from_that_ranks_device(engines, tmp_path):
    """One TP-2 engine on devices cpu:0 and cpu:1: rank 0 posts its own payload as TP rank 0's and rank 1's (stage 1,
    built in another process) as TP rank 1's; the engine opens entry r for rank r and requires them to agree, so the
    two ranks formed the same buckets from the whole model."""
    from megatron_rl.config.precision import PrecisionConfig
    from megatron_rl.phases.weights import rollout_payload

    root, _, target, tp2 = engines
    _reset(root, [tp2])
    results = run_distributed(COLOCATED, 2, ["--target", str(root / "target"), "--urls", tp2, "--version", "tp2",
                                             "--run-dir", str(tmp_path), "--engine-tp", "2"], timeout=300)
    assert [r["error"] for r in results] == [None, None], results
    assert [(r["feed"]["tp_rank"], r["feed"]["feeders"]) for r in results] == [(0, [0, 1]), (1, [0, 1])]
    assert results[0]["metrics"]["sync/buckets"] > 4  # every bucket posted once, by rank 0
    hf = {k: v for k, v in target.state_dict().items() if k != "lm_head.weight"}
    expected, _ = rollout_payload(hf, PrecisionConfig(rollout_quantization="fp8-blockwise"))
    for name, t in expected.items():
        assert torch.equal(_served(tp2, name), t.float()), name
    assert _get(tp2, "/model_info")["weight_version"] == "tp2"
