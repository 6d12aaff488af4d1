"""Streaming export of the learner's weights: megatron shards -> HF-named (FP8) tensors, one bucket at a time.

Each pipeline stage exports its own layers. Within a stage only the replica at DP rank 0 / CP rank
0 takes part: its TP ranks gather every parameter, one at a time, onto TP rank 0 (the stage's
*sender*), which maps it to HF names (models/hf_mapping.py), optionally quantizes it on the
learner's device (e.g. FP8 blockwise) and groups the results into buckets of at most
`bucket_bytes`. Extra memory on any rank is one gathered parameter plus one bucket, never the
model: a bucket is handed out, sent, and dropped before the next one is built (a single tensor
larger than the bucket travels alone).

    exporter = StreamingExporter(learner)
    for bucket in exporter.buckets(bucket_bytes=512 << 20, convert=quantizer):   # every exporting rank
        transport.send_bucket(bucket)                                             # runs on senders only

`check_finite(learner)` runs before any of it: non-finite weights stop the sync on every rank
with the offending tensor's name, before a byte reaches a transport.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_rl.models import hf_mapping
from megatron_rl.parallel import state

Bucket = list[tuple[str, torch.Tensor]]
"""HF-named tensors sent together."""
Converter = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]
"""Turns one HF-named high-precision tensor into what the engines serve (e.g. FP8 weight + scale_inv)."""


class NonFiniteWeightsError(RuntimeError):
    """The learner holds NaN/inf weights; the sync was refused before anything was sent."""


def _as_learned(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Default converter: the learner's values in its parameter dtype."""
    return [(name, tensor)]


def nbytes(tensors: Bucket) -> int:
    """Payload bytes of a bucket."""
    return sum(t.numel() * t.element_size() for _, t in tensors)


def check_finite(learner) -> None:
    """Raise NonFiniteWeightsError on every rank when any rank holds a NaN/inf parameter (collective)."""
    bad: Optional[str] = None
    learner.finish_param_sync()
    with torch.no_grad():
        for name, param in learner._local_params():
            if not bool(torch.isfinite(param.detach()).all()):
                bad = name
                break
    reports = [bad]
    if state.world_size() > 1:
        reports = [None] * state.world_size()
        dist.all_gather_object(reports, bad)
    offenders = [(rank, name) for rank, name in enumerate(reports) if name is not None]
    if offenders:
        rank, name = offenders[0]
        hf = _hf_names(name, learner.arch)
        more = f" and {len(offenders) - 1} more rank(s)" if len(offenders) > 1 else ""
        raise NonFiniteWeightsError(
            f"weight sync refused: parameter {name}{hf} holds NaN/inf values on learner rank {rank}{more}; "
            "the engines keep serving the previous weights")


def _hf_names(name: str, arch) -> str:
    """' (HF a, b)' for a megatron tensor name, '' when it has no HF counterpart."""
    from megatron_rl.models.presets import megatron_param_shapes

    shape = megatron_param_shapes(arch).get(name)
    if shape is None:
        return ""
    names = [n for n, _ in hf_mapping.megatron_to_hf(name, torch.empty(shape, device="meta"), arch)]
    return f" (HF {', '.join(names)})" if names else ""


class StreamingExporter:
    """Iterates the learner's weights as full HF tensors on each stage's sender (see module docstring)."""

    def __init__(self, learner) -> None:
        """Bind to a built Learner; no communication until iterated."""
        from megatron.core import parallel_state as mpu

        self.learner = learner
        self.stage = state.pp_rank()
        self.participates = mpu.get_data_parallel_rank() == 0 and state.cp_rank() == 0
        self.is_sender = self.participates and state.tp_rank() == 0

    def full_params(self) -> Iterator[tuple[str, Optional[torch.Tensor]]]:
        """(global megatron name, full tensor on the sender / None on other TP ranks), one parameter at a time.

        Collective over this stage's TP group: every TP rank of a participating replica iterates it
        to the end. Non-participating ranks get an empty iterator.
        """
        if not self.participates:
            return
        learner = self.learner
        tp, group = state.tp_size(), state.tp_group()
        tied_copy = learner.arch.tie_word_embeddings and not state.is_first_stage()
        dst = dist.get_global_rank(group, 0) if tp > 1 else None
        for name, param in learner._local_params():
            if tied_copy and name == "embedding.word_embeddings.weight":
                continue  # the last stage's copy of a tied embedding: stage 0 exports it
            data = param.detach()
            if tp > 1 and getattr(param, "tensor_model_parallel", False):
                parts = [torch.empty_like(data) for _ in range(tp)] if self.is_sender else None
                dist.gather(data.contiguous(), parts, dst=dst, group=group)
                if not self.is_sender:
                    yield name, None
                    continue
                if learner._is_gated_fc1(name):
                    halves = [p.chunk(2, dim=0) for p in parts]
                    data = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
                else:
                    data = torch.cat(parts, dim=param.partition_dim)
                del parts
            yield name, (data if self.is_sender else None)

    def hf_tensors(self, convert: Converter = _as_learned) -> Iterator[tuple[str, list[tuple[str, torch.Tensor]]]]:
        """(megatron name, converted HF tensors) per parameter on the sender; drives the gathers everywhere else."""
        for name, full in self.full_params():
            if full is None:
                continue
            out: list[tuple[str, torch.Tensor]] = []
            for hf_name, tensor in hf_mapping.megatron_to_hf(name, full, self.learner.arch):
                out.extend((n, t.contiguous()) for n, t in convert(hf_name, tensor))
            yield name, out

    def exported_layers(self) -> list[int]:
        """Global indices of the decoder layers whose weights this exporter's buckets carry (this stage's)."""
        from megatron_rl.trainer.spec import layer_offset

        chunks = len(self.learner.model)
        out: list[int] = []
        for vp in range(chunks):
            offset, count = layer_offset(self.learner.config, vp if chunks > 1 else None)
            out += range(offset, offset + count)
        return out

    def buckets(self, bucket_bytes: int, convert: Converter = _as_learned,
                extra: Optional[Callable[[list[int]], Bucket]] = None) -> Iterator[Bucket]:
        """Buckets of at most `bucket_bytes` (one parameter's tensors are never split) on the sender; `extra(layers)`
        (per-layer tensors that are no parameter: K/V cache scales) joins the last bucket, on its device."""
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        bucket: Bucket = []
        size = 0
        for _, tensors in self.hf_tensors(convert):
            n = nbytes(tensors)
            if bucket and size + n > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.extend(tensors)
            size += n
        if bucket and extra is not None:
            device = bucket[-1][1].device
            bucket.extend((n, t.to(device)) for n, t in extra(self.exported_layers()))
        if bucket:
            yield bucket


def with_last(buckets: Iterator[Bucket]) -> Iterator[tuple[Bucket, bool]]:
    """(bucket, is_last) pairs, holding one bucket back to know which is last."""
    pending: Optional[Bucket] = None
    for b in buckets:
        if pending is not None:
            yield pending, False
        pending = b
    if pending is not None:
        yield pending, True
