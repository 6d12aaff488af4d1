"""The embedded engine's weight endpoints, driven as a trainer drives SGLang (engine in a subprocess, trainer here).

A gloo group opened with /init_weights_update_group, tensors broadcast through
/update_weights_from_distributed inside a weight-update session (the engine runs in its default
SGLang 0.5.23 mode, which refuses updates outside one without joining the broadcast) and read back
with /get_weights_by_name and /generate; bad requests
(unknown group, shape/dtype mismatch, unknown name, a broadcast that never comes) fail with a clear
message within the engine's timeout and leave the served weights alone; the tensor transport with
release/resume of memory; the architecture check of /update_weights_from_disk.

Run: pytest -q tests/test_weight_receiver.py
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron_rl.parallel.weight_group import destroy_weight_update_group, free_port, init_weight_update_group
from megatron_rl.engine.testing import make_tiny_model, teacher_forced_logprobs

torch.set_num_threads(1)
ENGINE_TIMEOUT_S = 4.0
PROMPT = [3, 4, 5, 6, 7]


def post(url: str, path: str, body: dict, timeout: float = 60.0) -> tuple[int, object]:
    """(status, parsed JSON) of a POST."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def weights_of(url: str, name: str) -> torch.Tensor:
    status, body = post(url, "/get_weights_by_name", {"name": name, "truncate_size": 10_000})
    assert status == 200, body
    return torch.tensor(body)


def greedy(url: str, n: int = 6) -> dict:
    status, body = post(url, "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    assert status == 200, body
    return body


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One embedded engine subprocess serving a tiny model (seed 0), plus a different target model (seed 9)."""
    from megatron_rl.rollout.launcher import launch_engines

    root = tmp_path_factory.mktemp("receiver")
    base = make_tiny_model(str(root / "base"), seed=0)
    target = make_tiny_model(str(root / "target"), seed=9)
    cluster = launch_engines(str(root / "base"), 1, engine_args=["--weight-update-timeout-s", str(ENGINE_TIMEOUT_S)],
                             log_dir=str(root / "logs"))
    try:
        yield cluster.worker_urls[0], base, target, root
    finally:
        cluster.stop()


@contextlib.contextmanager
def session(url: str):
    """SGLang 0.5.23's weight-update session around the updates made inside."""
    assert post(url, "/begin_weight_update", {"selector": "all"}) == (200, {"success": True, "message": "Success"})
    try:
        yield
    finally:
        assert post(url, "/end_weight_update", {}) == (200, {"success": True, "message": "Success"})


class Trainer:
    """Rank 0 of a weight-update group with one engine, as a trainer script written for SGLang does it."""

    def __init__(self, url: str, group_name: str = "weight_update_group"):
        self.url, self.group_name = url, group_name
        port = free_port()
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, url, "/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": group_name, "backend": "gloo"})
            self.pg = init_weight_update_group("gloo", "127.0.0.1", port, 0, 2, group_name, timeout_s=30)
            status, body = answer.result()
        assert status == 200 and body["success"], body

    def update(self, named: list[tuple[str, torch.Tensor]], version=None, broadcast: bool = True, **extra):
        """POST the metadata and broadcast the tensors in order; returns the engine's (status, body)."""
        body = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named], "group_name": self.group_name, **extra}
        if version is not None:
            body["weight_version"] = version
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, self.url, "/update_weights_from_distributed", body)
            if broadcast:
                for _, t in named:
                    torch.distributed.broadcast(t.contiguous(), src=0, group=self.pg)
            return answer.result()

    def close(self):
        post(self.url, "/destroy_weights_update_group", {"group_name": self.group_name})
        destroy_weight_update_group(self.pg)


def test_trainer_probe_updates_weights_and_generation(engine):
    url, base, target, _ = engine
    tsd = {k: v for k, v in target.state_dict().items() if k != "lm_head.weight"}
    before = greedy(url)
    trainer = Trainer(url)
    try:
        names = list(tsd)
        bf16 = "model.layers.0.mlp.down_proj.weight"  # a bf16 tensor is cast into the fp32 engine, as SGLang does
        named = [(n, tsd[n].to(torch.bfloat16) if n == bf16 else tsd[n]) for n in names]
        # outside a session: SGLang 0.5.23's refusal, at once and without joining the broadcast
        t0 = time.monotonic()
        assert trainer.update(named[:10], broadcast=False) == (400, {"success": False, "message": (
            "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()")})
        assert time.monotonic() - t0 < ENGINE_TIMEOUT_S
        with session(url):
            assert post(url, "/begin_weight_update", {}) == (400, {"success": False, "message": (
                "a weight-update session is already open; call end_weight_update() first")})
            status, body = trainer.update(named[:10])  # the group is still in step: nothing was consumed above
            assert status == 200 and body["success"], body
            status, body = trainer.update(named[10:], version="step-1")
            assert status == 200 and body["success"] and "step-1" in body["message"], body
        assert post(url, "/end_weight_update", {}) == (400, {"success": False, "message": (
            "no weight-update session is open; call begin_weight_update() first")})
    finally:
        trainer.close()
    for n in names:
        expect = tsd[n].to(torch.bfloat16).float() if n == bf16 else tsd[n]
        assert torch.equal(weights_of(url, n), expect), n
    # a tied lm_head reads back as the embedding; truncate_size keeps the first rows
    status, rows = post(url, "/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 2})
    assert status == 200 and torch.equal(torch.tensor(rows), tsd["model.embed_tokens.weight"][:2])
    after = greedy(url)
    assert after["meta_info"]["weight_version"] == "step-1"
    target.model.layers[0].mlp.down_proj.weight.data = tsd[bf16].to(torch.bfloat16).float()
    ref = teacher_forced_logprobs(target, PROMPT, after["output_ids"])
    assert after["output_ids"] == ref.argmax(-1).tolist() != before["output_ids"]
    got = torch.tensor([lp for lp, _, _ in after["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, ref.max(-1).values, atol=1e-4)


def test_bad_requests_fail_clearly_and_keep_the_served_weights(engine):
    url, base, target, _ = engine
    name = "model.layers.1.self_attn.o_proj.weight"
    served = weights_of(url, name)
    version = greedy(url)["meta_info"]["weight_version"]
    with session(url):  # every update below is inside a session: only its own problems are refused
        _bad_requests_are_refused(url, name, served)
    assert torch.equal(weights_of(url, name), served)
    assert greedy(url)["meta_info"]["weight_version"] == version
    status, answer = post(url, "/get_weights_by_name", {"name": "model.nope.weight"})
    assert status == 400 and "no tensor 'model.nope.weight'" in answer["error"]["message"]


def _bad_requests_are_refused(url: str, name: str, served: torch.Tensor) -> None:
    status, body = post(url, "/update_weights_from_distributed",
                        {"names": [name], "dtypes": ["float32"], "shapes": [list(served.shape)], "group_name": "nope"})
    assert status == 400 and "no weight-update group named 'nope'" in body["message"]
    trainer = Trainer(url, "bad_requests")
    try:
        good = served + 1
        cases = [
            ([(name, torch.zeros(3, 3))], "shape [3, 3] != served"),
            ([(name, good.to(torch.float8_e4m3fn).view(torch.uint8))], "dtype uint8 cannot replace served float32"),
            ([(name, good), ("model.layers.9.mlp.up_proj.weight", torch.zeros(2))], "no such tensor"),
        ]
        for named, why in cases:
            status, body = trainer.update(named, version="bad")
            assert status == 400 and why in body["message"] and "weights unchanged" in body["message"], body
            assert torch.equal(weights_of(url, name), served)
        # the group stayed in step: a good update on it still works
        status, body = trainer.update([(name, good)])
        assert status == 200, body
        assert torch.equal(weights_of(url, name), good)
        status, body = trainer.update([(name, served)])
        assert status == 200, body
        # a broadcast that never comes: a clear error after the engine's timeout, never a hang
        t0 = time.monotonic()
        status, body = trainer.update([(name, good)], broadcast=False)
        waited = time.monotonic() - t0
        assert status == 400 and "did not complete" in body["message"] and "unchanged" in body["message"], body
        assert waited < ENGINE_TIMEOUT_S + 20
        status, body = post(url, "/update_weights_from_distributed", {
            "names": [name], "dtypes": ["float32"], "shapes": [list(served.shape)], "group_name": "bad_requests"})
        assert status == 400 and "no weight-update group" in body["message"]  # the broken group was dropped
    finally:
        destroy_weight_update_group(trainer.pg)
    for body, why in [({"names": [name], "dtypes": ["float99"], "shapes": [[1]]}, "not a torch dtype"),
                      ({"names": [name], "dtypes": ["float32"], "shapes": [[1], [2]]}, "1 names, 1 dtypes and 2 shapes"),
                      ({"names": [name], "dtypes": ["float32"], "shapes": [[-1]]}, "non-negative")]:
        status, answer = post(url, "/update_weights_from_distributed", body)
        assert status == 400 and why in answer["message"], answer
    for body, why in [({"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 0, "world_size": 2}, "rank 0 is the trainer"),
                      ({"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 2,
                        "backend": "nccl"}, "use backend=gloo")]:
        status, answer = post(url, "/init_weights_update_group", body)
        assert status == 400 and why in answer["message"], answer


def test_tensor_transport_with_memory_release(engine):
    from megatron_rl.rollout.sync import TensorWeightSync

    url, base, target, _ = engine
    tsd = {k: v for k, v in target.state_dict().items() if k != "lm_head.weight"}
    transport = TensorWeightSync([url], bucket_mb=0.01, timeout_s=30)
    transport.release_memory(["weights"])
    status, body = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert status == 503 and "released" in body["error"]["message"]
    transport.resume_memory(["weights"])
    items = list(tsd.items())
    transport.begin("t1")
    transport.begin_stage(0, 1, "t1")
    for k in range(0, len(items), 7):
        transport.send_bucket(items[k:k + 7], final=k + 7 >= len(items))
    transport.finish()
    for n, t in tsd.items():
        assert torch.equal(weights_of(url, n), t), n
    out = greedy(url)
    assert out["meta_info"]["weight_version"] == "t1"
    assert out["output_ids"] == teacher_forced_logprobs(target, PROMPT, out["output_ids"]).argmax(-1).tolist()
    garbage = {"serialized_named_tensors": ["bm90IGEgcGlja2xl"]}
    assert post(url, "/update_weights_from_tensor", garbage) == (400, {"success": False, "message": (
        "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()")})
    with session(url):
        status, body = post(url, "/update_weights_from_tensor", garbage)
    assert status == 400 and "cannot be read" in body["message"]


def test_disk_update_of_another_architecture_is_refused(engine):
    from megatron_rl.rollout.sync import DiskWeightSync

    url, base, target, root = engine
    other = make_tiny_model(str(root / "wide"), seed=1, hidden_size=96, num_hidden_layers=3)
    sync = DiskWeightSync(str(root / "sync"), str(root / "wide"), [url])
    name = "model.norm.weight"
    served = weights_of(url, name)
    from megatron_rl.rollout.client import RolloutServerError

    with pytest.raises(RolloutServerError, match="does not match the served architecture.*hidden_size: served 64.*has 96"):
        sync.push(other.state_dict(), "wide")
    assert torch.equal(weights_of(url, name), served)


def test_serializer_refuses_anything_but_tensors():
    import base64
    import pickle

    from megatron_rl.engine.tensor_payload import deserialize_named_tensors
    from megatron_rl.rollout.sync.serialization import serialize_named_tensors

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with pytest.raises(ValueError, match="builtins.print"):
        deserialize_named_tensors(base64.b64encode(pickle.dumps([("x", Evil())])).decode())
    t = torch.arange(6.0).reshape(2, 3).share_memory_()
    back = deserialize_named_tensors(serialize_named_tensors([("x", t)]))
    assert back[0][0] == "x" and torch.equal(back[0][1], t)


def test_every_response_names_the_weights_that_produced_it(tmp_path):
    """Updates land mid-flight (several buckets each, generation paused around them); each sample's tokens and
    log-probs are those of the version it reports."""
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.sync import TensorWeightSync
    from megatron_rl.engine.testing import ThreadedServer

    models = {0: make_tiny_model(str(tmp_path / "a"), seed=0), 1: make_tiny_model(str(tmp_path / "b"), seed=3)}
    states = {k: [(n, t) for n, t in m.state_dict().items() if n != "lm_head.weight"] for k, m in models.items()}
    with ThreadedServer(str(tmp_path / "a"), weight_version="v0") as server:
        transport = TensorWeightSync([server.url], bucket_mb=0.02, timeout_s=30, pause_mode="in_place")
        stop = threading.Event()

        def flip() -> None:
            v = 0
            while not stop.is_set():
                v += 1
                transport.begin(v)
                transport.begin_stage(0, 1, f"v{v}")
                items = states[v % 2]
                for k in range(0, len(items), 6):
                    transport.send_bucket(items[k:k + 6], final=k + 6 >= len(items))
                transport.finish()
                time.sleep(0.02)

        flipper = threading.Thread(target=flip)
        flipper.start()
        try:
            client = RolloutClient(server.url, concurrency=8)
            prompts = [[3 + i % 7, 4, 5 + i % 3] for i in range(48)]
            results = client.generate_batch_sync(prompts, {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
        finally:
            stop.set()
            flipper.join()
    versions = set()
    for prompt, (r,) in zip(prompts, results):
        v = int(r.weight_version.removeprefix("v"))
        versions.add(v)
        ref = teacher_forced_logprobs(models[v % 2], prompt, r.output_ids)
        assert r.output_ids == ref.argmax(-1).tolist(), (r.weight_version, prompt)
        assert torch.allclose(torch.tensor(r.logprobs), ref.max(-1).values, atol=1e-4)
    assert len(versions) > 2  # updates really happened while requests were in flight


def test_weights_cpu_backup_restores_the_served_weights_and_events_are_logged(tmp_path):
    """--enable-weights-cpu-backup (colocated engines): resume brings back the released weights, bit for bit; without
    it they come back zero-filled. /server_info lists release/resume/update/generate events in order."""
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.engine.testing import ThreadedServer

    make_tiny_model(str(tmp_path / "m"), seed=0)
    name = "model.layers.0.mlp.down_proj.weight"
    for backup in (True, False):
        with ThreadedServer(str(tmp_path / "m"), weights_cpu_backup=backup) as srv:
            before = weights_of(srv.url, name)
            assert post(srv.url, "/release_memory_occupation", {})[0] == 200
            assert post(srv.url, "/resume_memory_occupation", {})[0] == 200
            after = weights_of(srv.url, name)
            assert torch.equal(after, before) if backup else not after.any()
            greedy(srv.url, 2)
            info = RolloutClient(srv.url).server_info_sync()[0]
            assert info["enable_weights_cpu_backup"] is backup
            assert [e["event"] for e in info["events"]] == ["release", "resume", "generate"]
            assert [e["seq"] for e in info["events"]] == [1, 2, 3]


def test_non_finite_weights_are_refused_on_every_endpoint(engine, tmp_path):
    """NaN/inf weights are refused (400 naming the tensor) by /update_weights_from_distributed, _tensor and _disk, and
    the engine answers exactly as before: the same greedy tokens and log-probs, bit for bit, and the same version."""
    from megatron_rl.engine.weight_receiver import nonfinite_tensors
    from megatron_rl.rollout.sync.tensor import update_tensor_body

    url, _, _, _ = engine
    name = "model.layers.0.mlp.down_proj.weight"
    before = greedy(url)
    served = weights_of(url, name)
    nan, inf = served.clone(), served.clone()
    nan[1, 2], inf[0, 0] = float("nan"), -float("inf")
    trainer = Trainer(url, "finite")
    try:
        with session(url):
            distributed = trainer.update([(name, nan)], version="nan")
            tensor = post(url, "/update_weights_from_tensor", update_tensor_body([(name, inf.share_memory_())], 1, True, "inf"))
    finally:
        trainer.close()
    model = make_tiny_model(str(tmp_path / "nan"), seed=0)
    with torch.no_grad():
        dict(model.named_parameters())[name][3, 3] = float("nan")
    model.save_pretrained(str(tmp_path / "nan"))
    disk = post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "nan"), "weight_version": "nan"})
    for endpoint, (status, body) in (("distributed", distributed), ("tensor", tensor), ("disk", disk)):
        assert status == 400 and body["success"] is False, (endpoint, body)
        assert f"1 tensor(s) hold NaN/inf values: {name}" in body["message"] and "weights unchanged" in body["message"], body
    after = greedy(url)
    assert torch.equal(weights_of(url, name), served)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]
    nan = float("nan")
    fp8 = torch.tensor([1.0, 448.0, nan]).to(torch.float8_e4m3fn)
    assert nonfinite_tensors([("ok", fp8[:2]), ("fp8", fp8), ("ids", torch.tensor([1, 2])), ("empty", torch.empty(0)),
                              ("inf", torch.tensor([1.0, -float("inf")])), ("bf16", torch.tensor([nan, 1.0]).bfloat16()),
                              ("e5m2", torch.tensor([float("inf")]).to(torch.float8_e5m2))]) == ["fp8", "inf", "bf16", "e5m2"]
