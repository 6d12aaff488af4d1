"""Embedded server over real HTTP on 127.0.0.1: SGLang response schema, batching, errors, weight updates."""
import asyncio
import json
import urllib.error
import urllib.request

import aiohttp
import pytest
import torch

from megatron_rl.rollout.client import RolloutClient, RolloutServerError, parse_generate_response
from megatron_rl.engine.testing import ThreadedServer, make_tiny_model, make_tiny_tokenizer, teacher_forced_logprobs

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("srv")
    model = make_tiny_model(str(root / "a"), seed=0)
    make_tiny_model(str(root / "b"), seed=1)
    make_tiny_tokenizer(str(root / "tok"))
    with ThreadedServer(str(root / "a"), str(root / "tok"), random_seed=0) as srv:
        yield srv, model, root


def post(url, path, body, timeout=30):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            return r.status, (json.loads(raw) if raw.strip().startswith(("{", "[")) else raw)
    except urllib.error.HTTPError as e:
        raw = e.read().decode()
        return e.code, (json.loads(raw) if raw.strip().startswith("{") else raw)


def get(url, path):
    try:
        with urllib.request.urlopen(url + path, timeout=30) as r:
            raw = r.read().decode()
            return r.status, (json.loads(raw) if raw.strip() else raw)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_response_schema(setup):
    srv, _, _ = setup
    status, out = post(srv.url, "/generate", {"input_ids": [5, 6, 7], "rid": "r1", "return_logprob": True,
                                              "return_text_in_logprobs": True,
                                              "sampling_params": {"max_new_tokens": 5, "temperature": 1.0}})
    assert status == 200 and isinstance(out, dict)
    meta = out["meta_info"]
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert meta["id"] == "r1" and meta["prompt_tokens"] == 3
    assert meta["completion_tokens"] == len(out["output_ids"]) and meta["cached_tokens"] == 0
    assert meta["weight_version"] == "default"
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(isinstance(e[0], float) and isinstance(e[2], str) for e in meta["output_token_logprobs"])
    res = parse_generate_response(out)
    assert res.output_ids == out["output_ids"] and res.weight_version == "default"


def test_batched_input_returns_list_and_n_is_prompt_major(setup):
    srv, _, _ = setup
    prompts = [[5, 6], [7, 8, 9], [10]]
    status, out = post(srv.url, "/generate", {"input_ids": prompts, "return_logprob": True,
                                              "sampling_params": {"max_new_tokens": 4, "n": 3, "sampling_seed": 4}})
    assert status == 200 and isinstance(out, list) and len(out) == 9
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2] * 3 + [3] * 3 + [1] * 3
    # the same prompt alone, same seed: its 3 samples are the adjacent block
    _, alone = post(srv.url, "/generate", {"input_ids": prompts[1], "sampling_params": {"max_new_tokens": 4, "n": 3, "sampling_seed": 4}})
    assert isinstance(alone, list) and [o["output_ids"] for o in alone] == [o["output_ids"] for o in out[3:6]]
    _, single = post(srv.url, "/generate", {"input_ids": [[5, 6]], "sampling_params": {"max_new_tokens": 2}})
    assert isinstance(single, list) and len(single) == 1


def test_logprobs_match_teacher_forced_forward_and_greedy_is_argmax(setup):
    srv, model, _ = setup
    prompts = [[3, 4, 5, 6, 7], [8, 9]]
    _, out = post(srv.url, "/generate", {"input_ids": prompts, "return_logprob": True,
                                         "sampling_params": {"max_new_tokens": 8, "temperature": 1.3, "top_p": 0.9,
                                                             "ignore_eos": True}})
    for p, o in zip(prompts, out):
        ref = teacher_forced_logprobs(model, p, o["output_ids"])
        got = torch.tensor([e[0] for e in o["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, ref.gather(-1, torch.tensor(o["output_ids"])[:, None])[:, 0], atol=1e-4)
    _, g = post(srv.url, "/generate", {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                                     "ignore_eos": True}})
    assert g["output_ids"] == teacher_forced_logprobs(model, prompts[0], g["output_ids"]).argmax(-1).tolist()


def test_finish_reasons_length_and_stop(setup):
    srv, model, _ = setup
    _, a = post(srv.url, "/generate", {"input_ids": [5, 9], "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                                                 "ignore_eos": True}})
    assert a["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    stop = a["output_ids"][1]
    _, b = post(srv.url, "/generate", {"input_ids": [5, 9], "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                                                 "stop_token_ids": [stop]}})
    assert b["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert b["output_ids"][-1] == stop and len(b["output_ids"]) == a["output_ids"].index(stop) + 1


def test_text_input_uses_tokenizer(setup):
    srv, _, _ = setup
    _, by_text = post(srv.url, "/generate", {"text": "w5 w6 w7", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    _, by_ids = post(srv.url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert by_text["output_ids"] == by_ids["output_ids"] and by_text["text"] == by_ids["text"]


@pytest.mark.parametrize("body,needle", [
    ({"input_ids": [1, 2], "sampling_params": {"not_a_key": 1}}, "not_a_key"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -2}}, "temperature"),
    ({"input_ids": [], "sampling_params": {}}, "input_ids"),
    ({"input_ids": [1, 999]}, "outside"),
    ({"sampling_params": {}}, "input_ids or text"),
    ({"input_ids": [1], "logprob_start_len": 0}, "logprob_start_len"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [[1], [2]], "stream": True}, "stream"),
])
def test_bad_requests_get_400_naming_the_problem(setup, body, needle):
    srv, _, _ = setup
    status, out = post(srv.url, "/generate", body)
    assert status == 400 and needle in out["error"]["message"]


def test_malformed_json_is_400(setup):
    srv, _, _ = setup
    status, out = post(srv.url, "/generate", b"{not json")
    assert status == 400 and "JSON" in out["error"]["message"]


def test_stream_sends_sse_and_done(setup):
    srv, _, _ = setup
    req = urllib.request.Request(srv.url + "/generate", data=json.dumps(
        {"input_ids": [3, 4], "stream": True, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(json.loads(events[0])["output_ids"]) == 2


def test_info_and_health_endpoints(setup):
    srv, _, root = setup
    assert get(srv.url, "/health")[0] == 200
    assert get(srv.url, "/health_generate")[0] == 200
    for path in ("/model_info", "/get_model_info"):
        status, info = get(srv.url, path)
        assert status == 200 and info["model_path"] == str(root / "a") and info["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        status, info = get(srv.url, path)
        assert status == 200 and info["dp_size"] == 1 and "weight_version" in info
    status, text = post(srv.url, "/flush_cache", {})
    assert status == 200 and "flushed" in text.lower()


def test_concurrent_requests_are_batched_and_each_answered(setup):
    srv, _, _ = setup
    before = srv.server.batches_run

    async def run():
        async with aiohttp.ClientSession() as s:
            async def one(i):
                async with s.post(srv.url + "/generate", json={"input_ids": [3 + i, 4], "rid": f"c{i}",
                                                                "sampling_params": {"max_new_tokens": 3}}) as r:
                    return await r.json()
            return await asyncio.gather(*(one(i) for i in range(16)))

    outs = asyncio.run(run())
    assert [o["meta_info"]["id"] for o in outs] == [f"c{i}" for i in range(16)]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [2] * 16
    assert srv.server.batches_run - before < 16  # some requests shared a batch


def test_update_weights_from_disk_changes_outputs_and_version(setup):
    srv, _, root = setup
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    _, before = post(srv.url, "/generate", body)
    status, ans = post(srv.url, "/update_weights_from_disk", {"model_path": str(root / "b"), "load_format": None,
                                                               "flush_cache": True, "weight_version": "v7"})
    try:
        assert status == 200 and ans["success"] is True
        _, after = post(srv.url, "/generate", body)
        assert after["meta_info"]["weight_version"] == "v7"
        assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
        assert get(srv.url, "/model_info")[1]["weight_version"] == "v7"
        status, bad = post(srv.url, "/update_weights_from_disk", {"model_path": str(root / "nope"), "weight_version": "v8"})
        assert status == 400 and bad["success"] is False and "nope" in bad["message"]
        _, still = post(srv.url, "/generate", body)
        assert still["meta_info"]["weight_version"] == "v7" and still["output_ids"] == after["output_ids"]
    finally:
        post(srv.url, "/update_weights_from_disk", {"model_path": str(root / "a"), "weight_version": "default"})


def test_update_weight_version(setup):
    srv, _, _ = setup
    status, ans = post(srv.url, "/update_weight_version", {"new_version": "x1"})
    try:
        assert status == 200 and ans["success"]
        _, out = post(srv.url, "/generate", {"input_ids": [3], "sampling_params": {"max_new_tokens": 1}})
        assert out["meta_info"]["weight_version"] == "x1"
    finally:
        post(srv.url, "/update_weight_version", {"new_version": "default"})


def test_pause_abort_and_continue(setup):
    srv, _, _ = setup

    async def run():
        async with aiohttp.ClientSession() as s:
            async with s.post(srv.url + "/pause_generation", json={"mode": "in_place"}) as r:
                assert r.status == 200
            pending = asyncio.ensure_future(s.post(srv.url + "/generate", json={
                "input_ids": [3, 4], "rid": "held", "sampling_params": {"max_new_tokens": 2}}))
            await asyncio.sleep(0.3)
            assert not pending.done()  # held while paused
            async with s.post(srv.url + "/abort_request", json={"rid": "held"}) as r:
                assert r.status == 200
            async with s.post(srv.url + "/continue_generation", json={}) as r:
                assert r.status == 200
            resp = await asyncio.wait_for(pending, 10)
            return await resp.json()

    out = asyncio.run(run())
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"] == []
    _, ok = post(srv.url, "/generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}})
    assert ok["meta_info"]["finish_reason"]["type"] == "length"


def test_client_against_server(setup):
    srv, model, _ = setup
    client = RolloutClient(srv.url, concurrency=4, request_timeout_s=30)
    client.wait_until_healthy_sync(10)
    prompts = [[3, 4], [5, 6, 7], [8]]
    groups = client.generate_batch_sync(prompts, {"max_new_tokens": 5, "n": 2, "temperature": 1.0})
    assert [len(g) for g in groups] == [2, 2, 2]
    for p, g in zip(prompts, groups):
        for r in g:
            ref = teacher_forced_logprobs(model, p, r.output_ids)
            assert torch.allclose(torch.tensor(r.logprobs), ref.gather(-1, torch.tensor(r.output_ids)[:, None])[:, 0], atol=1e-4)
            sample = r.to_sample(p, group_id=0)
            assert sample.response_ids == r.output_ids and sample.finish_reason in ("stop", "length")
    assert client.health_sync() == {srv.url: True}
    assert client.server_info_sync()[0]["dp_size"] == 1
    client.flush_cache_sync()
    with pytest.raises(RolloutServerError, match="not_a_key"):
        client.generate_sync([3], {"not_a_key": 1})
