"""Colocated engines' memory around training (rollout.placement: colocated).

Colocated engines share the learner's devices, so the controller frees their memory while the
learner trains and takes it back before the weights change:

    rollout (engines serve version t) -> memory.release() -> log-probs, train, health checks
        -> memory.resume() -> weight sync (version t+1) -> next rollout / eval

`release` posts SGLang's /release_memory_occupation (weights and KV cache) to every engine before
the step's batch is broadcast, so no learner rank starts training before the engines let go;
`resume` posts /resume_memory_occupation before the sync. Engines keep a host copy of their weights
(SGLang's --enable-weights-cpu-backup, which the launchers pass for colocated engines), so an
unhealthy step, whose weights are never synced, leaves them serving the last synced version. With
disaggregated engines both calls do nothing. Run through the loop (`megatron-rl train ...
rollout.placement=colocated`); tests/test_overlap_placement.py checks the engines' event order.
"""
from __future__ import annotations

from megatron_rl.tracking import Timers


class EngineMemory:
    """Release / resume of the colocated engines' memory on the controller (no-op when not colocated or off the controller)."""

    def __init__(self, transport, placement: str, enabled: bool = True) -> None:
        """`transport` is the controller's weight-sync transport (it knows the live engines and posts to them)."""
        self.transport = transport
        self.active = enabled and placement == "colocated"

    def release(self, timers: Timers) -> None:
        """Free the engines' weights and KV cache before the learner trains."""
        if self.active:
            with timers("release_memory"):
                self.transport.release_memory(None)

    def resume(self, timers: Timers) -> None:
        """Take the engines' memory back (their last synced weights) before the weight sync and the next rollout."""
        if self.active:
            with timers("resume_memory"):
                self.transport.resume_memory(None)
