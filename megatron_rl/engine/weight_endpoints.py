"""HTTP handlers of the embedded server's weight endpoints, field for field SGLang's (io_struct.py):

    POST /begin_weight_update           {selector: "target" | "draft" | "all"}   (SGLang >= 0.5.23; one session at a time)
    POST /end_weight_update             {}
    POST /init_weights_update_group     {master_address, master_port, rank_offset, world_size, group_name, backend}
    POST /destroy_weights_update_group  {group_name}
    POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache, abort_all_requests,
                                        weight_version, load_format: null | "flattened_bucket"}
    POST /update_weights_from_tensor    {serialized_named_tensors, load_format: null | "direct" | "flattened_bucket",
                                        flush_cache, abort_all_requests, weight_version}
    GET|POST /get_weights_by_name       {name, truncate_size=100} -> the tensor's first rows as a JSON list
    GET|POST /release_memory_occupation, /resume_memory_occupation {tags: ["weights", "kv_cache"] | null}

Updates answer {"success", "message"} (HTTP 400 on failure). Under `--sglang-compat 0.5.23` (engine/compat.py)
distributed and tensor updates outside a session are refused before anything is received, as SGLang
refuses them (the refused broadcast is never joined). Receiving (rendezvous, broadcasts,
shared-memory handles) runs on a thread pool of its own, so generation continues on the old
weights meanwhile; the check-and-swap runs on the engine's worker thread between batches
(engine/weight_receiver.py), which also sets the weight version the next batch is tagged with.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Optional, Sequence

from aiohttp import web

from megatron_rl.engine import compat as sglang
from megatron_rl.engine.http import error_response
from megatron_rl.engine.tensor_payload import INVALID_DEVICE
from megatron_rl.engine import weight_receiver as wr
from megatron_rl.engine.weight_groups import WeightGroups
from megatron_rl.parallel.weight_group import DEFAULT_GROUP_NAME

EVENT_LOG_SIZE = 4096
"""Events an engine remembers for /server_info (enough for a tiny run's whole history)."""

log = logging.getLogger("megatron_rl.engine.weights")

ReadJson = Callable[..., Awaitable[dict]]


def _result(success: bool, message: str) -> web.Response:
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


def _opt_bool(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise wr.WeightUpdateError(f"{key} must be a boolean, got {value!r}")
    return value


def _opt_version(body: dict) -> Optional[str]:
    version = body.get("weight_version")
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, (str, int)):
        raise wr.WeightUpdateError(f"weight_version must be a string, got {version!r}")
    return str(version)


class WeightEndpoints:
    """Weight-update state of one RolloutServer (groups, released memory) and its handlers."""

    def __init__(self, server: Any, read_json: ReadJson, timeout_s: float = 120.0, weights_cpu_backup: bool = False,
                 compat: sglang.SGLangCompat = sglang.COMPAT_MODES[sglang.DEFAULT_COMPAT], tp_size: int = 1,
                 visible_devices: Optional[Sequence[str]] = None) -> None:
        """`server` is the RolloutServer (engine, worker executor, weight_version, abort epoch); `weights_cpu_backup`
        keeps released weights to restore them on resume (SGLang's --enable-weights-cpu-backup); `compat` the
        SGLang version whose rules the endpoints follow; `tp_size` the TP ranks whose tensor payloads it opens;
        `visible_devices` the device names its tensor payloads may come from (None: any; engine/tensor_payload.py)."""
        self.server = server
        self.visible_devices = None if visible_devices is None else tuple(visible_devices)
        """Devices this engine sees, as CUDA_VISIBLE_DEVICES limits an SGLang engine's (None: every device)."""
        self.read_json = read_json
        self.compat = compat
        self.session: Optional[str] = None
        """Selector of the open weight-update session (None: no session)."""
        self.tp_size = tp_size
        self.groups = WeightGroups(timeout_s, tp_size=tp_size)
        self.finite = wr.FiniteCheck()
        """Refuses NaN/inf weights on every update endpoint (its `seconds` are reported on /server_info)."""
        self._recv = ThreadPoolExecutor(max_workers=4, thread_name_prefix="weights")
        self._served: Optional[wr.ServedWeights] = None
        self._released: dict[str, Any] = {}
        self._seq = 0
        self.weights_cpu_backup = weights_cpu_backup
        self.events: deque = deque(maxlen=EVENT_LOG_SIZE)
        """The engine's recent memory, weight-update and generation events, in order (/server_info "events")."""

    def record(self, event: str, **detail: Any) -> None:
        """Append `event` (release, resume, update, generate) with the weight version it happened at."""
        self._seq += 1
        self.events.append({"seq": self._seq, "event": event, "weight_version": self.server.weight_version, **detail})

    def routes(self) -> list[tuple[str, str, Callable]]:
        """(method, path, handler) of every weight endpoint."""
        sessions = [("POST", "/begin_weight_update", self.begin_weight_update),
                    ("POST", "/end_weight_update", self.end_weight_update)] if self.compat.weight_update_sessions else []
        return sessions + [
            ("POST", "/init_weights_update_group", self.init_weights_update_group),
            ("POST", "/destroy_weights_update_group", self.destroy_weights_update_group),
            ("POST", "/update_weights_from_distributed", self.update_weights_from_distributed),
            ("POST", "/update_weights_from_tensor", self.update_weights_from_tensor),
            ("*", "/get_weights_by_name", self.get_weights_by_name),
            ("*", "/release_memory_occupation", self.release_memory_occupation),
            ("*", "/resume_memory_occupation", self.resume_memory_occupation),
        ]

    def close(self) -> None:
        """Leave every group and stop the receive threads."""
        self.groups.close()
        self._recv.shutdown(wait=False, cancel_futures=True)

    def generation_blocked(self) -> Optional[str]:
        """Why /generate must wait (memory released), or None."""
        if self._released:
            return (f"engine memory is released (tags {sorted(self._released)}); "
                    "POST /resume_memory_occupation first")
        return None

    # ------------------------------------------------------------------------------ helpers
    def served(self) -> wr.ServedWeights:
        """Index of the current model's tensors (rebuilt when a disk update replaced the model object)."""
        model = self.server.engine.model
        if self._served is None or self._served.model is not model:
            self._served = wr.ServedWeights(model)
        return self._served

    async def _body(self, request: web.Request, allow_empty: bool = False) -> dict:
        try:
            return await self.read_json(request, allow_empty=allow_empty)
        except ValueError as exc:
            raise wr.WeightUpdateError(str(exc)) from None

    async def _off_loop(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._recv, fn, *args)

    async def _swap(self, staged: list, version: Optional[str], abort_all: bool) -> int:
        """Check and copy staged tensors on the engine thread, then publish `version`; returns tensors written."""
        if "weights" in self._released:
            raise wr.WeightUpdateError("weights are released; POST /resume_memory_occupation with tags ['weights'] first")
        if abort_all:
            self.server._abort_epoch += 1

        def job() -> int:
            served = self.served()
            served.check(staged)
            written = served.apply(staged)
            if version is not None:
                self.server.weight_version = version
                self.record("update")
            return written

        return await asyncio.get_running_loop().run_in_executor(self.server._executor, job)

    def _not_ready(self) -> Optional[web.Response]:
        if self.server.engine is None:
            return _result(False, "server is starting (model loading)")
        return None

    def _outside_session(self, op: str) -> Optional[web.Response]:
        """SGLang 0.5.23's refusal of `op` when no session is open (None when the update may proceed)."""
        if self.compat.weight_update_sessions and self.session is None:
            log.warning("refused %s outside a weight-update session", op)
            return _result(False, sglang.outside_session_message(op))
        return None

    # ----------------------------------------------------------------------------- handlers
    async def begin_weight_update(self, request: web.Request) -> web.Response:
        """Open the weight-update session (one at a time); distributed and tensor updates need one."""
        try:
            selector = (await self._body(request, allow_empty=True)).get("selector", "all")
            if selector not in sglang.SELECTORS:
                raise wr.WeightUpdateError(f"begin_weight_update: selector={selector!r} must be one of "
                                           f"{list(sglang.SELECTORS)}")
        except wr.WeightUpdateError as exc:
            return error_response(str(exc))
        if self.session is not None:
            return _result(False, sglang.SESSION_ALREADY_OPEN)
        self.session = selector
        self.record("session_begin", selector=selector)
        return _result(True, sglang.SESSION_SUCCESS)

    async def end_weight_update(self, request: web.Request) -> web.Response:
        """Close the weight-update session."""
        try:
            await self._body(request, allow_empty=True)
        except wr.WeightUpdateError as exc:
            return error_response(str(exc))
        if self.session is None:
            return _result(False, sglang.NO_SESSION_OPEN)
        self.session = None
        self.record("session_end")
        return _result(True, sglang.SESSION_SUCCESS)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """Join a trainer's group; answers once every rank has joined."""
        if (resp := self._not_ready()) is not None:
            return resp
        try:
            b = await self._body(request)
            msg = await self._off_loop(self.groups.init, b.get("master_address"), b.get("master_port"),
                                       b.get("rank_offset"), b.get("world_size"),
                                       b.get("group_name", DEFAULT_GROUP_NAME),
                                       # SGLang defaults to nccl; a CPU engine can only take gloo
                                       b.get("backend") or ("gloo" if self.groups.device == "cpu" else "nccl"))
        except wr.WeightUpdateError as exc:
            return _result(False, str(exc))
        return _result(True, msg)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        """Leave a group."""
        try:
            b = await self._body(request, allow_empty=True)
            msg = await self._off_loop(self.groups.destroy, b.get("group_name", DEFAULT_GROUP_NAME))
        except wr.WeightUpdateError as exc:
            return _result(False, str(exc))
        return _result(True, msg)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """Receive the named tensors the trainer broadcasts (in `names` order), verify, swap."""
        if (resp := self._not_ready()) is not None:
            return resp
        try:
            b = await self._body(request)
            names, dtypes, shapes = b.get("names"), b.get("dtypes"), b.get("shapes")
            if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) or not names:
                raise wr.WeightUpdateError("update_weights_from_distributed: names, dtypes and shapes must be non-empty lists")
            if not len(names) == len(dtypes) == len(shapes):
                raise wr.WeightUpdateError(f"update_weights_from_distributed: {len(names)} names, {len(dtypes)} dtypes "
                                           f"and {len(shapes)} shapes")
            if not all(isinstance(n, str) for n in names):
                raise wr.WeightUpdateError("update_weights_from_distributed: names must be strings")
            entries = [(n, wr.parse_dtype(d), wr.parse_shape(s, n)) for n, d, s in zip(names, dtypes, shapes)]
            load_format = b.get("load_format")
            if load_format not in (None, "flattened_bucket"):
                raise wr.WeightUpdateError(f"update_weights_from_distributed: load_format={load_format!r} must be null "
                                           "or 'flattened_bucket'")
            group_name = b.get("group_name", DEFAULT_GROUP_NAME)
            version, abort_all = _opt_version(b), _opt_bool(b, "abort_all_requests", False)
            _opt_bool(b, "flush_cache", True)  # no prefix cache survives a batch here: nothing to flush
            if (refused := self._outside_session("update_weights_from_distributed")) is not None:
                return refused
            self.groups.get(group_name)
            problems = self.served().problems(entries)  # reported after the broadcast, which must be consumed anyway
            staged = await self._off_loop(self.groups.receive, group_name, entries, load_format)
            await self._off_loop(self.finite, staged, "update_weights_from_distributed")
            if problems:
                raise wr.WeightUpdateError(f"update_weights_from_distributed: {len(problems)} of {len(entries)} tensors do "
                                           "not match the served model: " + "; ".join(problems[:8])
                                           + " (weights unchanged)")
            written = await self._swap(staged, version, abort_all)
        except wr.WeightUpdateError as exc:
            log.warning("%s", exc)
            return _result(False, str(exc))
        return _result(True, f"Succeeded to update parameter online ({written} tensors)."
                       + (f" Weight version updated to {version}." if version is not None else ""))

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """Each emulated TP rank r maps the tensors behind entry r only (as SGLang's TP workers do), all must agree;
        verify, swap."""
        from megatron_rl.engine.tensor_payload import deserialize_named_tensors, named_tensor_list, unflatten_bucket

        if (resp := self._not_ready()) is not None:
            return resp
        try:
            b = await self._body(request)
            blobs = b.get("serialized_named_tensors")
            if not isinstance(blobs, list) or not blobs:
                raise wr.WeightUpdateError("update_weights_from_tensor: serialized_named_tensors must be a non-empty list "
                                           "(one entry per TP rank)")
            if len(blobs) < self.tp_size:
                raise wr.WeightUpdateError(f"update_weights_from_tensor: serialized_named_tensors has {len(blobs)} "
                                           f"entries for this engine's {self.tp_size} TP ranks (one payload per rank)")
            load_format = b.get("load_format")
            if load_format not in (None, "direct", "flattened_bucket"):
                raise wr.WeightUpdateError(f"update_weights_from_tensor: load_format={load_format!r} must be null, "
                                           "'direct' or 'flattened_bucket'")
            version, abort_all = _opt_version(b), _opt_bool(b, "abort_all_requests", False)
            _opt_bool(b, "flush_cache", True)
            if (refused := self._outside_session("update_weights_from_tensor")) is not None:
                return refused

            def load(rank: int) -> list:
                try:
                    obj = deserialize_named_tensors(blobs[rank], self.visible_devices)
                    return unflatten_bucket(obj) if load_format == "flattened_bucket" else named_tensor_list(obj)
                except ValueError as exc:
                    raise wr.WeightUpdateError(f"update_weights_from_tensor: TP rank {rank}'s payload: {exc}") from None

            def load_all() -> list:
                ranks = [load(r) for r in range(self.tp_size)]
                for r, staged_r in enumerate(ranks[1:], start=1):
                    if not wr.same_tensors(ranks[0], staged_r):
                        raise wr.WeightUpdateError(f"update_weights_from_tensor: TP rank {r}'s payload holds other "
                                                   "tensors than rank 0's (every rank loads the full tensors)")
                self.finite(ranks[0], "update_weights_from_tensor")
                return ranks[0]

            staged = await self._off_loop(load_all)
            written = await self._swap(staged, version, abort_all)
            del staged
        except wr.WeightUpdateError as exc:
            if INVALID_DEVICE in str(exc):  # where SGLang's scheduler would exit: name what this engine sees
                log.warning("%s (this engine sees devices %s)", exc, list(self.visible_devices or ()))
            else:
                log.warning("%s", exc)
            return _result(False, str(exc))
        return _result(True, f"Succeeded to update model weights ({written} tensors)."
                       + (f" Weight version updated to {version}." if version is not None else ""))

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """The first `truncate_size` rows of a served tensor (HF name)."""
        if self.server.engine is None:
            return web.json_response({"error": {"message": "server is starting (model loading)", "code": 503}}, status=503)
        try:
            b = await self._body(request)
            name, size = b.get("name"), b.get("truncate_size", 100)
            if not isinstance(name, str):
                raise wr.WeightUpdateError("get_weights_by_name: name (string) is required")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise wr.WeightUpdateError(f"get_weights_by_name: truncate_size must be a non-negative integer, got {size!r}")
            if "weights" in self._released:
                raise wr.WeightUpdateError("get_weights_by_name: weights are released")
            values = await asyncio.get_running_loop().run_in_executor(
                self.server._executor, lambda: self.served().read(name, size))
        except wr.WeightUpdateError as exc:
            return web.json_response({"error": {"message": str(exc), "code": 400}}, status=400)
        return web.json_response(values)

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        """Free weight storage (tag 'weights') and stop generating until resumed (colocated training)."""

        def release(tag: str) -> None:
            if tag not in self._released:
                # no KV cache outlives a batch here, so releasing it only blocks generation
                self._released[tag] = (wr.release_weights(self.server.engine.model, self.weights_cpu_backup)
                                       if tag == "weights" else None)

        return await self._memory_occupation(request, "release", release)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        """Re-allocate released memory (weights come back from their backup with --enable-weights-cpu-backup, else zero-filled: push them again)."""

        def resume(tag: str) -> None:
            held = self._released.pop(tag, None)
            if tag == "weights" and held is not None:
                wr.resume_weights(held)

        return await self._memory_occupation(request, "resume", resume)

    async def _memory_occupation(self, request: web.Request, event: str, apply: Callable[[str], None]) -> web.Response:
        """Release/resume: the request's tags, `apply(tag)` to each on the engine's executor, one `event` record."""
        if (resp := self._not_ready()) is not None:
            return resp
        try:
            tags = wr.parse_tags((await self._body(request, allow_empty=True)).get("tags"))
        except wr.WeightUpdateError as exc:
            return _result(False, str(exc))

        def job() -> None:
            for tag in tags:
                apply(tag)
            self.record(event, tags=list(tags))

        await asyncio.get_running_loop().run_in_executor(self.server._executor, job)
        return _result(True, f"{event.capitalize()}d memory of {list(tags)}.")
