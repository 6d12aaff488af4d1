"""Export in which every learner rank holds every full HF tensor, on its own device (colocated tensor sync).

Colocated engines receive CUDA-IPC handles only of their own GPUs (rollout/colocation.py), so each
learner rank on an engine's GPU needs the whole model, not just its stage's layers: stage by stage,
the stage's sender gathers each parameter over TP as the streaming export does
(trainer/weight_export.py), then broadcasts it to every rank, which maps, converts and buckets it
itself. Conversion is deterministic, so every rank forms the same buckets and the ranks of one
engine post them together bucket by bucket. slime does the same before its colocated send
(update_weight/hf_weight_iterator_direct.py: PP broadcast, then TP gather, on every rank). Extra
memory per rank: one full parameter and one bucket (two while the last is held back).

Collective over all learner ranks, in lockstep per parameter: the stage's sender broadcasts the
parameter's name, shape and dtype (None after its last one), then the tensor; ranks of the stage's
exporting replica drive the TP gathers meanwhile, every other rank only receives.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_rl.parallel import state
from megatron_rl.trainer.weight_export import StreamingExporter


class ReplicatedExporter(StreamingExporter):
    """StreamingExporter whose `full_params` (and so `hf_tensors`, `buckets`) yield the whole model on every rank."""

    def __init__(self, learner) -> None:
        """Bind to a built Learner; the stage senders' global ranks are agreed on here (collective)."""
        super().__init__(learner)
        self.device = learner._comm_device()
        ranks: list = [None] * state.world_size()
        if state.world_size() > 1:
            dist.all_gather_object(ranks, (self.stage, self.is_sender))
        else:
            ranks = [(self.stage, self.is_sender)]
        self.sources = [next(r for r, (s, sends) in enumerate(ranks) if s == stage and sends)
                        for stage in range(state.pp_size())]
        """Global rank of each stage's sender."""

    def exported_layers(self) -> list[int]:
        """Every decoder layer: each rank's buckets carry the whole model."""
        return list(range(self.learner.config.num_layers))

    def full_params(self) -> Iterator[tuple[str, Optional[torch.Tensor]]]:
        """(global megatron name, full tensor on this rank's device) of every parameter of every stage, in stage
        order; every rank iterates it to the end."""
        if state.world_size() == 1:
            yield from super().full_params()
            return
        me = state.global_rank()
        for stage, src in enumerate(self.sources):
            local = super().full_params() if stage == self.stage else iter(())
            while True:
                name, full = next(local, (None, None))  # TP peers of the sender drive its gathers here
                box = [(name, tuple(full.shape), full.dtype) if me == src and name is not None else None]
                dist.broadcast_object_list(box, src=src)
                if box[0] is None:
                    break
                name, shape, dtype = box[0]
                buf = full.contiguous() if me == src else torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(buf, src=src)
                yield name, buf
