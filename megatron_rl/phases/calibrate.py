"""Calibrated Clipping inside one RL step, as the CalibrationPlan says (docs/CALIBRATED_CLIPPING.md).

    calib = StepCalibration(session.clipper, plan, cfg, run_dir)
    for each update (epoch, k) of the step, on this rank's shard mb:
        mb, bounds, tap = calib.before_update(learner, mb, epoch, k)
        learner.train_step(mb, RLLoss(cfg.algo, bounds, tap), micro_batch_size)
    metrics = calib.finish()

- `before_update`: the current policy's high-precision log-probs on the shadow rows (event steps,
  off-policy updates); under per_minibatch the no-grad FP8 pre-pass and its pooled solve (over the
  DP group: after the forward every CP rank holds whole rows, so DP alone covers each token once);
  returns the bounds the update trains with (the guard rails' outer limits for an open on-policy
  update) and the tap through which the loss adds its tokens.
- Under rollout.overlap=one_step_off (samples one weight version old) every token enters the statistics
  with the rollout-correction weight the loss gives it (phases/loss.py `correction_weight`).
- `finish`: on a solving step (every step under per_step, else an event), the one pooled solve over
  the DP x CP group of the last stage (every rank of it calls the collectives, even with no tokens;
  TP replicas are separate groups, each counts once), the ratio dumps, then the last stage's clipper
  state is copied to every stage so rank 0 logs and checkpoints it.

Ratio dumps (tracking.dump_ratios): `RUN_DIR/calibration/step_{step:06d}.rank{r}.npz` from every
DP x CP rank r (= dp_rank * cp_size + cp_rank) of the last stage, TP rank 0 only, on every solving
step, holding the tokens the step's solve pooled: `ratio` (FP8, float64, after the loss's log-ratio
clamp), `ratio_hp` (float64; nan without a shadow pass or outside the shadow rows), `adv` (float64)
and `minibatch` (int64: the update index epoch * num_minibatches + k). With the allgather backend and
no rank over max_samples_per_rank the union of the files is exactly the solve's token set (tokens
with A = 0 are in the files and in neither N nor P).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from megatron_rl.algo.calibration import BoundsSolution
from megatron_rl.algo.calibration_plan import CalibrationPlan
from megatron_rl.algo.clipper import CalibratedClipper
from megatron_rl.algo.losses import log_ratio
from megatron_rl.config import RunConfig
from megatron_rl.parallel import state
from megatron_rl.parallel.comm import share_from_last_stage
from megatron_rl.phases import logprobs
from megatron_rl.phases.loss import CalibrationTap, correction_weight
from megatron_rl.types import TrainBatch


def dump_path(run_dir: str | Path, step: int, rank: int) -> Path:
    """Where rank `rank`'s ratio dump of `step` goes."""
    return Path(run_dir) / "calibration" / f"step_{step:06d}.rank{rank}.npz"


class StepCalibration:
    """The clipper's part of one RL step (a no-op when calibration is off)."""

    def __init__(self, clipper: Optional[CalibratedClipper], plan: CalibrationPlan, cfg: RunConfig, run_dir: str | Path) -> None:
        """Start the step's pooled statistics when the plan says this step is a calibration event."""
        self.clipper, self.plan = clipper, plan
        self.micro_batch_size = cfg.train.micro_batch_size
        self.clamp = cfg.algo.policy_loss.log_ratio_clamp
        self.run_dir = Path(run_dir)
        self.dump = bool(cfg.tracking.dump_ratios)
        self.stats = None
        self.algo = cfg.algo
        # one_step_off trains on samples of the previous weights: tokens count by their rollout-correction weight
        self.weighted = cfg.rollout.overlap == "one_step_off"
        if clipper is not None and plan.solves:
            self.stats = clipper.new_stats(fp8=True, reference=plan.shadow, record=self.dump, weighted=self.weighted)
        self.solution: Optional[BoundsSolution] = None

    def before_update(self, learner, mb: TrainBatch, epoch: int, k: int
                      ) -> tuple[TrainBatch, Optional[tuple[torch.Tensor, torch.Tensor]], Optional[CalibrationTap]]:
        """(mb with shadow log-probs attached, bounds for update (epoch, k), tap for its loss)."""
        if self.clipper is None:
            return mb, None, None
        p, mbs = self.plan, self.micro_batch_size
        if p.shadow_forward(epoch, k):
            rows = p.row_mask(mb.sample_index, mb.batch_size)
            mb = mb.with_fields(logprobs_hp=logprobs.current_logprobs_hp(learner, mb, mbs, rows=rows))
        if p.prepass(epoch, k) and self.clipper.targets is not None:
            self._prepass(learner, mb)
        tap = CalibrationTap(p, self.stats, p.update_index(epoch, k)) if p.collects(epoch, k) else None
        if p.open_bounds(epoch, k):
            return mb, self.clipper.on_policy_bounds(), tap
        return mb, self.clipper.bounds(), tap

    def _prepass(self, learner, mb: TrainBatch) -> None:
        """per_minibatch: FP8 ratios of the whole mini-batch under the current policy, one pooled solve at the held targets."""
        lp = logprobs.current_logprobs(learner, mb, self.micro_batch_size)
        if not state.is_last_stage():
            return
        valid = mb.loss_mask > 0
        ratio = torch.exp(log_ratio(lp, mb.old_logprobs.to(lp.device), self.clamp))
        stats = self.clipper.new_stats(weighted=self.weighted)
        weight = correction_weight(mb, self.algo).to(lp.device)[valid] if self.weighted else None
        stats.add(ratio[valid], mb.advantages.to(lp.device)[valid], weight=weight)
        self.solution = self.clipper.solve(stats, state.dp_group(), smooth=False) or self.solution

    def finish(self) -> dict[str, float]:
        """The event's pooled solve and dumps (last stage), then every stage takes the last stage's state; returns calib/* metrics."""
        if self.clipper is None:
            return {}
        if self.stats is not None and state.is_last_stage():
            self.solution = self.clipper.solve(self.stats, state.dp_cp_group(), smooth=self.plan.smooth,
                                               quantile=self.plan.quantile) or self.solution
            if self.dump and state.tp_rank() == 0:
                self._write_dump()
        shared = share_from_last_stage((self.clipper.state_dict(), self.solution))
        self.clipper.load_state_dict(shared[0])
        self.solution = shared[1]
        return {**self.clipper.metrics(), **CalibratedClipper.solution_metrics(self.solution)}

    def _write_dump(self) -> None:
        """This rank's tokens of the event's solve, as numpy arrays (see module docstring)."""
        rank = state.dp_rank() * state.cp_size() + state.cp_rank()
        path = dump_path(self.run_dir, self.plan.step, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **self.stats.dump_arrays())
        tmp.replace(path)
