"""Which URLs generate and which receive weights; sglang-router detection; the live set of weight-sync targets.

Generation goes to `rollout.urls` (a router, or engines the client spreads requests over); weight
updates go to engines only, because sglang-router answers 404 to /update_weights_*,
/pause_generation and /release_memory_occupation. A router is recognised by asking it:
`GET /workers` answers `{"workers": [{"url": ..., "is_healthy": ...}, ...]}` on sglang-router
(older routers: `GET /list_workers` -> `{"urls": [...]}`), while an SGLang engine answers 404
there (it serves /model_info, which the router does not).

What happens when an engine dies or hangs mid-rollout, layer by layer:
1. sglang-router (when there is one): a /generate that fails on a worker (connection error or a
   retryable status) is retried on another worker (`--retry-max-retries`, default 5, exponential
   backoff); the worker leaves the rotation after `--health-failure-threshold` failed health
   checks (the launcher sets 2 checks 5 s apart) and the circuit breaker opens after
   `--cb-failure-threshold` failures. Requests are whole prompts with their n and sampling_seed,
   so a retried request yields the same samples the dead worker would have produced.
2. RolloutClient: with several engine URLs (no router) a request failing on one engine is re-sent
   whole to another live engine, and an engine that refused the connection or timed out is marked
   dead for the rest of the run; behind a router it retries the router. Each prompt's samples are
   taken from exactly one answer, so every GRPO group has exactly n samples, none duplicated.
3. EnginePool, before every weight sync: health-checks every weight target; an engine this run
   started is restarted on its port (rollout.restart_dead_engines) and receives the new weights
   with the others; any other dead engine is dropped from the targets with a warning; no live
   target left is an error.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
import warnings
from typing import Any, Optional, Sequence

from megatron_rl.config import ConfigError


def _get_json(url: str, timeout_s: float, api_key: Optional[str] = None) -> tuple[int, Any]:
    """(HTTP status, parsed JSON body or None) of a GET (with the bearer key, if any); raises URLError/OSError when unreachable."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as resp:
            body = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        return exc.code, None
    try:
        return status, json.loads(body or b"null")
    except ValueError:
        return status, None


def router_workers(url: str, timeout_s: float = 5.0, healthy_only: bool = False,
                   api_key: Optional[str] = None) -> Optional[list[str]]:
    """The worker URLs an sglang-router at `url` lists, or None when `url` is not a router (an engine).

    A router started with --api-key guards its worker list too: pass the key (rollout.api_key).

    Raises URLError/OSError when nothing answers at `url`.
    """
    base = url.rstrip("/")
    status, data = _get_json(base + "/workers", timeout_s, api_key)
    if status == 200 and isinstance(data, dict) and isinstance(data.get("workers"), list):
        out = []
        for w in data["workers"]:
            if isinstance(w, dict) and isinstance(w.get("url"), str):
                if healthy_only and not w.get("is_healthy", w.get("healthy", True)):
                    continue
                out.append(w["url"].rstrip("/"))
        return out
    status, data = _get_json(base + "/list_workers", timeout_s, api_key)
    if status == 200 and isinstance(data, dict) and isinstance(data.get("urls"), list):
        return [str(u).rstrip("/") for u in data["urls"]]
    return None


def is_router(url: str, timeout_s: float = 5.0, api_key: Optional[str] = None) -> bool:
    """Whether `url` is an sglang-router (it lists workers) rather than an engine."""
    return router_workers(url, timeout_s, api_key=api_key) is not None


def _probe(field: str, url: str, timeout_s: float, api_key: Optional[str] = None) -> Optional[list[str]]:
    """router_workers with a config-level error when `url` does not answer."""
    try:
        return router_workers(url, timeout_s, api_key=api_key)
    except (urllib.error.URLError, OSError) as exc:
        raise ConfigError(f"rollout.{field}: {url} does not answer ({exc}); start the servers first or fix the URL") from None


def resolve_external(urls: Sequence[str], weight_update_urls: Sequence[str] = (),
                     timeout_s: float = 5.0, api_key: Optional[str] = None) -> tuple[list[str], list[str]]:
    """(generation URLs, weight-update URLs) of rollout.engine=external.

    Weight targets are `weight_update_urls` when given (each checked not to be a router), else the
    workers of every router in `urls` plus the `urls` that are engines themselves.
    """
    gen = [u.rstrip("/") for u in urls]
    targets: list[str] = []
    for u in weight_update_urls:
        workers = _probe("weight_update_urls", u, timeout_s, api_key)
        if workers is not None:
            raise ConfigError(
                f"rollout.weight_update_urls: {u} is an sglang-router, which does not forward weight updates; "
                f"list its engines in rollout.weight_update_urls (it reports {workers}) or leave the field empty "
                "to use the router's worker list")
        targets.append(u.rstrip("/"))
    if weight_update_urls:
        return gen, targets
    for u in gen:
        workers = _probe("urls", u, timeout_s, api_key)
        if workers is None:
            targets.append(u)
        elif not workers:
            raise ConfigError(f"rollout.urls: the sglang-router at {u} lists no workers; set rollout.weight_update_urls "
                              "to the engines that serve it")
        else:
            targets.extend(workers)
    return gen, list(dict.fromkeys(targets))


class EnginePool:
    """The engines that receive weights; before each sync, dead ones are restarted (ours) or dropped (external).

    `cluster` is the RolloutCluster when this run started the engines, `generation_client` the
    client spreading /generate over engines (told which engines are back or gone), if any.
    """

    def __init__(self, urls: Sequence[str], cluster=None, restart: bool = True, generation_client=None,
                 health_timeout_s: float = 5.0):
        """Validate and hold the weight targets."""
        if not urls:
            raise ValueError("EnginePool needs at least one engine URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.cluster = cluster
        self.restart = restart
        self.generation_client = generation_client
        self.health_timeout_s = health_timeout_s
        self.dropped: list[str] = []
        self.restarted: list[str] = []

    def refresh(self) -> list[str]:
        """Health-check every target; restart or drop the dead ones; return the live targets."""
        from megatron_rl.rollout.client import RolloutClient

        health = RolloutClient(self.urls, request_timeout_s=self.health_timeout_s, max_retries=0).health_sync()
        live = []
        for url in self.urls:
            if health.get(url):
                live.append(url)
            elif self.cluster is not None and self.restart and self.cluster.owns(url):
                warnings.warn(f"rollout engine {url} is dead; restarting it (it gets the new weights with the others)",
                              RuntimeWarning, stacklevel=2)
                self.cluster.restart_engine(url)
                self.restarted.append(url)
                live.append(url)
                if self.generation_client is not None:
                    self.generation_client.revive(url)
            else:
                warnings.warn(f"rollout engine {url} is dead; dropped from weight-sync targets "
                              f"({len(self.urls) - 1} left)", RuntimeWarning, stacklevel=2)
                self.dropped.append(url)
                if self.generation_client is not None:
                    self.generation_client.mark_dead(url, "dropped from the weight-sync targets")
        if not live:
            raise RuntimeError(f"no live rollout engine left (dead: {self.urls})")
        self.urls = live
        return list(live)


def retarget(transport, urls: Sequence[str]) -> None:
    """Point a weight-sync transport at `urls` (the live engines)."""
    if hasattr(transport, "set_worker_urls"):
        transport.set_worker_urls(list(urls))
    else:
        transport.client.urls = list(urls)


class PooledTransport:
    """A weight-sync transport whose targets are refreshed from an EnginePool before every push."""

    def __init__(self, transport, pool: EnginePool):
        """Wrap `transport`; its targets become the pool's live engines."""
        self.transport = transport
        self.pool = pool

    def push(self, *args, **kwargs):
        """Refresh the targets (restart/drop dead engines), then push through the wrapped transport."""
        retarget(self.transport, self.pool.refresh())
        return self.transport.push(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.transport, name)
