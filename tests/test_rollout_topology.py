"""Rollout topology: generation endpoint vs weight receivers, router detection, and no lost sample when an
engine dies mid-rollout (client failover, the real sglang-router's retries, EnginePool restart/drop)."""
import asyncio
import importlib.util
import os
import signal
import socket
import threading
import time
import warnings

import pytest
import torch
from aiohttp import web

from megatron_rl.config import ConfigError
from megatron_rl.rollout.client import RolloutClient, RolloutServerError
from megatron_rl.rollout.topology import EnginePool, PooledTransport, resolve_external, router_workers

torch.set_num_threads(1)
needs_router = pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="needs sglang-router")


def dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


class Fake:
    """An aiohttp server in a thread: /health, and /generate answering n samples derived from the body."""

    def __init__(self, hang_s: float = 0.0):
        self.hang_s = hang_s
        self.bodies = []

    async def generate(self, request):
        body = await request.json()
        self.bodies.append(body)
        if self.hang_s:
            await asyncio.sleep(self.hang_s)
        sp = body["sampling_params"]
        seed = sp["sampling_seed"]
        return web.json_response([
            {"output_ids": [seed, j], "meta_info": {"id": "x", "finish_reason": {"type": "length", "length": 2},
                                                    "weight_version": "0",
                                                    "output_token_logprobs": [[-0.5, seed, None], [-0.25, j, None]]}}
            for j in range(sp["n"])])

    async def health(self, request):
        return web.Response(text="")

    def __enter__(self):
        ready = threading.Event()

        async def serve():
            app = web.Application()
            app.router.add_post("/generate", self.generate)
            app.router.add_get("/health", self.health)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            self.stop = asyncio.Event()
            ready.set()
            await self.stop.wait()
            await runner.cleanup()

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(serve(),), daemon=True)
        self.thread.start()
        assert ready.wait(10)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


def test_client_resends_whole_prompts_to_survivors():
    dead = dead_url()
    with Fake() as good, Fake(hang_s=5.0) as hung:
        client = RolloutClient([dead, hung.url, good.url], concurrency=4, request_timeout_s=0.5, max_retries=2,
                               retry_backoff_s=0.01)
        params = [{"n": 3, "sampling_seed": 100 + k, "max_new_tokens": 2} for k in range(9)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            groups = client.generate_batch_sync([[1, 2]] * 9, params)
        # every group: exactly n samples, from one answer to that prompt's own request (same seed)
        for k, g in enumerate(groups):
            assert [r.output_ids for r in g] == [[100 + k, j] for j in range(3)]
        assert sorted(b["sampling_params"]["sampling_seed"] for b in good.bodies) == list(range(100, 109))
        assert client.dead == {dead, hung.url}
        assert sum("failed" in str(w.message) for w in caught) == 2  # one warning per dead engine
        # the last live engine gets the full retry budget, and an all-dead client says so
        with pytest.warns(RuntimeWarning, match=f"{good.url} failed"):
            client.mark_dead(good.url, "test")
        with pytest.raises(RolloutServerError, match="every rollout server"):
            client.generate_sync([1, 2], {"n": 1, "sampling_seed": 1})


def test_single_url_is_retried_not_failed_over():
    with Fake() as good:
        client = RolloutClient([good.url], max_retries=0)
        assert len(client.generate_sync([1], {"n": 2, "sampling_seed": 3})) == 2
        assert client.dead == set()


class FakeCluster:
    def __init__(self, urls):
        self.urls = urls
        self.restarted = []

    def owns(self, url):
        return url in self.urls

    def restart_engine(self, url):
        self.restarted.append(url)


class FakeTransport:
    def __init__(self, urls):
        self.client = RolloutClient(urls)
        self.pushed = []

    def push(self, tensors, version):
        self.pushed.append((list(self.client.urls), version))


def test_engine_pool_restarts_ours_and_drops_external():
    with Fake() as alive:
        ours, theirs = dead_url(), dead_url()
        gen = RolloutClient([alive.url, ours, theirs])
        gen.dead.add(ours)
        pool = EnginePool([alive.url, ours, theirs], cluster=FakeCluster([ours]), generation_client=gen)
        transport = PooledTransport(FakeTransport([alive.url, ours, theirs]), pool)
        with pytest.warns(RuntimeWarning) as caught:
            transport.push({}, 3)
        msgs = " ".join(str(w.message) for w in caught)
        assert f"{ours} is dead; restarting" in msgs and f"{theirs} is dead; dropped" in msgs
        assert pool.cluster.restarted == [ours]
        assert transport.transport.pushed == [([alive.url, ours], 3)]
        assert gen.dead == {theirs}  # the restarted engine generates again, the dropped one not
        no_restart = EnginePool([theirs], cluster=FakeCluster([theirs]), restart=False)
        with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="no live rollout engine"):
            no_restart.refresh()


def test_resolve_external_without_router():
    with Fake() as a, Fake() as b:
        assert resolve_external([a.url, b.url]) == ([a.url, b.url], [a.url, b.url])
        assert resolve_external([a.url], [b.url]) == ([a.url], [b.url])
    with pytest.raises(ConfigError, match="rollout.urls: http://127.0.0.1:.* does not answer"):
        resolve_external([dead_url()])


@needs_router
def test_router_is_recognised_and_never_a_weight_target(tmp_path):
    from megatron_rl.rollout.launcher import start_router
    from megatron_rl.engine.testing import ThreadedServer, make_tiny_model

    make_tiny_model(str(tmp_path / "m"))
    with ThreadedServer(str(tmp_path / "m")) as engine:
        router = start_router([engine.url], log_dir=str(tmp_path), startup_timeout_s=60)
        try:
            assert router_workers(router.url) == [engine.url]
            assert router_workers(engine.url) is None
            # the router as the generation endpoint: its workers receive the weights
            assert resolve_external([router.url]) == ([router.url], [engine.url])
            with pytest.raises(ConfigError, match=r"rollout.weight_update_urls: .* is an sglang-router.*" + engine.url):
                resolve_external([router.url], [router.url])
            # a transport pointed at the router by hand is refused with the field to set, not a bare 404
            from megatron_rl.rollout.sync import DiskWeightSync

            sync = DiskWeightSync(str(tmp_path / "sync"), str(tmp_path / "m"), [router.url])
            with pytest.raises(RolloutServerError, match="is an sglang-router.*set rollout.weight_update_urls"):
                sync.push({"lm_head.weight": torch.zeros(1)}, 1)
        finally:
            router.stop()


@pytest.mark.slow
@needs_router
def test_sigkilled_engine_loses_no_sample(tmp_path):
    """Two slow embedded engines behind the real router; one is SIGKILLed mid-rollout; then weight sync restarts it."""
    from megatron_rl.rollout.launcher import launch_engines
    from megatron_rl.rollout.sync import DiskWeightSync
    from megatron_rl.engine.testing import make_tiny_model

    make_tiny_model(str(tmp_path / "m"), seed=0)
    new = make_tiny_model(str(tmp_path / "new"), seed=9)
    prompts = [[3 + k, 4, 5 + k] for k in range(8)]
    params = [{"n": 2, "max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 50 + k}
              for k in range(8)]
    with launch_engines(str(tmp_path / "m"), 2, use_router=True, deterministic=True, startup_timeout_s=120,
                        log_dir=str(tmp_path / "logs"), model_loader="megatron_rl.engine.testing:load_slow_model") as cluster:
        via_router = RolloutClient(cluster.generate_url, concurrency=4, max_retries=0)
        reference = via_router.generate_batch_sync(prompts, params)

        def kill_when_busy(engine):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                info = RolloutClient(engine.url, max_retries=0).server_info_sync()[0]["internal_states"][0]
                if info["running_requests"] or info["queued_requests"]:
                    os.kill(engine.proc.pid, signal.SIGKILL)
                    return
                time.sleep(0.02)

        # 1) behind the router: the router re-sends the dead engine's requests to the survivor
        killer = threading.Thread(target=kill_when_busy, args=(cluster.engines[0],))
        killer.start()
        after_kill = via_router.generate_batch_sync(prompts, params)
        killer.join()
        assert cluster.engines[0].proc.poll() is not None, "engine 0 was not killed mid-rollout"
        _assert_same_groups(after_kill, reference)

        # 2) weight sync: the dead engine (ours) is restarted and receives the new weights with the other
        transport = PooledTransport(DiskWeightSync(str(tmp_path / "sync"), str(tmp_path / "m"), cluster.worker_urls),
                                    EnginePool(cluster.worker_urls, cluster))
        with pytest.warns(RuntimeWarning, match="is dead; restarting"):
            transport.push(new.state_dict(), 1)
        assert cluster.engines[0].restarts == 1
        versions = RolloutClient(cluster.worker_urls).weight_versions_sync()  # /model_info: where 0.5.23 reports it
        assert versions == ["1", "1"]

        # 3) without a router the client itself re-sends to the survivor
        direct = RolloutClient(cluster.worker_urls, concurrency=4, max_retries=0)
        reference = direct.generate_batch_sync(prompts, params)
        killer = threading.Thread(target=kill_when_busy, args=(cluster.engines[1],))
        killer.start()
        with pytest.warns(RuntimeWarning, match="failed"):
            after_kill = direct.generate_batch_sync(prompts, params)
        killer.join()
        assert cluster.engines[1].proc.poll() is not None
        assert direct.dead == {cluster.engines[1].url}
        _assert_same_groups(after_kill, reference)
        assert all(r.weight_version == "1" for g in after_kill for r in g)
    for proc in cluster.engines + [cluster.router]:
        assert proc.proc.poll() is not None


def _assert_same_groups(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert len(g) == len(w) == 2  # exactly n samples per group
        assert [r.output_ids for r in g] == [r.output_ids for r in w]  # same seeds: the same samples, none duplicated
        assert [r.logprobs for r in g] == [r.logprobs for r in w]
