"""`CalibrationPlan`: every calibration decision of one RL step, made once and identically on every rank.

    plan = CalibrationPlan.build(step, cfg.algo.calibration, cfg.train, batch_size=B)

Built from (step, config, batch geometry) only, so all ranks agree on every branch that leads
to a collective. The log-probs phase reads it to run exactly the forwards it names; the loss
reads it to add each micro-batch's tokens to the step's statistics; the loop reads it to know
when to solve. The clipper (algo/clipper.py) holds state only.

Decisions (docs/CALIBRATED_CLIPPING.md, "Which tokens a solve sees"):
- `event`: this step is a calibration event (step % calibrate_every == 0; never under strength=targeted, which moves
  no bound and decides on its own high-precision forwards, phases/error_scale.py): it refreshes the targets
  (alpha, rho) from the high-precision shadow. Under `bounds_update: per_step` (the default) every
  step, event or not, ends with one pooled solve over the FP8 ratios that its off-policy updates'
  training forwards computed (every row, every micro-batch, every DP x CP rank; no extra forward),
  at the targets held from the last event (refreshed first on an event), and the next step trains
  with those bounds; its L is the quantile for unseen tokens (`quantile`). Under
  `bounds_update: per_calibration` the step's off-policy updates add their tokens to one pooled
  statistics object; the solve runs once at the END of the step, over all off-policy mini-batches,
  micro-batches and DP x CP ranks. The FP8 ratios of the last off-policy mini-batch exist only
  once it trains, so the calibration step itself trains with the previously held bounds and the
  new bounds apply from the next step. Under `per_minibatch` the event refreshes the same pooled
  solve (targets and held bounds) and each off-policy mini-batch additionally re-solves first.
- `shadow`: the event takes alpha and rho from high-precision shadow forwards: pi_old_hp in the log-probs phase and the current policy's
  high-precision log-probs before every off-policy update, both on `shadow_rows` only.
- `shadow_rows`: the step-batch rows (positions, i.e. TrainBatch.sample_index of the step
  batch) whose tokens run the shadow forwards and feed the event's solve, drawn from the rows an
  off-policy update trains on (the caller's `skip_rows`, rows only the on-policy first update
  trains, never feed a calibration statistic, so their shadow forward would be wasted): all of
  them when shadow_fraction = 1, else round(shadow_fraction * candidates) rows (at least 1) drawn
  with a generator seeded by (calibration.SEED, step), so every rank draws the same rows and the
  shadow cost falls with the fraction.
- `off_policy(epoch, k)`: every update but the first of the step (epoch 0, mini-batch 0), whose
  ratios are exactly 1 in high precision and say nothing about clipping.
- `open_bounds(epoch, k)`: that first update trains at the clipper's on-policy bounds ([lower_min, upper_max]
  under strength=full: high precision clips none of its tokens; FP8 noise alone would).
- `prepass(epoch, k)`: per_minibatch: a no-grad FP8 forward of the current policy over the whole
  mini-batch before its update, one pooled solve at the held targets, and that update trains
  with the result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_rl.algo.calibration import SEED
from megatron_rl.config.algo import CalibrationConfig
from megatron_rl.config.train import TrainConfig


@dataclass(frozen=True)
class CalibrationPlan:
    """One step's calibration decisions (see module docstring); hashable, comparable across ranks."""

    step: int
    """The RL step."""
    enabled: bool
    """Calibration is on at all (algo.calibration.enabled)."""
    event: bool
    """This step is a calibration event: its off-policy tokens feed one pooled solve at the end of the step."""
    shadow: bool
    """The event's targets come from high-precision shadow forwards (every event)."""
    per_minibatch: bool
    """bounds_update: per_minibatch (an FP8 pre-pass and a solve before every off-policy update)."""
    num_minibatches: int
    """Mini-batches per epoch."""
    ppo_epochs: int
    """Epochs over the step batch."""
    batch_size: int
    """Rows of the step batch."""
    shadow_rows: tuple[int, ...] = ()
    """Sorted step-batch rows whose tokens run the shadow forwards and feed the event (all rows at fraction 1)."""
    per_step: bool = False
    """bounds_update: per_step (a pooled solve at the end of every step over its own off-policy FP8 ratios)."""
    open_on_policy: bool = False
    """Calibration is on: the step's first update trains at the clipper's on-policy bounds."""

    @classmethod
    def build(cls, step: int, cfg: CalibrationConfig, train: TrainConfig, batch_size: int,
              skip_rows: tuple[int, ...] = (), whole_shadow: bool = False) -> "CalibrationPlan":
        """The plan of `step` for a step batch of `batch_size` rows; `skip_rows` are trained by no off-policy update
        (batching.on_policy_only_rows), so no shadow forward runs on them; `whole_shadow`: an event's shadow takes
        every candidate row whatever shadow_fraction (a step whose clips are decided on high-precision ratios
        forwards them all anyway)."""
        # strength=targeted moves no bound and measures nothing: its only high-precision forwards are its decision's
        targeted = cfg.strength == "targeted"
        event = cfg.enabled and not targeted and step % cfg.calibrate_every == 0
        shadow = event
        rows: tuple[int, ...] = ()
        if event:
            skip = set(skip_rows)
            candidates = [i for i in range(batch_size) if i not in skip]
            rows = tuple(candidates)
            if cfg.shadow_fraction < 1.0 and candidates and not whole_shadow:
                n = min(len(candidates), max(1, round(cfg.shadow_fraction * len(candidates))))
                g = torch.Generator().manual_seed(SEED * 1_000_003 + step)
                pick = torch.randperm(len(candidates), generator=g)[:n].tolist()  # device-ok: a host-side draw of row numbers
                rows = tuple(sorted(candidates[i] for i in pick))
        per_step = cfg.enabled and not targeted and cfg.bounds_update == "per_step"
        return cls(step=step, enabled=cfg.enabled, event=event, shadow=shadow,
                   per_minibatch=cfg.enabled and not targeted and cfg.bounds_update == "per_minibatch",
                   num_minibatches=train.num_minibatches, ppo_epochs=train.ppo_epochs, batch_size=batch_size,
                   shadow_rows=rows, per_step=per_step,
                   open_on_policy=cfg.enabled)

    @property
    def all_rows(self) -> bool:
        """Whether every row of the step batch is a shadow row."""
        return len(self.shadow_rows) == self.batch_size

    def update_index(self, epoch: int, k: int) -> int:
        """Index of the update (epoch, mini-batch k) within the step: epoch * num_minibatches + k."""
        return epoch * self.num_minibatches + k

    def off_policy(self, epoch: int, k: int) -> bool:
        """Every update but the step's first is off-policy."""
        return self.update_index(epoch, k) > 0

    @property
    def solves(self) -> bool:
        """Whether this step ends with a pooled solve (every step under per_step, else calibration events only)."""
        return self.per_step or self.event

    @property
    def quantile(self) -> str:
        """How the step's solve reads L (calibration.QUANTILES): per_step bounds apply to the next step's tokens."""
        return "next_tokens" if self.per_step else "same_tokens"

    @property
    def smooth(self) -> bool:
        """Whether the step's solve goes through the EMA (`smoothing`): event solves, except under per_step."""
        return not self.per_step

    def collects(self, epoch: int, k: int) -> bool:
        """Whether update (epoch, k) adds tokens to the step's pooled statistics (off-policy updates of a solving step)."""
        return self.solves and self.off_policy(epoch, k)

    def open_bounds(self, epoch: int, k: int) -> bool:
        """Whether update (epoch, k) trains at the clipper's on-policy bounds (the step's first update)."""
        return self.open_on_policy and not self.off_policy(epoch, k)

    def shadow_forward(self, epoch: int, k: int) -> bool:
        """Whether the current policy's high-precision log-probs are needed before update (epoch, k)."""
        return self.shadow and self.off_policy(epoch, k)

    def prepass(self, epoch: int, k: int) -> bool:
        """Whether update (epoch, k) is preceded by a no-grad FP8 forward and a pooled solve (per_minibatch)."""
        return self.per_minibatch and self.off_policy(epoch, k)

    def fp8_row_mask(self, sample_index: Optional[torch.Tensor], rows: int) -> torch.Tensor:
        """[rows] bool: which rows feed the FP8 statistics (per_step: every row; otherwise the event's shadow rows)."""
        if self.per_step:
            if sample_index is None:
                return torch.ones(rows, dtype=torch.bool)  # device-ok: no row tensor to take a device from; the caller moves it
            return torch.ones_like(sample_index, dtype=torch.bool)
        return self.row_mask(sample_index, rows)

    def row_mask(self, sample_index: Optional[torch.Tensor], rows: int) -> torch.Tensor:
        """[rows] bool on sample_index's device: which rows of a (mini/micro-)batch are shadow rows."""
        if self.all_rows:
            if sample_index is None:
                return torch.ones(rows, dtype=torch.bool)  # device-ok: no row tensor to take a device from; the caller moves it
            return torch.ones_like(sample_index, dtype=torch.bool)
        if sample_index is None:
            raise ValueError("shadow_fraction < 1 needs TrainBatch.sample_index to know which rows are shadow rows")
        chosen = torch.zeros(self.batch_size, dtype=torch.bool, device=sample_index.device)
        chosen[list(self.shadow_rows)] = True
        return chosen[sample_index]
