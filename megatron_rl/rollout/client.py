"""HTTP client of SGLang-protocol rollout servers (real SGLang, the sglang-router, or the embedded engine).

Never imports sglang. Every request has a timeout; connection errors, timeouts and 5xx answers
are retried with exponential backoff, after which `RolloutServerError` names the URL and the
last error. With several URLs (engines without a router), a /generate that fails on one engine
is re-sent whole (same prompt, n and sampling_seed) to another live engine after one attempt,
and an engine that refused the connection or timed out is marked dead (rollout/topology.py
describes every layer of this). Async methods are the primitives; `*_sync` wrappers serve the
training loop.

    client = RolloutClient(["http://127.0.0.1:30000"], concurrency=8)
    client.wait_until_healthy_sync(60)
    groups = client.generate_batch_sync(prompts, {"temperature": 1.0, "n": 8, "max_new_tokens": 64})
"""
from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Awaitable, Mapping, Optional, Sequence, TypeVar, Union

import aiohttp

T = TypeVar("T")
FINISH_TYPES = ("stop", "length", "abort")


class RolloutServerError(RuntimeError):
    """A rollout server could not be reached, kept failing, or answered something malformed."""


class ServerUnavailableError(RolloutServerError):
    """A server failed every attempt with a connection error, timeout or 5xx (not a rejected request)."""

    def __init__(self, message: str, engine_down: bool):
        super().__init__(message)
        self.engine_down = engine_down
        """True when the last failure was a refused/broken connection or a timeout (the engine is gone or hung)."""


@dataclass
class GenerateResult:
    """One generated sample, parsed from an SGLang /generate response object."""

    output_ids: list[int]
    """Generated token ids."""
    logprobs: list[float]
    """Per-token log-probs reported by the engine (empty when return_logprob was off)."""
    finish_reason: str
    """'stop', 'length' or 'abort'."""
    weight_version: str
    """meta_info.weight_version (empty string if the server does not report one)."""
    text: Optional[str] = None
    """Decoded completion, when the server has a tokenizer."""
    matched: Any = None
    """The stop token id or string that ended generation (finish_reason 'stop')."""
    meta_info: dict = field(default_factory=dict)
    """The raw meta_info."""

    def to_sample(self, prompt_ids: list[int], group_id: int, answer: Any = None):
        """This result as a `megatron_rl.types.Sample`."""
        from megatron_rl.types import Sample

        return Sample(prompt_ids=list(prompt_ids), response_ids=list(self.output_ids),
                      rollout_logprobs=list(self.logprobs), finish_reason=self.finish_reason,
                      group_id=group_id, answer=answer, weight_version=self.weight_version,
                      response_text=self.text or "")


def _bad(msg: str) -> RolloutServerError:
    return RolloutServerError(f"malformed /generate response: {msg}")


def parse_generate_response(obj: Any, want_logprobs: bool = True) -> GenerateResult:
    """Validate one SGLang /generate response object and return its GenerateResult.

    With logprobs the token ids come from meta_info.output_token_logprobs (one entry per
    generated token); `output_ids`, when present, must agree with them (it may omit a trailing
    matched stop token).
    """
    if not isinstance(obj, dict):
        raise _bad(f"expected a JSON object, got {type(obj).__name__}")
    meta = obj.get("meta_info")
    if not isinstance(meta, dict):
        raise _bad("meta_info is missing or not an object")
    fr = meta.get("finish_reason")
    if not isinstance(fr, dict) or fr.get("type") not in FINISH_TYPES:
        raise _bad(f"meta_info.finish_reason={fr!r} is not an object with type in {FINISH_TYPES}")
    output_ids = obj.get("output_ids")
    if output_ids is not None and (not isinstance(output_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in output_ids)):
        raise _bad("output_ids must be a list of integers")
    logprobs: list[float] = []
    if want_logprobs:
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list):
            raise _bad("meta_info.output_token_logprobs is missing (was return_logprob sent?)")
        ids = []
        for k, e in enumerate(entries):
            if not isinstance(e, (list, tuple)) or len(e) < 2 or not isinstance(e[1], int):
                raise _bad(f"output_token_logprobs[{k}]={e!r} is not [logprob, token_id, text]")
            lp = e[0]
            if not isinstance(lp, (int, float)) or isinstance(lp, bool) or math.isnan(lp) or lp > 1e-4:
                raise _bad(f"output_token_logprobs[{k}] has an invalid log-prob {lp!r}")
            logprobs.append(float(lp))
            ids.append(int(e[1]))
        if output_ids is not None and output_ids != ids and output_ids != ids[:-1]:
            raise _bad(f"output_ids ({len(output_ids)} tokens) disagree with output_token_logprobs ({len(ids)} tokens)")
        output_ids = ids
    elif output_ids is None:
        raise _bad("output_ids is missing (start the server with token output, or request return_logprob)")
    version = meta.get("weight_version")
    text = obj.get("text")
    return GenerateResult(output_ids=list(output_ids), logprobs=logprobs, finish_reason=fr["type"],
                          weight_version="" if version is None else str(version),
                          text=text if isinstance(text, str) else None, matched=fr.get("matched"), meta_info=meta)


def generate_body(input_ids: list[int], sampling_params: Optional[Mapping], return_logprob: bool,
                  rid: Optional[str] = None) -> dict:
    """The /generate body (GenerateReqInput) of one prompt: token ids in, log-probs of the sampled tokens out."""
    if hasattr(sampling_params, "model_dump"):
        sampling_params = sampling_params.model_dump()
    body: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params or {}),
                            "return_logprob": return_logprob, "logprob_start_len": -1}
    if rid is not None:
        body["rid"] = rid
    return body


def batched_generate_body(bodies: Sequence[dict]) -> dict:
    """One batched /generate body (GenerateReqInput with a list of prompts) from single-prompt `generate_body`s."""
    flags = {(b["return_logprob"], b["logprob_start_len"]) for b in bodies}
    if len(flags) != 1:
        raise ValueError("prompts of one batched /generate call must share return_logprob and logprob_start_len")
    body: dict[str, Any] = {"input_ids": [b["input_ids"] for b in bodies],
                            "sampling_params": [b["sampling_params"] for b in bodies],
                            "return_logprob": bodies[0]["return_logprob"],
                            "logprob_start_len": bodies[0]["logprob_start_len"]}
    if any("rid" in b for b in bodies):
        body["rid"] = [b.get("rid") for b in bodies]
    return body


def _n_of(sampling_params: Optional[Mapping]) -> int:
    """Samples one prompt asks for (SGLang's default n is 1)."""
    if hasattr(sampling_params, "model_dump"):
        sampling_params = sampling_params.model_dump()
    return int((sampling_params or {}).get("n", 1) or 1)


def pack_calls(samples_per_prompt: Sequence[int], sequences_per_request: int) -> list[list[int]]:
    """Prompt indices of each /generate call: consecutive whole prompts while their samples fit
    `sequences_per_request` (a prompt asking for more gets a call of its own)."""
    calls: list[list[int]] = []
    used = 0
    for k, n in enumerate(samples_per_prompt):
        if not calls or used + n > sequences_per_request:
            calls.append([])
            used = 0
        calls[-1].append(k)
        used += n
    return calls


def disk_update_body(model_path: str, weight_version: Optional[Any] = None, load_format: Optional[str] = None,
                     flush_cache: bool = True) -> dict:
    """The /update_weights_from_disk body (UpdateWeightFromDiskReqInput)."""
    body: dict[str, Any] = {"model_path": model_path, "load_format": load_format, "flush_cache": flush_cache}
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


def weight_version_body(new_version: Any, abort_all_requests: bool = False) -> dict:
    """The /update_weight_version body (UpdateWeightVersionReqInput)."""
    return {"new_version": str(new_version), "abort_all_requests": abort_all_requests}


def run_sync(coro: Awaitable[T]) -> T:
    """Run a coroutine to completion from synchronous code (in a helper thread if a loop is already running here)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class RolloutClient:
    """Talks SGLang's native HTTP protocol to one or more servers (round-robin over `urls`)."""

    def __init__(self, urls: Union[str, Sequence[str]], concurrency: int = 8, request_timeout_s: float = 120.0,
                 max_retries: int = 3, retry_backoff_s: float = 0.5, connect_timeout_s: float = 10.0,
                 api_key: Optional[str] = None, sequences_per_request: int = 1):
        """Validate settings; no connection is made until a request.

        api_key: sent as `Authorization: Bearer <api_key>` on every request (servers started with --api-key).
        sequences_per_request: `generate_batch` packs whole prompts into one batched /generate call (SGLang's
        list-of-prompts GenerateReqInput) while their samples (prompts x n) fit this many; 1 sends one call per prompt.
        """
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("urls must list at least one server URL")
        for u in urls:
            if not isinstance(u, str) or not u.startswith(("http://", "https://")):
                raise ValueError(f"urls: {u!r} is not an http(s) URL")
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if retry_backoff_s < 0:
            raise ValueError("retry_backoff_s must be >= 0")
        if sequences_per_request < 1:
            raise ValueError("sequences_per_request must be >= 1")
        self.sequences_per_request = sequences_per_request
        self.urls = [u.rstrip("/") for u in urls]
        self.concurrency = concurrency
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.connect_timeout_s = min(connect_timeout_s, request_timeout_s)
        self._rr = itertools.count()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.dead: set[str] = set()
        """URLs given up on for /generate (their requests go to the other URLs)."""

    @classmethod
    def from_config(cls, cfg, urls: Optional[Sequence[str]] = None) -> "RolloutClient":
        """A client built from a `RolloutConfig` (urls default to cfg.urls)."""
        return cls(list(urls) if urls is not None else cfg.urls, concurrency=cfg.concurrency,
                   request_timeout_s=cfg.request_timeout_s, max_retries=cfg.max_retries,
                   retry_backoff_s=cfg.retry_backoff_s, api_key=cfg.api_key,
                   sequences_per_request=cfg.resolved_sequences_per_request)

    # ---------------------------------------------------------------------------- transport
    def _session(self) -> aiohttp.ClientSession:
        """A session for one top-level call (sessions are bound to their event loop)."""
        connector = aiohttp.TCPConnector(limit=max(self.concurrency, 1) * len(self.urls))
        return aiohttp.ClientSession(connector=connector, headers=self._headers)

    async def _request(self, session: aiohttp.ClientSession, url: str, method: str, path: str,
                       payload: Optional[dict] = None, timeout_s: Optional[float] = None,
                       retry_on_400: bool = False, max_retries: Optional[int] = None) -> Any:
        """One call with retries; returns parsed JSON (or text); raises RolloutServerError."""
        retries = self.max_retries if max_retries is None else max_retries
        total = timeout_s or self.request_timeout_s
        timeout = aiohttp.ClientTimeout(total=total, connect=min(self.connect_timeout_s, total))
        last = "no attempt made"
        engine_down = False
        for attempt in range(retries + 1):
            if attempt:
                await asyncio.sleep(self.retry_backoff_s * (2 ** (attempt - 1)))
            try:
                async with session.request(method, url + path, json=payload, timeout=timeout) as resp:
                    body = await resp.text()
                    if resp.status < 400:
                        return _decode(body)
                    last = f"HTTP {resp.status}: {_error_message(body)}"
                    engine_down = False
                    if resp.status < 500 and not (retry_on_400 and resp.status == 400):
                        raise RolloutServerError(f"{method} {url}{path} failed: {last}")
            except RolloutServerError:
                raise
            except asyncio.TimeoutError:
                last, engine_down = f"timed out after {total:g} s", True
            except aiohttp.ClientError as exc:
                last, engine_down = f"{type(exc).__name__}: {exc}", True
        raise ServerUnavailableError(f"{method} {url}{path} failed after {retries + 1} attempt(s); last error: {last}",
                                     engine_down)

    def _live(self, exclude: set[str] = frozenset()) -> list[str]:
        """URLs not marked dead and not in `exclude`."""
        return [u for u in self.urls if u not in self.dead and u not in exclude]

    def _next_url(self, exclude: set[str] = frozenset()) -> Optional[str]:
        """The next live URL round-robin, skipping `exclude` (None when none is left)."""
        live = self._live(exclude)
        return live[next(self._rr) % len(live)] if live else None

    def mark_dead(self, url: str, why: str) -> None:
        """Stop sending /generate to `url` (warns once)."""
        url = url.rstrip("/")
        if url in self.urls and url not in self.dead:
            self.dead.add(url)
            warnings.warn(f"rollout engine {url} failed ({why}); its requests go to the other engines",
                          RuntimeWarning, stacklevel=2)

    def revive(self, url: str) -> None:
        """Send /generate to `url` again (e.g. after its engine was restarted)."""
        self.dead.discard(url.rstrip("/"))

    async def _post_generate(self, session: aiohttp.ClientSession, body: dict) -> tuple[str, Any]:
        """POST /generate to a live URL; on an unavailable engine re-send the whole request to another one.

        Each URL is tried at most once per request; the last one left gets the full retry budget.
        """
        tried: set[str] = set()
        while True:
            url = self._next_url(tried)
            if url is None:
                raise RolloutServerError(f"POST /generate failed on every rollout server ({sorted(tried)}; "
                                         f"dead: {sorted(self.dead)})")
            last_one = not self._live(tried | {url})
            try:
                return url, await self._request(session, url, "POST", "/generate", body,
                                                max_retries=None if last_one else 0)
            except ServerUnavailableError as exc:
                if last_one:
                    raise
                tried.add(url)
                if exc.engine_down:
                    self.mark_dead(url, str(exc))

    # ----------------------------------------------------------------------------- generate
    async def _generate_call(self, session: aiohttp.ClientSession, sem: asyncio.Semaphore,
                             prompts: Sequence[list[int]], sampling_params: Sequence[Optional[Mapping]],
                             return_logprob: bool, rid: Optional[str] = None) -> list[list[GenerateResult]]:
        """One /generate call carrying `prompts` (a batched body when there are several); samples per prompt."""
        bodies = [generate_body(p, sp, return_logprob, rid) for p, sp in zip(prompts, sampling_params)]
        counts = [int(b["sampling_params"].get("n", 1) or 1) for b in bodies]
        body = bodies[0] if len(bodies) == 1 else batched_generate_body(bodies)
        async with sem:
            url, data = await self._post_generate(session, body)
        objs = data if isinstance(data, list) else [data]
        if len(objs) != sum(counts):
            want = f"n={counts[0]}" if len(counts) == 1 else f"{len(counts)} prompts x n (total {sum(counts)})"
            raise _bad(f"{url} returned {len(objs)} samples for {want}")
        parsed = [parse_generate_response(o, want_logprobs=return_logprob) for o in objs]
        # SGLang answers a batched call prompt-major: prompt i's n samples are adjacent
        starts = list(itertools.accumulate(counts, initial=0))
        return [parsed[a:b] for a, b in zip(starts, starts[1:])]

    async def generate(self, input_ids: list[int], sampling_params: Optional[Mapping] = None,
                       return_logprob: bool = True, rid: Optional[str] = None) -> list[GenerateResult]:
        """The `sampling_params['n']` samples of one prompt (one request)."""
        _check_prompt(input_ids, 0)
        async with self._session() as session:
            return (await self._generate_call(session, asyncio.Semaphore(self.concurrency), [input_ids],
                                              [sampling_params], return_logprob, rid))[0]

    async def generate_batch(self, prompts: Sequence[list[int]],
                             sampling_params: Union[None, Mapping, Sequence[Mapping]] = None,
                             return_logprob: bool = True) -> list[list[GenerateResult]]:
        """Samples of many prompts, in prompt order: whole prompts packed into /generate calls of at most
        `sequences_per_request` samples each (one prompt per call when that is 1), at most `concurrency` in flight.

        `sampling_params` is shared by every prompt, or a sequence with one entry per prompt (e.g. own seeds).
        The packing depends only on the prompts' n, never on timing or engine count, so a deterministic engine
        (which generates one call as one batch) returns the same samples when the same batch is sent again.
        """
        for k, p in enumerate(prompts):
            _check_prompt(p, k)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts")
            per_prompt = list(sampling_params)
        else:
            per_prompt = [sampling_params] * len(prompts)
        calls = pack_calls([_n_of(sp) for sp in per_prompt], self.sequences_per_request)
        sem = asyncio.Semaphore(self.concurrency)
        async with self._session() as session:
            tasks = [asyncio.ensure_future(self._generate_call(session, sem, [prompts[k] for k in call],
                                                               [per_prompt[k] for k in call], return_logprob))
                     for call in calls]
            try:
                return [group for groups in await asyncio.gather(*tasks) for group in groups]
            finally:
                for t in tasks:
                    t.cancel()

    # ------------------------------------------------------------------------------ control
    async def health(self) -> dict[str, bool]:
        """Whether each server answers GET /health with 200 (one quick attempt each)."""
        async def one(session: aiohttp.ClientSession, url: str) -> bool:
            try:
                await self._request(session, url, "GET", "/health", timeout_s=min(5.0, self.request_timeout_s), max_retries=0)
                return True
            except RolloutServerError:
                return False

        async with self._session() as session:
            return dict(zip(self.urls, await asyncio.gather(*(one(session, u) for u in self.urls))))

    async def wait_until_healthy(self, timeout_s: float = 120.0, poll_s: float = 0.25) -> None:
        """Poll /health on every server until all answer 200; RolloutServerError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.urls)
        last: dict[str, str] = {}
        async with self._session() as session:
            while pending:
                for url in list(pending):
                    try:
                        await self._request(session, url, "GET", "/health",
                                            timeout_s=max(0.1, min(5.0, deadline - time.monotonic())), max_retries=0)
                        pending.remove(url)
                    except RolloutServerError as exc:
                        last[url] = str(exc)
                if not pending:
                    return
                if time.monotonic() >= deadline:
                    detail = "; ".join(f"{u}: {last.get(u, '?')}" for u in pending)
                    raise RolloutServerError(f"rollout server(s) not healthy after {timeout_s:g} s: {detail}")
                await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))

    async def update_weights_from_disk(self, model_path: str, weight_version: Optional[str] = None,
                                       load_format: Optional[str] = None, flush_cache: bool = True,
                                       timeout_s: Optional[float] = None) -> list[dict]:
        """POST /update_weights_from_disk to every server; raises unless all report success."""
        return await self._all_success("/update_weights_from_disk",
                                       disk_update_body(model_path, weight_version, load_format, flush_cache), timeout_s)

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> list[dict]:
        """POST /update_weight_version to every server."""
        return await self._all_success("/update_weight_version", weight_version_body(new_version, abort_all_requests))

    async def _all_success(self, path: str, body: Optional[dict], timeout_s: Optional[float] = None,
                           max_retries: Optional[int] = None, check_success: bool = True) -> list[Any]:
        async with self._session() as session:
            answers = await asyncio.gather(*(self._request(session, u, "POST", path, body, timeout_s=timeout_s,
                                                           max_retries=max_retries)
                                             for u in self.urls), return_exceptions=True)
            for url, ans in zip(self.urls, answers):
                if isinstance(ans, RolloutServerError) and "HTTP 404" in str(ans) and await self._is_router(session, url):
                    raise RolloutServerError(f"POST {url}{path}: {url} is an sglang-router, which does not forward weight "
                                             "updates; set rollout.weight_update_urls to its engines")
                if isinstance(ans, BaseException):
                    raise ans
        for url, ans in zip(self.urls, answers if check_success else ()):
            if not isinstance(ans, dict) or not ans.get("success"):
                msg = ans.get("message") if isinstance(ans, dict) else ans
                raise RolloutServerError(f"POST {url}{path} did not succeed: {msg}")
        return list(answers)

    async def call_all(self, path: str, body: Optional[dict] = None, timeout_s: Optional[float] = None,
                       check_success: bool = True) -> list[Any]:
        """POST `body` to `path` on every server concurrently, without retries (weight updates are not idempotent).

        Raises RolloutServerError naming the server when one fails or (check_success) does not answer success.
        """
        return await self._all_success(path, body, timeout_s, max_retries=0, check_success=check_success)

    async def call_each(self, path: str, body: Optional[dict] = None, method: str = "POST",
                        timeout_s: Optional[float] = None, urls: Optional[Sequence[str]] = None) -> list[Any]:
        """`method path` on each of `urls` (default: every server) concurrently, without retries; per URL the
        decoded answer or the RolloutServerError it failed with (nothing is raised)."""
        targets = [u.rstrip("/") for u in (self.urls if urls is None else urls)]
        async with self._session() as session:
            return list(await asyncio.gather(*(self._request(session, u, method, path, body, timeout_s=timeout_s,
                                                             max_retries=0) for u in targets),
                                             return_exceptions=True))

    async def weight_versions(self) -> list[str]:
        """The weight version each server serves, from /model_info (the live value in every SGLang version;
        0.5.23's /server_info keeps the startup one)."""
        async with self._session() as session:
            infos = await asyncio.gather(*(self._request(session, u, "GET", "/model_info") for u in self.urls))
        return ["" if not isinstance(i, dict) or i.get("weight_version") is None else str(i["weight_version"])
                for i in infos]

    async def _is_router(self, session: aiohttp.ClientSession, url: str) -> bool:
        """Whether `url` answers sglang-router's GET /workers (engines answer 404 there)."""
        try:
            data = await self._request(session, url, "GET", "/workers", timeout_s=min(5.0, self.request_timeout_s),
                                       max_retries=0)
        except RolloutServerError:
            return False
        return isinstance(data, dict) and isinstance(data.get("workers"), list)

    async def flush_cache(self) -> None:
        """POST /flush_cache on every server (retrying while a server reports it is busy)."""
        async with self._session() as session:
            await asyncio.gather(*(self._request(session, u, "POST", "/flush_cache", retry_on_400=True) for u in self.urls))

    async def server_info(self) -> list[dict]:
        """GET /server_info of every server (falls back to the older /get_server_info)."""
        async def one(session: aiohttp.ClientSession, url: str) -> dict:
            try:
                return await self._request(session, url, "GET", "/server_info")
            except RolloutServerError as exc:
                if "HTTP 404" not in str(exc):
                    raise
                return await self._request(session, url, "GET", "/get_server_info")

        async with self._session() as session:
            return list(await asyncio.gather(*(one(session, u) for u in self.urls)))

    # --------------------------------------------------------------------------- sync wrappers
    def generate_sync(self, input_ids: list[int], sampling_params: Optional[Mapping] = None,
                      return_logprob: bool = True, rid: Optional[str] = None) -> list[GenerateResult]:
        """Blocking `generate`."""
        return run_sync(self.generate(input_ids, sampling_params, return_logprob, rid))

    def generate_batch_sync(self, prompts: Sequence[list[int]],
                            sampling_params: Union[None, Mapping, Sequence[Mapping]] = None,
                            return_logprob: bool = True) -> list[list[GenerateResult]]:
        """Blocking `generate_batch`."""
        return run_sync(self.generate_batch(prompts, sampling_params, return_logprob))

    def health_sync(self) -> dict[str, bool]:
        """Blocking `health`."""
        return run_sync(self.health())

    def wait_until_healthy_sync(self, timeout_s: float = 120.0) -> None:
        """Blocking `wait_until_healthy`."""
        run_sync(self.wait_until_healthy(timeout_s))

    def update_weights_from_disk_sync(self, model_path: str, weight_version: Optional[str] = None,
                                      load_format: Optional[str] = None, flush_cache: bool = True,
                                      timeout_s: Optional[float] = None) -> list[dict]:
        """Blocking `update_weights_from_disk`."""
        return run_sync(self.update_weights_from_disk(model_path, weight_version, load_format, flush_cache, timeout_s))

    def flush_cache_sync(self) -> None:
        """Blocking `flush_cache`."""
        run_sync(self.flush_cache())

    def server_info_sync(self) -> list[dict]:
        """Blocking `server_info`."""
        return run_sync(self.server_info())

    def weight_versions_sync(self) -> list[str]:
        """Blocking `weight_versions`."""
        return run_sync(self.weight_versions())


def _check_prompt(ids: Any, k: int) -> None:
    if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"prompt {k}: input_ids must be a non-empty list of integers")


def _decode(body: str) -> Any:
    """JSON if the body is JSON, else the text (SGLang answers some control endpoints in plain text)."""
    try:
        return json.loads(body) if body else None
    except json.JSONDecodeError:
        return body


def _error_message(body: str) -> str:
    """The message of an SGLang/OpenAI-style JSON error, or the (truncated) body."""
    data = _decode(body)
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "message" in data:
            return str(data["message"])
    return str(body)[:500]
