"""Embedded rollout server: the CPU `Engine` behind SGLang's native HTTP protocol (aiohttp).

Concurrent /generate requests that arrive within a short window are generated as one batch in a
single worker thread (the event loop never blocks), so a trainer sending many concurrent
requests gets batched decoding like from a real SGLang server. Weight reloads run on the same
worker thread, between batches.

Every /generate body is validated (engine/validation.py) before it joins a batch; a batch that
still fails at run time is retried item by item, so a failing request fails alone with its own
status and its batch-mates complete. Bodies are read with a size limit and a timeout and parsed off
the event loop, and `--api-key` guards every endpoint but /health (engine/http.py).

`--sglang-compat 0.5.23|0.5.8` (newest by default) names the SGLang version this server stands in
for (engine/compat.py): weight-update sessions, where the weight version is reported, the version
/server_info declares.

Run:
    megatron-rl serve --model-path DIR [--tokenizer-path DIR] [--api-key KEY] [--sglang-compat 0.5.8] \
        --host 127.0.0.1 --port 30000 --random-seed 0 [--model-loader pkg.module:function]
(`python -m megatron_rl.engine.server` takes the same flags.)
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from aiohttp import web

from megatron_rl.engine.compat import COMPAT_MODES, DEFAULT_COMPAT, compat_mode
from megatron_rl.engine.generation import (
    Engine, GenerationOutput, GenerationRequest, InvalidRequest, ModelLoader, SamplingParams,
)
from megatron_rl.engine.http import (
    BAD_REQUEST_LINES, BAD_REQUEST_WINDOW_S, SERVER_LOG, BadRequest, RateLimitedLines, api_key_middleware,
    body_middleware, clip, error_response, gc_paused, listening_socket, parse_json_object, read_json, write_port_file,
)
from megatron_rl.engine.validation import (
    DEFAULT_MAX_N, DEFAULT_MAX_SEQUENCES_PER_REQUEST, ModelFacts, RequestError, RequestLimits, validate_generate,
)
from megatron_rl.engine.weight_endpoints import WeightEndpoints

log = logging.getLogger("megatron_rl.engine.server")

SERVER_VERSION = "megatron_rl-embedded-0.1"
"""This engine's own version (/server_info "embedded_version"; "version" is the SGLang version it stands in for)."""
HEALTH_GENERATE_TIMEOUT_S = 20.0
# Parsing a body holds the interpreter lock (~0.5 s at 16 MB of token ids), which bounds /health's stalls.
DEFAULT_MAX_BODY_MB = 16.0
# Bodies carrying serialized weights are larger than any generate request.
DEFAULT_MAX_WEIGHT_BODY_MB = 4096.0
WEIGHT_BODY_PATHS = ("/update_weights_from_tensor",)
DEFAULT_READ_TIMEOUT_S = 30.0

_error = error_response
_json_body = read_json


@dataclass
class _Pending:
    """A queued generate request waiting for a batch."""

    request: GenerationRequest
    rid: str
    future: asyncio.Future
    abort_epoch: int
    enqueued_at: float = field(default_factory=time.perf_counter)


def resolve_model_loader(spec: Optional[str]) -> Optional[ModelLoader]:
    """Import a `package.module:function` model loader (None keeps the default HF loader)."""
    if not spec:
        return None
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model-loader {spec!r} must look like 'package.module:function'")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"--model-loader {spec!r}: {attr!r} is not a callable in {module_name}")
    return fn


class RolloutServer:
    """State and HTTP handlers of one embedded engine."""

    def __init__(self, model_path: str, tokenizer_path: Optional[str] = None,
                 model_loader: Optional[ModelLoader] = None, random_seed: int = 0,
                 batch_window_s: float = 0.005, max_batch_size: int = 256,
                 weight_version: str = "default", host: str = "127.0.0.1", port: int = 0,
                 exit_on_load_error: bool = False, deterministic: bool = False, kv_cache_dtype: str = "auto",
                 api_key: Optional[str] = None, max_n: int = DEFAULT_MAX_N,
                 max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                 max_body_mb: float = DEFAULT_MAX_BODY_MB, max_weight_body_mb: float = DEFAULT_MAX_WEIGHT_BODY_MB,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                 weight_update_timeout_s: float = 120.0, weights_cpu_backup: bool = False,
                 sglang_compat: str = DEFAULT_COMPAT, tp_size: int = 1, visible_devices: Optional[list[str]] = None):
        """Configure the server; the model is loaded in the background once the app starts.

        deterministic: generate every /generate call in a batch of its own (its prompts together), so a call's
        samples never depend on which other calls arrived in the same window (padding to a longer co-batched
        prompt changes the float rounding of its logits); SGLang's --enable-deterministic-inference, which is
        batch-invariant outright, gives the same guarantee and more.
        api_key: require `Authorization: Bearer <api_key>` on every endpoint but /health (SGLang's rule).
        max_n / max_sequences_per_request: bounds on sampling_params.n and on prompts x n per request
        (the latter never below max_n). max_body_mb / max_weight_body_mb: request body limits
        (the latter for tensor weight updates). read_timeout_s: time allowed to receive a body.
        weight_update_timeout_s: bound of a weight-update group's rendezvous and of each broadcast.
        weights_cpu_backup: released weights come back on resume (SGLang's --enable-weights-cpu-backup).
        sglang_compat: the SGLang version whose protocol rules this server follows (engine/compat.py).
        tp_size: TP ranks this engine declares (/server_info tp_size) and emulates for tensor updates: rank r opens
        only entry r of serialized_named_tensors, as SGLang's TP workers do (generation runs in this one process).
        visible_devices: the devices this engine sees (the CPU stand-in of an SGLang engine's CUDA_VISIBLE_DEVICES):
        a tensor payload naming another is refused as SGLang refuses it (engine/tensor_payload.py); None: all.
        """
        if tp_size < 1:
            raise ValueError("tp_size must be >= 1")
        if batch_window_s < 0:
            raise ValueError("batch_window_s must be >= 0")
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path
        self.model_loader = model_loader
        self.random_seed = random_seed
        self.batch_window_s = batch_window_s
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.startup_weight_version = weight_version
        self.compat = compat_mode(sglang_compat)
        self.host, self.port = host, port
        self.engine: Optional[Engine] = None
        self.load_error: Optional[str] = None
        self.exit_on_load_error = exit_on_load_error
        self.deterministic = deterministic
        self.kv_cache_dtype = kv_cache_dtype
        self.api_key = api_key or None
        self.limits = RequestLimits(max_n=max_n, max_sequences=max(max_sequences_per_request, max_n))
        if max_body_mb <= 0 or max_weight_body_mb <= 0:
            raise ValueError("max_body_mb and max_weight_body_mb must be > 0")
        if read_timeout_s <= 0:
            raise ValueError("read_timeout_s must be > 0")
        self.max_body_bytes = int(max_body_mb * 1024 * 1024)
        self.max_weight_body_bytes = int(max_weight_body_mb * 1024 * 1024)
        self.read_timeout_s = read_timeout_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._queue: Optional[asyncio.Queue] = None
        self._unpaused: Optional[asyncio.Event] = None
        self._abort_epoch = 0
        self._aborted_rids: set[str] = set()
        self._held_rids: dict[str, int] = {}  # rid -> requests queued or running under it (SGLang's rid_to_state)
        self._disk_update_errors = RateLimitedLines(log, BAD_REQUEST_LINES, BAD_REQUEST_WINDOW_S,
                                                    what="failed /update_weights_from_disk requests")
        self._running = 0
        self.batches_run = 0
        self._tasks: list[asyncio.Task] = []
        self.tp_size = tp_size
        if visible_devices is not None and (not visible_devices or not all(isinstance(d, str) and d for d in visible_devices)):
            raise ValueError("visible_devices must be a non-empty list of device names")
        self.weights = WeightEndpoints(self, _json_body, weight_update_timeout_s, weights_cpu_backup, self.compat, tp_size,
                                       visible_devices)

    # --------------------------------------------------------------------------- lifecycle
    def make_app(self) -> web.Application:
        """The aiohttp application with every SGLang endpoint this server implements."""
        middlewares = [_log_requests] + ([api_key_middleware(self.api_key)] if self.api_key else []) + [
            body_middleware(self.max_body_bytes, self.read_timeout_s, WEIGHT_BODY_PATHS, self.max_weight_body_bytes)]
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=middlewares)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        if self.compat.weight_version_route_detail is not None:
            for path in ("/get_weight_version", "/weight_version"):
                r.add_get(path, self.get_weight_version)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        for method, path, handler in self.weights.routes():
            r.add_route(method, path, handler)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._queue = asyncio.Queue()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._tasks = [asyncio.create_task(self._load()), asyncio.create_task(self._batch_loop())]

    async def _on_cleanup(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.weights.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _load(self) -> None:
        """Build the engine on the worker thread (health answers 503 meanwhile)."""
        loop = asyncio.get_running_loop()
        try:
            self.engine = await loop.run_in_executor(self._executor, lambda: Engine(
                self.model_path, self.tokenizer_path, model_loader=self.model_loader, random_seed=self.random_seed,
                kv_cache_dtype=self.kv_cache_dtype))
            log.info("model loaded from %s (kv cache %s)", self.model_path, self.kv_cache_dtype)
        except Exception as exc:  # the process stays up to report it; the launcher sees stderr
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("failed to load model from %s: %s", self.model_path, self.load_error)
            if self.exit_on_load_error:
                # a dead process is what launchers (and SGLang users) expect from a bad model path
                logging.shutdown()
                sys.stderr.flush()
                os._exit(1)

    # ----------------------------------------------------------------------------- batching
    async def _batch_loop(self) -> None:
        """Take the next queued /generate call; co-batch further calls for `batch_window_s` unless deterministic.

        Deterministic: a call is a batch of its own (split at `max_batch_size` rows in prompt order), so its samples
        depend only on the call itself, never on what else arrived in the window.
        """
        assert self._queue is not None and self._unpaused is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = list(await self._queue.get())
            rows = sum(item.request.params.n for item in batch)
            deadline = loop.time() + self.batch_window_s
            while rows < self.max_batch_size and not self.deterministic:
                timeout = deadline - loop.time()
                try:
                    call = self._queue.get_nowait() if timeout <= 0 else await asyncio.wait_for(self._queue.get(), timeout)
                except (asyncio.QueueEmpty, asyncio.TimeoutError):
                    break
                batch.extend(call)
                rows += sum(item.request.params.n for item in call)
            await self._unpaused.wait()
            live = []
            for item in batch:
                if self._is_aborted(item):
                    self._finish_aborted(item)
                elif not item.future.done():
                    live.append(item)
            for chunk in self._chunks(live) if self.deterministic else ([live] if live else []):
                await self._run_batch(chunk)

    def _chunks(self, items: list[_Pending]) -> list[list[_Pending]]:
        """Consecutive runs of whole requests of at most `max_batch_size` rows (a larger request runs alone)."""
        chunks: list[list[_Pending]] = []
        rows = 0
        for item in items:
            if not chunks or rows + item.request.params.n > self.max_batch_size:
                chunks.append([])
                rows = 0
            chunks[-1].append(item)
            rows += item.request.params.n
        return chunks

    async def _run_batch(self, batch: list[_Pending]) -> None:
        """Generate one batch on the worker thread and resolve its futures.

        If the batch fails, each request is retried alone (only after a failure, so the common path
        costs nothing): the request that cannot run gets its own error and its batch-mates complete.
        """
        self._running += len(batch)
        self.batches_run += 1
        try:
            try:
                self._resolve(batch, await self._generate_on_worker(batch))
            except Exception as exc:
                if len(batch) == 1:
                    self._fail(batch[0], exc)
                    return
                log.warning("a batch of %d requests failed (%s: %s); retrying each alone", len(batch),
                            type(exc).__name__, exc)
                for item in batch:
                    if item.future.done():
                        continue
                    try:
                        self._resolve([item], await self._generate_on_worker([item]))
                    except Exception as item_exc:
                        self._fail(item, item_exc)
        finally:
            self._running -= len(batch)
            for item in batch:
                self._aborted_rids.discard(item.rid)

    async def _generate_on_worker(self, batch: list[_Pending]) -> tuple[list[list[GenerationOutput]], str]:
        """(samples per request, weight version) of one engine call on the worker thread."""
        engine = self.engine
        assert engine is not None

        # the abort check runs on the worker thread; it only reads sets/ints (GIL-atomic)
        def job():
            # the version is read on the worker thread, where weight reloads also run, so it
            # always names the weights that produced these tokens
            return engine.generate([p.request for p in batch], lambda i: self._is_aborted(batch[i])), self.weight_version

        return await asyncio.get_running_loop().run_in_executor(self._executor, job)

    @staticmethod
    def _resolve(batch: list[_Pending], result: tuple[list[list[GenerationOutput]], str]) -> None:
        outs_per_item, version = result
        for item, outs in zip(batch, outs_per_item):
            if not item.future.done():
                item.future.set_result((outs, version))

    @staticmethod
    def _fail(item: _Pending, exc: Exception) -> None:
        if not isinstance(exc, InvalidRequest):
            log.error("generation of request %s failed: %s: %s", item.rid, type(exc).__name__, exc, exc_info=exc)
        if not item.future.done():
            item.future.set_exception(exc)

    def _is_aborted(self, item: _Pending) -> bool:
        return item.abort_epoch < self._abort_epoch or item.rid in self._aborted_rids

    def _finish_aborted(self, item: _Pending) -> None:
        outs = [GenerationOutput([], [], {"type": "abort", "message": "Abort before prefill"},
                                 len(item.request.input_ids)) for _ in range(item.request.params.n)]
        if not item.future.done():
            item.future.set_result((outs, self.weight_version))
        self._aborted_rids.discard(item.rid)

    async def _submit(self, request: GenerationRequest, rid: str) -> tuple[list[GenerationOutput], str]:
        """Queue one request as a call of its own and wait for its samples (and the weight version that produced them)."""
        return (await self._submit_call([(request, rid)]))[0]

    async def _submit_call(self, requests: list[tuple[GenerationRequest, str]]) -> list[tuple[list[GenerationOutput], str]]:
        """Queue the (request, rid) pairs of one /generate call together; each one's (samples, weight version)."""
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        call = [_Pending(request, rid, loop.create_future(), self._abort_epoch) for request, rid in requests]
        for item in call:
            self._held_rids[item.rid] = self._held_rids.get(item.rid, 0) + 1
        try:
            await self._queue.put(call)
            return list(await asyncio.gather(*(item.future for item in call)))
        finally:
            for item in call:
                left = self._held_rids.pop(item.rid) - 1
                if left:
                    self._held_rids[item.rid] = left
                else:  # an abort names the requests it found; none is left for it to reach
                    self._aborted_rids.discard(item.rid)

    # ----------------------------------------------------------------------------- handlers
    def _not_ready(self) -> Optional[web.Response]:
        if self.engine is None:
            if self.load_error:
                return _error(f"model failed to load: {self.load_error}", 500)
            return _error("server is starting (model loading)", 503)
        return None

    async def health(self, request: web.Request) -> web.Response:
        """200 once the model is loaded, 503 while loading."""
        return self._not_ready() or web.Response(text="")

    async def health_generate(self, request: web.Request) -> web.Response:
        """200 after a one-token generation succeeds."""
        if (resp := self._not_ready()) is not None:
            return resp
        try:
            await asyncio.wait_for(self._submit(GenerationRequest([0], SamplingParams(max_new_tokens=1, temperature=0.0)),
                                                f"HEALTH_CHECK_{uuid.uuid4().hex}"), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return _error(f"health check generation did not finish in {HEALTH_GENERATE_TIMEOUT_S:g} s (paused or busy)", 503)
        return web.Response(text="")

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang /model_info."""
        if (resp := self._not_ready()) is not None:
            return resp
        cfg = getattr(self.engine.model, "config", None)
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.tokenizer_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None),
        })

    async def server_info(self, request: web.Request) -> web.Response:
        """SGLang /server_info: server arguments plus internal state ("weight_version" is live only where SGLang's is)."""
        live = self.compat.server_info_tracks_weight_version
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.tokenizer_path, "host": self.host,
            "port": self.port, "random_seed": self.random_seed, "skip_tokenizer_init": self.tokenizer_path is None,
            "tp_size": self.tp_size, "dp_size": 1, "pp_size": 1, "max_running_requests": self.max_batch_size,
            "visible_devices": list(self.weights.visible_devices) if self.weights.visible_devices is not None else None,
            "batch_window_s": self.batch_window_s,
            "weight_version": self.weight_version if live else self.startup_weight_version,
            "enable_deterministic_inference": self.deterministic, "kv_cache_dtype": self.kv_cache_dtype,
            "enable_weights_cpu_backup": self.weights.weights_cpu_backup, "events": list(self.weights.events),
            "weight_finite_check_s": self.weights.finite.seconds,
            "version": self.compat.version, "embedded_version": SERVER_VERSION, "engine": "embedded-cpu", "device": "cpu",
            "internal_states": [{"loaded": self.engine is not None, "running_requests": self._running,
                                 "queued_requests": self._queue.qsize() if self._queue else 0,
                                 "paused": bool(self._unpaused and not self._unpaused.is_set())}],
        })

    async def get_weight_version(self, request: web.Request) -> web.Response:
        """0.5.8's answer to its deprecated /get_weight_version: a 404 pointing at /model_info."""
        return web.json_response({"detail": self.compat.weight_version_route_detail}, status=404)

    async def flush_cache(self, request: web.Request) -> web.Response:
        """No prefix cache is kept between batches, so this only reports success when idle (400 while busy, like SGLang)."""
        if self._running or (self._queue is not None and self._queue.qsize()):
            return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.\n")
        return web.Response(text="Cache flushed.\n")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """Reload weights from `model_path` (between batches) and set the weight version."""
        if (resp := self._not_ready()) is not None:
            return resp
        try:
            body = await _json_body(request)
            model_path = body.get("model_path")
            if not isinstance(model_path, str) or not model_path:
                raise BadRequest("update_weights_from_disk: model_path (string) is required")
            load_format = body.get("load_format")
            if load_format not in (None, "auto", "safetensors"):
                raise BadRequest(f"update_weights_from_disk: load_format={load_format!r} is not supported "
                                 "(use null, 'auto' or 'safetensors')")
            version = body.get("weight_version")
            if version is not None and not isinstance(version, (str, int)):
                raise BadRequest("update_weights_from_disk: weight_version must be a string")
        except BadRequest as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        engine = self.engine
        if body.get("abort_all_requests"):
            self._abort_epoch += 1

        def finite(model) -> None:
            from megatron_rl.engine.weight_receiver import served_tensors

            self.weights.finite(served_tensors(model).items(), "update_weights_from_disk")

        def job() -> None:
            engine.load_weights(model_path, check=finite)
            if version is not None:
                self.weight_version = str(version)

        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, job)
        except Exception as exc:
            # the error usually repeats the path: name it once, and keep what a client sent bounded in the log
            why = f"{type(exc).__name__}: {exc}".replace(model_path, "<model_path>")
            self._disk_update_errors.log(logging.ERROR, "update_weights_from_disk failed (model_path %s): %s",
                                         clip(model_path, 200), clip(why, 300))
            return web.json_response({"success": False, "message": f"Failed to update weights from {model_path}: {why}"},
                                     status=400)
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """Set the weight version without touching weights ({new_version, abort_all_requests})."""
        try:
            body = await _json_body(request)
            version = body.get("new_version")
            if version is None or not isinstance(version, (str, int)):
                raise BadRequest("update_weight_version: new_version (string) is required")
        except BadRequest as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        if body.get("abort_all_requests"):
            self._abort_epoch += 1
        self.weight_version = str(version)
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": self.weight_version})

    async def abort_request(self, request: web.Request) -> web.Response:
        """Abort one request by rid, or all ({abort_all: true}); aborted samples finish with type abort."""
        try:
            body = await _json_body(request)
        except BadRequest as exc:
            return _error(str(exc))
        if body.get("abort_all"):
            self._abort_epoch += 1
        elif body.get("rid") and str(body["rid"]) in self._held_rids:
            self._aborted_rids.add(str(body["rid"]))
        # a rid no request holds is ignored, as SGLang 0.5.23's TokenizerManager.abort_request returns when
        # rid_to_state has no entry for it (srt/managers/tokenizer_manager.py): a later request with it runs normally
        return web.Response(text="")

    async def pause_generation(self, request: web.Request) -> web.Response:
        """Stop starting new batches; mode "abort" also aborts queued and running requests."""
        try:
            body = await _json_body(request, allow_empty=True)
        except BadRequest as exc:
            return _error(str(exc))
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _error(f"pause_generation: mode={mode!r} must be 'abort', 'retract' or 'in_place'")
        if mode == "abort":
            self._abort_epoch += 1
        assert self._unpaused is not None
        self._unpaused.clear()
        return web.json_response({"success": True, "message": "Generation paused."})

    async def continue_generation(self, request: web.Request) -> web.Response:
        """Resume batching after /pause_generation."""
        assert self._unpaused is not None
        self._unpaused.set()
        return web.json_response({"success": True, "message": "Generation continued."})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang /generate: one prompt or a batch; a list response for batched input."""
        if (resp := self._not_ready()) is not None:
            return resp
        if (blocked := self.weights.generation_blocked()) is not None:
            return _error(blocked, 503)
        raw = await request.read()
        facts = ModelFacts.of(self.engine)

        def parse_and_validate():
            # one worker-thread call: the parsed body never outlives it, and the collector stays paused
            # until it is freed, so a body of many small containers is never traversed
            with gc_paused():
                return validate_generate(parse_json_object(raw), facts, self.limits)

        try:
            # off the event loop: parsing, validating and tokenizing a large body must not delay /health
            parsed = await asyncio.get_running_loop().run_in_executor(None, parse_and_validate)
        except (BadRequest, RequestError) as exc:
            return _error(str(exc))
        items, batched, stream = parsed.items, parsed.batched, parsed.stream
        t0 = time.perf_counter()
        try:
            results = await self._submit_call([(it.request, it.rid) for it in items])
        except InvalidRequest as exc:  # the model changed under the request (e.g. a smaller vocabulary)
            return _error(str(exc))
        except Exception as exc:
            return _error(f"generation failed: {type(exc).__name__}: {exc}", 500)
        latency = time.perf_counter() - t0
        self.weights.record("generate", requests=len(items))
        out: list[dict] = []
        for it, (samples, version) in zip(items, results):
            for j, sample in enumerate(samples):
                rid = it.rid if len(samples) == 1 else f"{it.rid}_{j}"
                out.append(format_sample(sample, rid, version, it.return_logprob, it.text_in_logprobs, self.engine, latency))
        payload: Any = out if (batched or len(out) > 1) else out[0]
        if stream:
            return await _send_sse(request, out)
        return web.json_response(payload)


def format_sample(sample: GenerationOutput, rid: str, weight_version: str, return_logprob: bool,
                  text_in_logprobs: bool, engine: Engine, latency: float) -> dict:
    """One SGLang response object for a generated sample."""
    meta: dict[str, Any] = {
        "id": rid, "finish_reason": sample.finish_reason, "prompt_tokens": sample.prompt_tokens,
        "completion_tokens": len(sample.output_ids), "cached_tokens": 0, "weight_version": weight_version,
        "e2e_latency": latency,
    }
    if return_logprob:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [
            [lp, tok, engine.token_text(tok) if text_in_logprobs else None]
            for lp, tok in zip(sample.logprobs, sample.output_ids)]
    out: dict[str, Any] = {"output_ids": sample.output_ids, "meta_info": meta}
    if sample.text is not None:
        out = {"text": sample.text, **out}
    return out


@web.middleware
async def _log_requests(request: web.Request, handler) -> web.StreamResponse:
    """Debug-level log line per request (method, path, status)."""
    response = await handler(request)
    log.debug("%s %s -> %s", request.method, request.path, response.status)
    return response


async def _send_sse(request: web.Request, chunks: list[dict]) -> web.StreamResponse:
    """Server-sent events: the finished response(s) as `data:` events, then `data: [DONE]`."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for chunk in chunks:
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def build_arg_parser() -> argparse.ArgumentParser:
    """Command-line flags (a subset of sglang.launch_server's names)."""
    p = argparse.ArgumentParser(prog="megatron-rl serve", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--tokenizer-path", default=None,
                   help="HF tokenizer directory (enables text input and stop strings); default: the model "
                        "directory when it holds tokenizer.json or tokenizer_config.json")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="do not load a tokenizer even if the model directory has one (token-id input only)")
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=30000, help="bind port (0: one the OS picks; see --port-file)")
    p.add_argument("--port-file", default=None,
                   help="once bound, write the port to this file (atomically): how a launcher learns the port of --port 0")
    p.add_argument("--random-seed", type=int, default=0, help="seed of requests without sampling_seed")
    p.add_argument("--model-loader", default=None, help="package.module:function building the model from a path")
    p.add_argument("--batch-window-ms", type=float, default=5.0, help="how long to gather concurrent requests into a batch")
    p.add_argument("--max-batch-size", type=int, default=256, help="maximum sequences per batch")
    p.add_argument("--weight-version", default="default", help="initial weight version")
    p.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="batch-invariant results: generate each request in a batch of its own")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                   help="fp8_e4m3: emulate SGLang's FP8 KV cache (per-tensor scales 1.0)")
    p.add_argument("--parent-pid", type=int, default=0,
                   help="exit when this process (the launching trainer) is gone, even if it was SIGKILLed")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint except /health (as SGLang)")
    p.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help="largest sampling_params.n a request may ask for")
    p.add_argument("--max-sequences-per-request", type=int, default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                   help="largest number of sequences (prompts x n) in one request (at least --max-n)")
    p.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_MB,
                   help="largest request body (MB); larger ones get 413")
    p.add_argument("--max-weight-body-mb", type=float, default=DEFAULT_MAX_WEIGHT_BODY_MB,
                   help="largest body of a tensor weight update (MB)")
    p.add_argument("--read-timeout-s", type=float, default=DEFAULT_READ_TIMEOUT_S,
                   help="time allowed to receive a request body (408 and the connection closed after); "
                        "also how long an idle connection is kept")
    p.add_argument("--weight-update-timeout-s", type=float, default=120.0,
                   help="bound of a weight-update group's rendezvous and of each weight broadcast")
    p.add_argument("--enable-weights-cpu-backup", action="store_true",
                   help="keep released weights and restore them on /resume_memory_occupation (as SGLang's flag)")
    p.add_argument("--tp-size", type=int, default=1,
                   help="TP ranks this engine declares and emulates for tensor weight updates (rank r opens only entry "
                        "r of serialized_named_tensors; generation is unchanged; distributed groups need 1)")
    p.add_argument("--visible-devices", default=None,
                   help="comma-separated names of the devices this engine sees (the CPU stand-in of CUDA_VISIBLE_DEVICES' "
                        "GPU UUIDs): a tensor payload naming another device is refused with SGLang's 'Invalid "
                        "device_uuid=...' (default: every device)")
    p.add_argument("--sglang-compat", default=DEFAULT_COMPAT, choices=sorted(COMPAT_MODES),
                   help="the SGLang version whose protocol this server follows (weight-update sessions, where the "
                        "weight version is reported)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    return p


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def discover_tokenizer(model_path: str) -> Optional[str]:
    """The model directory when it holds a tokenizer (as SGLang, whose --tokenizer-path defaults to --model-path)."""
    if any(os.path.isfile(os.path.join(model_path, name)) for name in TOKENIZER_FILES):
        return model_path
    return None


def watch_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Exit this process once `parent_pid` is no longer our parent (a SIGKILLed trainer cannot stop its engines)."""
    import threading

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        log.warning("parent process %d is gone; exiting", parent_pid)
        logging.shutdown()
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: Optional[list[str]] = None) -> int:
    """Serve until SIGINT/SIGTERM."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    for flag in ("max_n", "max_sequences_per_request", "tp_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    for flag in ("max_body_mb", "max_weight_body_mb", "read_timeout_s"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0")
    visible_devices = None
    if args.visible_devices is not None:
        visible_devices = [d.strip() for d in args.visible_devices.split(",")]
        if not all(visible_devices):
            parser.error("--visible-devices must list non-empty device names, comma-separated")
    tokenizer_path = args.tokenizer_path
    if tokenizer_path is None and not args.skip_tokenizer_init:
        tokenizer_path = discover_tokenizer(args.model_path)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if args.num_threads > 0:
        import torch

        torch.set_num_threads(args.num_threads)
    if tokenizer_path and not args.tokenizer_path:
        log.info("using the tokenizer in %s", tokenizer_path)
    # bound here, before the model loads, and served as is: the port is this process's from the start
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as exc:
        log.error("cannot bind %s:%d: %s", args.host, args.port, exc)
        return 1
    port = sock.getsockname()[1]
    if args.port_file:
        write_port_file(args.port_file, port)
    server = RolloutServer(
        args.model_path, tokenizer_path, model_loader=resolve_model_loader(args.model_loader),
        random_seed=args.random_seed, batch_window_s=args.batch_window_ms / 1000.0,
        max_batch_size=args.max_batch_size, weight_version=args.weight_version, host=args.host, port=port,
        exit_on_load_error=True, deterministic=args.enable_deterministic_inference, kv_cache_dtype=args.kv_cache_dtype,
        api_key=args.api_key, max_n=args.max_n, max_sequences_per_request=args.max_sequences_per_request,
        max_body_mb=args.max_body_mb, max_weight_body_mb=args.max_weight_body_mb, read_timeout_s=args.read_timeout_s,
        weight_update_timeout_s=args.weight_update_timeout_s, weights_cpu_backup=args.enable_weights_cpu_backup,
        sglang_compat=args.sglang_compat, tp_size=args.tp_size, visible_devices=visible_devices)
    if args.parent_pid > 0:
        watch_parent(args.parent_pid)
    web.run_app(server.make_app(), sock=sock, print=None, access_log=None, keepalive_timeout=args.read_timeout_s,
                logger=SERVER_LOG)
    return 0


if __name__ == "__main__":
    sys.exit(main())
