"""Where each step's batch comes from: generated when the step starts (rollout.overlap: none), or one step
ahead, in a background thread on the controller while the previous step trains (one_step_off).

    rollouts = RolloutSchedule(cfg.rollout.overlap, produce, pending=rl_state.get("pending_rollout"))
    for step ...:
        batch, metrics, shown = rollouts.batch(step, timers)   # the prefetched batch, or generated now
        rollouts.prefetch(step + 1, steps)                      # one_step_off: start step+1's generation
        ... train step ...
        metrics.update(rollouts.settle(timers))                 # wait for it before the weights change
        ... weight sync, checkpoint (with rollouts.state_dict()) ...

one_step_off: step t+1 is generated while step t trains, so it samples with the weights the engines
hold then, version t (the last synced), and trains on the learner's version t+1: a lag of one
version (the first step of a run has none). Every sample carries the engine-reported weight_version;
`rollout/staleness` logs the learner's version minus the oldest sample version of the step. The learner
recomputes pi_old on the batch with its current weights, so the lag lands where off-policy data belongs:
in the rollout correction (TIS/MIS on rollout_logprobs vs old_logprobs, `mismatch_abs_dlogp`), and, through
it, in Calibrated Clipping's ratio statistics, where every token counts with the correction weight the loss
gives it (phases/loss.py `correction_weight`, RatioStats(weighted=True)), so alpha, rho and the L/H solve
describe the token mix the objective trains on. The PPO ratio stays pi_theta / pi_old (in high precision
the first update's ratios are exactly 1, as the CalibrationPlan assumes).
The generation must end before the weight sync (a paused engine aborts in-flight requests, and a
sample must never mix versions): `settle` waits for it, and its wait is the `rollout_wait` timer.

Checkpoints: a checkpoint after step t holds step t+1's finished batch (`state_dict`), so a resumed
run trains step t+1 on exactly the samples the uninterrupted run generated with version t (the
checkpoint has the learner's version t+1 only: regenerating would change the samples).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

from megatron_rl.tracking import Timers

Produce = Callable[[int, Timers], tuple]
"""produce(step, timers) -> (batch, metrics, shown samples): the controller's rollout of `step`."""


class RolloutSchedule:
    """The controller's rollouts under rollout.overlap (see the module docstring); inert on other ranks."""

    def __init__(self, mode: str, produce: Produce, pending: Optional[tuple] = None, enabled: bool = True) -> None:
        """`pending` is a checkpoint's (step, result) of the batch generated ahead; `enabled` is False off the controller."""
        if mode not in ("none", "one_step_off"):
            raise ValueError(f"rollout.overlap={mode!r}: expected none or one_step_off")
        self.enabled, self.ahead = enabled, mode == "one_step_off"
        self.produce = produce
        self.ready: Optional[tuple] = pending
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead") if enabled and self.ahead else None
        self._future: Optional[Future] = None
        self._future_step = -1

    def batch(self, step: int, timers: Timers) -> tuple:
        """(batch, metrics, shown) of `step`: the one generated ahead (or restored), else generated now."""
        if not self.enabled:
            return None, {}, []
        ready, self.ready = self.ready, None
        if ready is not None and ready[0] == step:
            batch, metrics, shown = ready[1]
        else:
            batch, metrics, shown = self.produce(step, timers)
        metrics = dict(metrics)
        version = metrics.get("rollout/weight_version")
        if version is not None:
            metrics["rollout/staleness"] = float(step) - float(version)  # weights synced after step k are version k+1
        return batch, metrics, shown

    def prefetch(self, step: int, steps: int) -> None:
        """one_step_off: start generating `step`'s batch now (while the previous step trains), if the run has that step."""
        if self._pool is None or step >= steps:
            return
        self._future_step = step
        self._future = self._pool.submit(self._produce_timed, step)

    def _produce_timed(self, step: int) -> tuple:
        timers = Timers()
        result = self.produce(step, timers)
        return result, timers.pop()

    def settle(self, timers: Timers) -> dict[str, float]:
        """Wait for the generation running ahead (before the engines' weights change); its phase times as overlap/<phase>_s
        (logged on this step, the one it ran beside)."""
        if self._future is None:
            return {}
        with timers("rollout_wait"):
            result, timings = self._future.result()
        self._future = None
        self.ready = (self._future_step, result)
        return {f"overlap/{k.removeprefix('time/')}_s": v for k, v in timings.items()
                if k.startswith("time/") and k != "time/step"}

    def state_dict(self) -> dict[str, Any]:
        """The finished batch generated ahead, for the checkpoint after this step ({} when there is none)."""
        return {"pending_rollout": self.ready} if self.ready is not None else {}

    def close(self) -> None:
        """Let a generation still running ahead finish (the engines must outlive it), then stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
