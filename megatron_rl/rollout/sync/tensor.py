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

Colocated engines free their memory while the learner trains and take it back before an update:
`release_memory()` / `resume_memory()` post SGLang's /release_memory_occupation and
/resume_memory_occupation {tags}. Handles only open on the same host: the config rejects engines
elsewhere.
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional, Sequence

import torch

from megatron_rl.rollout.client import RolloutClient, run_sync
from megatron_rl.rollout.sync.base import Bucket, WeightTransport, memory_body
from megatron_rl.rollout.sync.serialization import serialize_per_rank


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


def update_tensor_body(tensors: Bucket, tp_size: int, final: bool, weight_version: Any) -> dict:
    """The /update_weights_from_tensor body (UpdateWeightsFromTensorReqInput) of one bucket for an engine of `tp_size`
    TP ranks: one payload per rank; only the model's last bucket (`final`) flushes the cache and names the version.
    CPU tensors must already be in shared memory (SharedArena)."""
    body = {"serialized_named_tensors": serialize_per_rank(tensors, tp_size), "load_format": None,
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

    def send_bucket(self, bucket: Bucket, final: bool) -> None:
        """POST the bucket's handles to every engine (one payload per engine TP rank) and wait for all of them."""
        if self.any_cpu_engine():  # a CPU engine cannot open CUDA-IPC handles
            bucket = [(n, t.cpu()) for n, t in bucket]
        tensors = self.arena.place(bucket)

        async def all_engines() -> None:
            await asyncio.gather(*(
                self.engine_client(url).call_all(
                    "/update_weights_from_tensor", update_tensor_body(tensors, tp, final, self.weight_version),
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
