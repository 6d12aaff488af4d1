"""Colocated engines' memory around training (rollout.placement: colocated), the learner's side included.

Colocated engines share the learner's devices, so the engines free their memory while the learner
trains and the learner frees what it can while the engines run:

    rollout (engines serve version t) -> memory.release() -> log-probs, train, health checks
        -> memory.resume() -> weight sync (version t+1) -> next rollout / eval

`release` (every learner rank): the controller posts SGLang's /release_memory_occupation (weights and
KV cache) to every engine; all ranks wait for it (a barrier: no rank allocates before the engines let
go), then each brings back its optimizer states and gradient buffers if they were offloaded. It runs
before the step's batch is broadcast. `resume` (every rank): each rank offloads them
(rollout.colocate_offload) and empties its allocator cache (trainer/offload.py); all ranks wait, then
the controller posts /resume_memory_occupation, before the sync. Engines keep a host copy of their
weights (SGLang's --enable-weights-cpu-backup, which the launchers pass for colocated engines), so an
unhealthy step, whose weights are never synced, leaves them serving the last synced version. A
checkpoint needs the optimizer states in place: `learner_resident()` wraps a save taken while the engines
run (release, save, resume). With disaggregated engines every call does nothing. Run through the loop
(`megatron-rl train ... rollout.placement=colocated`); tests/test_overlap_placement.py checks the engines'
event order, tests/test_colocate_offload.py the learner's side.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch.distributed as dist

from megatron_rl.parallel.comm import barrier
from megatron_rl.tracking import Timers


def _all_ranks_wait() -> None:
    """Every learner rank reaches this point (nothing to wait for without a process group, e.g. a lone controller)."""
    if dist.is_initialized():
        barrier()


class EngineMemory:
    """Release / resume of the colocated engines' memory and the learner's offload (no-op unless colocated)."""

    def __init__(self, transport, placement: str, is_controller: bool = True, learner=None,
                 offload: bool = False) -> None:
        """`transport` is the controller's weight-sync transport (it knows the live engines and posts to them); every
        learner rank builds one (`is_controller` says which posts); `offload` moves `learner`'s optimizer states and
        gradient buffers to host while the engines run (rollout.colocate_offload)."""
        from megatron_rl.trainer.offload import LearnerOffload, learner_device

        self.transport = transport
        self.active = placement == "colocated"
        self.is_controller = is_controller
        self.device = learner_device(learner) if (self.active and learner is not None) else None
        self.offload: Optional[LearnerOffload] = LearnerOffload(learner) if (self.active and offload) else None
        self.engines_released = False

    def release(self, timers: Timers) -> None:
        """Free the engines' weights and KV cache before the learner trains, then bring the learner's state back."""
        if not self.active:
            return
        with timers("release_memory"):
            if self.is_controller and not self.engines_released:
                self.transport.release_memory(None)
            self.engines_released = True
            _all_ranks_wait()
            if self.offload is not None:
                self.offload.reload()

    def resume(self, timers: Timers) -> None:
        """Free what the learner keeps between steps, then let the engines take their memory (last synced weights) back."""
        if not self.active:
            return
        from megatron_rl.trainer.offload import release_device_cache

        with timers("resume_memory"):
            if self.offload is not None:
                self.offload.offload()
            if self.device is not None:
                release_device_cache(self.device)
            _all_ranks_wait()
            if self.is_controller and self.engines_released:
                self.transport.resume_memory(None)
            self.engines_released = False

    @contextlib.contextmanager
    def learner_resident(self, timers: Timers) -> Iterator[None]:
        """The learner's offloaded state in place for the block (a checkpoint save), the engines' memory released meanwhile."""
        if self.offload is None or not self.offload.offloaded:
            yield
            return
        self.release(timers)
        try:
            yield
        finally:
            self.resume(timers)
