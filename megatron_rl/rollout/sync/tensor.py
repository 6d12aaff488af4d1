"""Tensor weight sync: SGLang's /update_weights_from_tensor for engines on the learner's host (colocated).

Per bucket, the stage sender pickles `[(name, tensor)]` the way SGLang's MultiprocessingSerializer
does (rollout/sync/serialization.py): CUDA tensors become CUDA-IPC handles (no copy), CPU tensors
are copied once into a shared-memory buffer and travel as handles to it. The request carries one
entry per engine TP rank (`serialized_named_tensors`), each pickled on its own as SGLang's
`Engine._serialize_tensors_per_rank` builds it (rank r opens only entry r; CUDA devices named by
UUID; serialization.py); the engine copies the tensors into its weights before it answers, so one
shared-memory buffer, reused bucket after bucket, carries a whole sync. Updates run inside the sync's
weight-update session on engines that have sessions (SGLang >= 0.5.23; base.py).
Only the model's last bucket carries `weight_version` (and flush_cache).

Colocated engines (rollout.placement=colocated) are fed per rank instead (`set_feed`, rollout/colocation.py):
a colocated SGLang engine opens only handles of its own GPUs, so every learner rank holds the full tensors
of each bucket (trainer/replicated_export.py) and builds the payload of the engine TP rank on its own
device (`rank_payload`); the rank feeding TP rank 0 posts them together (`post_feed`) after checking that
each names one of the engine's devices, since SGLang's scheduler exits on any other (phases/colocated.py
drives it).

Colocated engines free their memory while the learner trains and take it back before an update:
`release_memory()` / `resume_memory()` post SGLang's /release_memory_occupation and
/resume_memory_occupation {tags}. Handles only open on the same host: the config rejects engines
elsewhere.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional, Sequence

import torch

from megatron_rl.rollout.client import RolloutClient, run_sync
from megatron_rl.rollout.colocation import device_identity, own_device_index
from megatron_rl.rollout.engine_devices import DevicesUnknown, mismatch_message, tp_rank_devices, visible_devices
from megatron_rl.rollout.sync.base import Bucket, WeightTransport, memory_body
from megatron_rl.rollout.sync.serialization import payload_devices, serialize_named_tensors, serialize_per_rank


log = logging.getLogger(__name__)


class SharedArena:
    """One shared-memory buffer reused for every CPU bucket (grown when a bucket needs more).

    Creating and first touching a shared-memory segment costs more than the copy itself, and the
    sender waits for every engine to answer before the next bucket overwrites the buffer, so one
    segment serves the whole sync; the engine maps it once per request.
    """

    ALIGN = 64

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None

    def place(self, bucket: Bucket) -> Bucket:
        """CUDA tensors as they are (IPC shares their memory); CPU tensors copied into views of the shared buffer."""
        sizes = [-(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN if t.device.type == "cpu" else 0
                 for _, t in bucket]
        if sum(sizes) and (self.buffer is None or self.buffer.numel() < sum(sizes)):
            self.buffer = None
            self.buffer = torch.empty(sum(sizes), dtype=torch.uint8).share_memory_()
        out, offset = [], 0
        for (name, t), size in zip(bucket, sizes):
            if size:
                view = self.buffer[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                view.copy_(t)
                t, offset = view, offset + size
            out.append((name, t))
        return out


def update_tensor_body(tensors: Bucket, tp_size: int, final: bool, weight_version: Any,
                       device: Optional[str] = None) -> dict:
    """The /update_weights_from_tensor body (UpdateWeightsFromTensorReqInput) of one bucket for an engine of `tp_size`
    TP ranks: one payload per rank; only the model's last bucket (`final`) flushes the cache and names the version.
    CPU tensors must already be in shared memory (SharedArena); they name `device` when given (the sender's)."""
    body = {"serialized_named_tensors": serialize_per_rank(tensors, tp_size, device), "load_format": None,
            "flush_cache": final, "abort_all_requests": False}
    if final:
        body["weight_version"] = str(weight_version)
    return body


class TensorWeightSync(WeightTransport):
    """Transport 'tensor' (see module docstring)."""

    name = "tensor"
    needs_session = True

    def __init__(self, receiver_urls: Sequence[str], bucket_mb: float = 512.0, timeout_s: float = 300.0,
                 pause_mode: str = "abort", client: Optional[RolloutClient] = None, api_key: Optional[str] = None) -> None:
        """`receiver_urls` are engines on this host."""
        super().__init__(receiver_urls, bucket_mb, timeout_s, pause_mode, client, api_key)
        self.arena = SharedArena()
        self.feed = None
        """This rank's EngineFeed in a colocated sync (rollout/colocation.py), None when it feeds no engine."""

    # ------------------------------------------------------------------ colocated: one payload per learner rank
    def set_feed(self, feed) -> None:
        """Feed `feed.url`'s TP rank `feed.tp_rank` from this rank's device (None: feed no engine)."""
        self.feed = feed

    def feeding(self) -> bool:
        """Whether this rank feeds an engine this sync (it has a feed and the engine is a live target)."""
        return self.feed is not None and self.feed.url in self.urls

    def _fed_engine(self) -> dict:
        return dict(zip(self.urls, self.engine_info()))[self.feed.url]

    def engine_visible_devices(self, url: str) -> Optional[tuple[str, ...]]:
        """The devices engine `url` can open handles of, as it reports them (rollout/engine_devices.py); None: every
        device, or unknown (logged once). Learned once per target list (a restarted engine is asked again)."""
        info = dict(zip(self.urls, self.engine_info()))[url]
        if "visible" not in info:
            try:
                info["visible"] = visible_devices(url, info.get("server_info") or {"device": "cpu" if info["cpu"] else None})
            except DevicesUnknown as exc:
                log.warning("tensor weight sync: cannot learn which devices engine %s holds (%s); its handles are sent "
                            "unchecked", url, exc)
                info["visible"] = None
        return info["visible"]

    def check_colocated_devices(self, engines: Sequence[tuple[str, Sequence[str]]]) -> None:
        """ValueError (one line) when an engine's TP ranks hold other devices than the colocated layout `engines`
        [(url, devices by TP rank)] gives them: its feeders would send handles it cannot open."""
        for url, expected in engines:
            visible = self.engine_visible_devices(url)
            if visible is None:
                continue
            info = dict(zip(self.urls, self.engine_info()))[url].get("server_info") or {}
            try:
                held = tp_rank_devices(info, visible)
            except DevicesUnknown as exc:
                raise ValueError(f"rollout.placement=colocated: engine {url}: {exc}") from None
            if tuple(held) != tuple(expected):
                raise ValueError(mismatch_message(url, held, expected, "rollout.placement=colocated"))

    def check_sender_device(self, device: str) -> None:
        """RuntimeError (one line) when a receiver does not see `device`, the device this sender's handles name."""
        for url in self.urls:
            visible = self.engine_visible_devices(url)
            if visible is not None and device not in visible:
                raise RuntimeError(mismatch_message(url, visible, [device], "rollout.weight_sync.transport=tensor"))

    def rank_payload(self, bucket: Bucket) -> tuple[str, str]:
        """(device name, serialized payload) of this rank's copy of `bucket` for its engine TP rank; RuntimeError when
        the tensors are not on this rank's device (the engine could not open them)."""
        feed = self.feed
        if self._fed_engine()["cpu"]:  # a CPU engine cannot open CUDA-IPC handles
            bucket = [(n, t.cpu()) for n, t in bucket]
        tensors = self.arena.place(bucket)
        named = payload_devices(tensors, feed.device)
        if named - {feed.device}:
            raise RuntimeError(f"colocated tensor sync: this rank's bucket lives on {sorted(named)}, not on its own device "
                               f"{feed.device} (TP rank {feed.tp_rank} of engine {feed.url})")
        return feed.device, serialize_named_tensors(tensors, feed.device)

    def post_feed(self, entries: Sequence[tuple[str, str]], final: bool, weight_version: Any) -> None:
        """POST one bucket to this rank's engine: `entries` are the (device, payload) of its TP ranks in order (the
        poster calls it). Refused before anything is sent when a payload names a device the engine does not own:
        SGLang's scheduler would exit on it (srt/utils/patch_torch.py)."""
        feed = self.feed
        tp = self._fed_engine()["tp_size"]
        if len(entries) != tp or tp != len(feed.devices):
            raise RuntimeError(f"colocated tensor sync: engine {feed.url} reports tp_size {tp}, the colocated layout gives "
                               f"it {len(feed.devices)} device(s) and {len(entries)} payload(s) were built; check "
                               "rollout.engine_tp_size")
        for r, (device, _) in enumerate(entries):
            if device not in feed.devices:
                raise RuntimeError(f"colocated tensor sync: TP rank {r}'s payload for engine {feed.url} names device "
                                   f"{device}, which the engine does not see ({list(feed.devices)}); SGLang would exit "
                                   f"on it (Invalid device_uuid={device})")
        body = {"serialized_named_tensors": [blob for _, blob in entries], "load_format": None,
                "flush_cache": final, "abort_all_requests": False}
        if final:
            body["weight_version"] = str(weight_version)
        run_sync(self.engine_client(feed.url).call_all("/update_weights_from_tensor", body, self.timeout_s))

    def bucket_done(self) -> None:
        """After every engine answered for the bucket: free the CUDA blocks whose IPC handles the engines closed."""
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()

    def send_bucket(self, bucket: Bucket, final: bool) -> None:
        """POST the bucket's handles to every engine (one payload per engine TP rank) and wait for all of them: the
        stage senders' path, for engines that see the sender's device (not colocated ones: `set_feed`)."""
        # the sender's own device, as a CUDA tensor's handle names it: an engine that does not see it refuses the payload
        # (SGLang's scheduler exits on it), so that is checked against the engines' own report before anything is sent
        device = device_identity(own_device_index())
        self.check_sender_device(device)
        if self.any_cpu_engine():  # a CPU engine cannot open CUDA-IPC handles
            bucket = [(n, t.cpu()) for n, t in bucket]
        tensors = self.arena.place(bucket)

        async def all_engines() -> None:
            await asyncio.gather(*(
                self.engine_client(url).call_all(
                    "/update_weights_from_tensor", update_tensor_body(tensors, tp, final, self.weight_version, device),
                    self.timeout_s)
                for url, tp in zip(self.urls, self.engine_tp_sizes())))

        run_sync(all_engines())

    def close(self) -> None:
        """Drop the shared-memory buffer."""
        self.arena.buffer = None

    def release_memory(self, tags: Optional[list[str]] = None) -> None:
        """POST /release_memory_occupation {tags} to every engine (None: weights and KV cache)."""
        run_sync(self.client.call_all("/release_memory_occupation", memory_body(tags), self.timeout_s, check_success=False))

    def resume_memory(self, tags: Optional[list[str]] = None) -> None:
        """POST /resume_memory_occupation {tags} to every engine."""
        run_sync(self.client.call_all("/resume_memory_occupation", memory_body(tags), self.timeout_s, check_success=False))
