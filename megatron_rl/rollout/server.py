"""Embedded rollout server: the CPU `Engine` behind SGLang's native HTTP protocol (aiohttp).

Concurrent /generate requests that arrive within a short window are generated as one batch in a
single worker thread (the event loop never blocks), so a trainer sending many concurrent
requests gets batched decoding like from a real SGLang server. Weight reloads run on the same
worker thread, between batches.

Run:
    python -m megatron_rl.rollout.server --model-path DIR [--tokenizer-path DIR] \
        --host 127.0.0.1 --port 30000 --random-seed 0 [--model-loader pkg.module:function]
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
from typing import Any, Callable, Optional

from aiohttp import web

from megatron_rl.rollout.engine import (
    Engine, GenerationOutput, GenerationRequest, ModelLoader, SamplingParams, SamplingParamsError,
)

log = logging.getLogger("megatron_rl.rollout.server")

SERVER_VERSION = "megatron_rl-embedded-0.1"
HEALTH_GENERATE_TIMEOUT_S = 20.0


class BadRequest(ValueError):
    """A client error answered with HTTP 400 and the message."""


def _error(message: str, status: int = 400) -> web.Response:
    """SGLang's JSON error body."""
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


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
                 exit_on_load_error: bool = False, deterministic: bool = False, kv_cache_dtype: str = "auto"):
        """Configure the server; the model is loaded in the background once the app starts.

        deterministic: generate every request in a batch of its own, so a request's samples never
        depend on which other requests arrived in the same window (padding to a longer co-batched
        prompt changes the float rounding of its logits); SGLang's --enable-deterministic-inference.
        """
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
        self.host, self.port = host, port
        self.engine: Optional[Engine] = None
        self.load_error: Optional[str] = None
        self.exit_on_load_error = exit_on_load_error
        self.deterministic = deterministic
        self.kv_cache_dtype = kv_cache_dtype
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._queue: Optional[asyncio.Queue] = None
        self._unpaused: Optional[asyncio.Event] = None
        self._abort_epoch = 0
        self._aborted_rids: set[str] = set()
        self._running = 0
        self.batches_run = 0
        self._tasks: list[asyncio.Task] = []

    # --------------------------------------------------------------------------- lifecycle
    def make_app(self) -> web.Application:
        """The aiohttp application with every SGLang endpoint this server implements."""
        app = web.Application(client_max_size=512 * 1024 * 1024, middlewares=[_log_requests])
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
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
        """Collect queued requests for `batch_window_s`, then generate them together."""
        assert self._queue is not None and self._unpaused is not None
        loop = asyncio.get_running_loop()
        while True:
            first = await self._queue.get()
            batch = [first]
            rows = first.request.params.n
            deadline = loop.time() + self.batch_window_s
            while rows < self.max_batch_size and not self.deterministic:
                timeout = deadline - loop.time()
                try:
                    item = self._queue.get_nowait() if timeout <= 0 else await asyncio.wait_for(self._queue.get(), timeout)
                except (asyncio.QueueEmpty, asyncio.TimeoutError):
                    break
                batch.append(item)
                rows += item.request.params.n
            await self._unpaused.wait()
            live = []
            for item in batch:
                if self._is_aborted(item):
                    self._finish_aborted(item)
                elif not item.future.done():
                    live.append(item)
            if live:
                await self._run_batch(live)

    async def _run_batch(self, batch: list[_Pending]) -> None:
        """Generate one batch on the worker thread and resolve its futures."""
        loop = asyncio.get_running_loop()
        engine = self.engine
        assert engine is not None
        self._running += len(batch)
        self.batches_run += 1
        try:
            # the abort check runs on the worker thread; it only reads sets/ints (GIL-atomic)
            def job():
                # the version is read on the worker thread, where weight reloads also run, so it
                # always names the weights that produced these tokens
                return engine.generate([p.request for p in batch], lambda i: self._is_aborted(batch[i])), self.weight_version

            results, version = await loop.run_in_executor(self._executor, job)
            for item, outs in zip(batch, results):
                if not item.future.done():
                    item.future.set_result((outs, version))
        except Exception as exc:
            log.exception("generation failed")
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
        finally:
            self._running -= len(batch)
            for item in batch:
                self._aborted_rids.discard(item.rid)

    def _is_aborted(self, item: _Pending) -> bool:
        return item.abort_epoch < self._abort_epoch or item.rid in self._aborted_rids

    def _finish_aborted(self, item: _Pending) -> None:
        outs = [GenerationOutput([], [], {"type": "abort", "message": "Abort before prefill"},
                                 len(item.request.input_ids)) for _ in range(item.request.params.n)]
        if not item.future.done():
            item.future.set_result((outs, self.weight_version))
        self._aborted_rids.discard(item.rid)

    async def _submit(self, request: GenerationRequest, rid: str) -> tuple[list[GenerationOutput], str]:
        """Queue a request and wait for its samples (and the weight version that produced them)."""
        assert self._queue is not None
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(request, rid, future, self._abort_epoch))
        return await future

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
        """SGLang /server_info: server arguments plus internal state."""
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.tokenizer_path, "host": self.host,
            "port": self.port, "random_seed": self.random_seed, "skip_tokenizer_init": self.tokenizer_path is None,
            "tp_size": 1, "dp_size": 1, "pp_size": 1, "max_running_requests": self.max_batch_size,
            "batch_window_s": self.batch_window_s, "weight_version": self.weight_version,
            "enable_deterministic_inference": self.deterministic, "kv_cache_dtype": self.kv_cache_dtype,
            "version": SERVER_VERSION, "engine": "embedded-cpu",
            "internal_states": [{"loaded": self.engine is not None, "running_requests": self._running,
                                 "queued_requests": self._queue.qsize() if self._queue else 0,
                                 "paused": bool(self._unpaused and not self._unpaused.is_set())}],
        })

    async def get_weight_version(self, request: web.Request) -> web.Response:
        """The weight version generations are tagged with."""
        return web.json_response({"weight_version": self.weight_version})

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

        def job() -> None:
            engine.load_weights(model_path)
            if version is not None:
                self.weight_version = str(version)

        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, job)
        except Exception as exc:
            msg = f"Failed to update weights from {model_path}: {type(exc).__name__}: {exc}"
            log.error(msg)
            return web.json_response({"success": False, "message": msg}, status=400)
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
        elif body.get("rid"):
            self._aborted_rids.add(str(body["rid"]))
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
        try:
            body = await _json_body(request)
            items, batched = parse_generate_request(body, self.engine)
        except SamplingParamsError as exc:
            return _error(str(exc))
        except (BadRequest, ValueError) as exc:
            return _error(str(exc))
        stream = bool(body.get("stream", False))
        if stream and batched:
            return _error("stream=true is only supported for a single (non-batched) prompt")
        t0 = time.perf_counter()
        try:
            results = await asyncio.gather(*(self._submit(it.request, it.rid) for it in items))
        except Exception as exc:
            return _error(f"generation failed: {type(exc).__name__}: {exc}", 500)
        latency = time.perf_counter() - t0
        out: list[dict] = []
        for it, (samples, version) in zip(items, results):
            for j, sample in enumerate(samples):
                rid = it.rid if len(samples) == 1 else f"{it.rid}_{j}"
                out.append(format_sample(sample, rid, version, it.return_logprob, it.text_in_logprobs, self.engine, latency))
        payload: Any = out if (batched or len(out) > 1) else out[0]
        if stream:
            return await _send_sse(request, out)
        return web.json_response(payload)


@dataclass
class _ParsedItem:
    """One prompt of a /generate body."""

    request: GenerationRequest
    rid: str
    return_logprob: bool
    text_in_logprobs: bool


def _per_item(value: Any, n: int, name: str, is_scalar: Callable[[Any], bool]) -> list:
    """Broadcast a scalar request field over a batch, or check a per-item list's length."""
    if isinstance(value, list) and not is_scalar(value):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def parse_generate_request(body: dict, engine: Engine) -> tuple[list[_ParsedItem], bool]:
    """Validate a /generate body into per-prompt requests; returns (items, batched)."""
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise BadRequest("exactly one of input_ids or text must be given")
    if has_ids:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids must be a non-empty list of token ids or a list of such lists")
        batched = isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        for k, p in enumerate(prompts):
            if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise BadRequest(f"input_ids[{k}] must be a list of integers" if batched else "input_ids must be a list of integers")
    else:
        text = body["text"]
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings")
        prompts = [engine.encode(t) for t in texts]
    n = len(prompts)
    logprob_start_len = body.get("logprob_start_len")
    for v in _per_item(logprob_start_len, n, "logprob_start_len", lambda x: False):
        if v is not None and v != -1:
            raise BadRequest("logprob_start_len >= 0 (input-token logprobs) is not supported by the embedded engine; use -1")
    top_num = body.get("top_logprobs_num")
    for v in _per_item(top_num, n, "top_logprobs_num", lambda x: False):
        if v not in (None, 0):
            raise BadRequest("top_logprobs_num > 0 is not supported by the embedded engine")
    sp = _per_item(body.get("sampling_params"), n, "sampling_params", lambda x: False)
    rids = _per_item(body.get("rid"), n, "rid", lambda x: False)
    want_lp = _per_item(body.get("return_logprob", False), n, "return_logprob", lambda x: False)
    text_lp = bool(body.get("return_text_in_logprobs", False))
    items = []
    for k in range(n):
        req = GenerationRequest(list(prompts[k]), SamplingParams.from_dict(sp[k]))
        engine.check_request(req)
        rid = str(rids[k]) if rids[k] is not None else uuid.uuid4().hex
        items.append(_ParsedItem(req, rid, bool(want_lp[k]), text_lp))
    return items, batched


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


async def _json_body(request: web.Request, allow_empty: bool = False) -> dict:
    """The request's JSON object (BadRequest on malformed JSON)."""
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise BadRequest("request body must be a JSON object")
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


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
    p = argparse.ArgumentParser(prog="python -m megatron_rl.rollout.server", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--tokenizer-path", default=None, help="HF tokenizer directory (enables text input and stop strings)")
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=30000, help="bind port")
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
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    return p


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
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if args.num_threads > 0:
        import torch

        torch.set_num_threads(args.num_threads)
    server = RolloutServer(
        args.model_path, args.tokenizer_path, model_loader=resolve_model_loader(args.model_loader),
        random_seed=args.random_seed, batch_window_s=args.batch_window_ms / 1000.0,
        max_batch_size=args.max_batch_size, weight_version=args.weight_version, host=args.host, port=args.port,
        exit_on_load_error=True, deterministic=args.enable_deterministic_inference, kv_cache_dtype=args.kv_cache_dtype)
    if args.parent_pid > 0:
        watch_parent(args.parent_pid)
    web.run_app(server.make_app(), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
