"""RolloutClient: retries, bounded failure on dead servers, response validation (fake servers on 127.0.0.1)."""
import asyncio
import socket
import threading
import time

import pytest
from aiohttp import web

from megatron_rl.rollout.client import GenerateResult, RolloutClient, RolloutServerError, parse_generate_response


def dead_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens here now
    return port


class FakeServer:
    """aiohttp app in a thread; `handlers` maps path -> async handler."""

    def __init__(self, handlers):
        self.handlers = handlers
        self.hits = []

    def __enter__(self):
        ready = threading.Event()

        async def serve():
            app = web.Application()
            for path, h in self.handlers.items():
                async def wrapped(request, h=h):
                    self.hits.append(request.path)
                    return await h(request)
                app.router.add_route("*", path, wrapped)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            self.stop_event = asyncio.Event()
            ready.set()
            await self.stop_event.wait()
            await runner.cleanup()

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(serve(),), daemon=True)
        self.thread.start()
        assert ready.wait(10)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(10)


def sglang_obj(ids, lps, fr=None, version="v1"):
    return {"text": "", "output_ids": ids, "meta_info": {
        "id": "x", "finish_reason": fr or {"type": "length", "length": len(ids)}, "prompt_tokens": 2,
        "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": version,
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}}


def test_unreachable_port_raises_clear_error_in_bounded_time():
    port = dead_port()
    client = RolloutClient(f"http://127.0.0.1:{port}", max_retries=2, retry_backoff_s=0.05, request_timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(RolloutServerError) as info:
        client.generate_sync([1, 2, 3], {"max_new_tokens": 2})
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert f"127.0.0.1:{port}" in msg and "3 attempt" in msg and "last error" in msg
    assert elapsed < 5  # 3 refused connections + 0.05 + 0.1 s of backoff


def test_timeout_is_retried_then_reported():
    async def slow(request):
        await asyncio.sleep(1.0)  # well past the client's timeout; short so the fake server shuts down fast
        return web.json_response({})

    with FakeServer({"/generate": slow}) as fake:
        client = RolloutClient(fake.url, max_retries=1, retry_backoff_s=0.01, request_timeout_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(RolloutServerError, match="timed out"):
            client.generate_sync([1], {})
        assert time.monotonic() - t0 < 3
        assert fake.hits.count("/generate") == 2


def test_5xx_is_retried_with_backoff_then_succeeds():
    calls = {"n": 0}

    async def flaky(request):
        calls["n"] += 1
        if calls["n"] <= 2:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        body = await request.json()
        n = body["sampling_params"].get("n", 1)
        objs = [sglang_obj([4, 5], [-0.5, -1.0]) for _ in range(n)]
        return web.json_response(objs if n > 1 else objs[0])

    with FakeServer({"/generate": flaky}) as fake:
        client = RolloutClient(fake.url, max_retries=3, retry_backoff_s=0.1)
        t0 = time.monotonic()
        out = client.generate_sync([1, 2], {"n": 1})
        assert time.monotonic() - t0 >= 0.1 + 0.2 - 0.02  # two backoffs: 0.1 then 0.2 s
        assert calls["n"] == 3 and out[0].output_ids == [4, 5] and out[0].logprobs == [-0.5, -1.0]


def test_4xx_is_not_retried_and_message_is_kept():
    async def reject(request):
        return web.json_response({"error": {"message": "Unknown sampling parameter: 'zz'"}}, status=400)

    with FakeServer({"/generate": reject}) as fake:
        client = RolloutClient(fake.url, max_retries=3, retry_backoff_s=0.01)
        with pytest.raises(RolloutServerError, match="zz"):
            client.generate_sync([1], {"zz": 1})
        assert fake.hits.count("/generate") == 1


def test_generate_batch_respects_concurrency_and_order():
    state = {"now": 0, "peak": 0}

    async def gen(request):
        body = await request.json()
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.05)
        state["now"] -= 1
        tok = body["input_ids"][0]
        return web.json_response(sglang_obj([tok], [-0.1]))

    with FakeServer({"/generate": gen}) as fake:
        client = RolloutClient([fake.url, fake.url + "/"], concurrency=3)
        groups = client.generate_batch_sync([[i] for i in range(10)], {})
    assert [g[0].output_ids for g in groups] == [[i] for i in range(10)]
    assert 1 < state["peak"] <= 3


def test_wrong_sample_count_is_an_error():
    async def gen(request):
        return web.json_response(sglang_obj([3], [-0.1]))

    with FakeServer({"/generate": gen}) as fake:
        with pytest.raises(RolloutServerError, match="1 samples for n=2"):
            RolloutClient(fake.url).generate_sync([1], {"n": 2})


def test_wait_until_healthy_times_out_naming_url():
    async def unhealthy(request):
        return web.Response(status=503, text="loading")

    with FakeServer({"/health": unhealthy}) as fake:
        client = RolloutClient(fake.url)
        t0 = time.monotonic()
        with pytest.raises(RolloutServerError, match=fake.url.replace(".", r"\.")):
            client.wait_until_healthy_sync(0.6)
        assert time.monotonic() - t0 < 3
        assert client.health_sync() == {fake.url: False}


def test_weight_update_failure_is_raised():
    async def upd(request):
        return web.json_response({"success": False, "message": "shape mismatch"})

    with FakeServer({"/update_weights_from_disk": upd}) as fake:
        with pytest.raises(RolloutServerError, match="shape mismatch"):
            RolloutClient(fake.url).update_weights_from_disk_sync("/x", "3")


def test_flush_cache_retries_while_busy():
    calls = {"n": 0}

    async def flush(request):
        calls["n"] += 1
        return web.Response(status=400 if calls["n"] == 1 else 200, text="busy" if calls["n"] == 1 else "ok")

    with FakeServer({"/flush_cache": flush}) as fake:
        RolloutClient(fake.url, retry_backoff_s=0.01).flush_cache_sync()
    assert calls["n"] == 2


def test_parse_generate_response_accepts_sglang_shapes():
    r = parse_generate_response(sglang_obj([7, 1], [-0.2, -0.3], {"type": "stop", "matched": 1}, "12"))
    assert isinstance(r, GenerateResult)
    assert (r.output_ids, r.logprobs, r.finish_reason, r.weight_version, r.matched) == ([7, 1], [-0.2, -0.3], "stop", "12", 1)
    trimmed = sglang_obj([7, 1], [-0.2, -0.3], {"type": "stop", "matched": 1})
    trimmed["output_ids"] = [7]  # a server that trims the matched stop token from output_ids
    assert parse_generate_response(trimmed).output_ids == [7, 1]
    no_lp = {"output_ids": [3], "meta_info": {"finish_reason": {"type": "length", "length": 1}}}
    r2 = parse_generate_response(no_lp, want_logprobs=False)
    assert r2.logprobs == [] and r2.weight_version == ""


@pytest.mark.parametrize("mutate,needle", [
    (lambda o: o.pop("meta_info"), "meta_info"),
    (lambda o: o["meta_info"].update(finish_reason=None), "finish_reason"),
    (lambda o: o["meta_info"].update(finish_reason={"type": "weird"}), "finish_reason"),
    (lambda o: o["meta_info"].pop("output_token_logprobs"), "return_logprob"),
    (lambda o: o["meta_info"]["output_token_logprobs"].__setitem__(0, [0.5, 4, None]), "log-prob"),
    (lambda o: o["meta_info"]["output_token_logprobs"].__setitem__(0, "x"), r"output_token_logprobs\[0\]"),
    (lambda o: o.update(output_ids=[9, 9, 9]), "disagree"),
    (lambda o: o.update(output_ids="abc"), "output_ids"),
])
def test_parse_generate_response_rejects_malformed(mutate, needle):
    obj = sglang_obj([4, 5], [-0.5, -1.0])
    mutate(obj)
    with pytest.raises(RolloutServerError, match=needle):
        parse_generate_response(obj)
    with pytest.raises(RolloutServerError, match="JSON object"):
        parse_generate_response([obj])


@pytest.mark.parametrize("kwargs,needle", [({"urls": []}, "urls"), ({"urls": "localhost:1"}, "http"),
                                           ({"urls": "http://127.0.0.1:1", "concurrency": 0}, "concurrency"),
                                           ({"urls": "http://127.0.0.1:1", "max_retries": -1}, "max_retries")])
def test_bad_client_settings(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        RolloutClient(**kwargs)


def test_from_config_uses_rollout_config():
    from megatron_rl.config.rollout import RolloutConfig

    cfg = RolloutConfig(engine="external", urls=["http://127.0.0.1:9"], concurrency=5, max_retries=1)
    c = RolloutClient.from_config(cfg)
    assert c.urls == ["http://127.0.0.1:9"] and c.concurrency == 5 and c.max_retries == 1


def test_pack_calls_keeps_whole_prompts_in_order():
    from megatron_rl.rollout.client import pack_calls

    assert pack_calls([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert pack_calls([4, 4, 4], 1) == [[0], [1], [2]]  # a prompt asking for more than the cap gets a call of its own
    assert pack_calls([3, 9, 2, 2], 8) == [[0], [1], [2, 3]]
    assert pack_calls([], 8) == []


def test_batched_body_is_sglangs_list_form():
    from megatron_rl.rollout.client import batched_generate_body, generate_body

    body = batched_generate_body([generate_body([1, 2], {"n": 2, "sampling_seed": 5}, True),
                                  generate_body([3], {"n": 2, "sampling_seed": 6}, True)])
    assert body["input_ids"] == [[1, 2], [3]]
    assert [sp["sampling_seed"] for sp in body["sampling_params"]] == [5, 6]
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1 and "rid" not in body
    with pytest.raises(ValueError, match="share return_logprob"):
        batched_generate_body([generate_body([1], {}, True), generate_body([2], {}, False)])
