"""`CalibratedClipper`: the stateful side of Calibrated Clipping for a training run.

It holds the targets (alpha, rho), the current bounds (L, H) with EMA smoothing, and decides
when to calibrate (`calibrate_every`, `shadow_fraction`) and when to re-solve
(`bounds_update`). Every decision that leads to a collective depends only on (step,
micro-batch index, config), so all ranks of the group take the same branch.

Use per micro-batch:  lower, upper = clipper.update(ratio, adv, ratio_hp=..., group=group)
where ratio_hp is given exactly on micro-batches with `clipper.wants_shadow(step, mb)`.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from megatron_rl.algo.calibration import (
    BoundsSolution,
    CalibrationTargets,
    gather_ratio_stats,
    reference_sums,
    solve_bounds,
    targets_from_sums,
)
from megatron_rl.algo.ratio_stats import HistSpec
from megatron_rl.config.algo import AlgoConfig, CalibrationConfig


def _f64(x: float) -> torch.Tensor:
    return torch.tensor(float(x), dtype=torch.float64)


class CalibratedClipper:
    """Targets, smoothed bounds and the calibration schedule; checkpointed via state_dict()."""

    def __init__(self, cfg: CalibrationConfig, *, eps_low: float, eps_high: float) -> None:
        """Start at the uncalibrated bounds 1 - eps_low, 1 + eps_high (static targets are set at once)."""
        self.cfg = cfg
        self.eps_low, self.eps_high = float(eps_low), float(eps_high)
        self.hist_spec = HistSpec(cfg.hist_bins, cfg.hist_log_min, cfg.hist_log_max)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.lower = torch.tensor(1.0 - self.eps_low, dtype=torch.float32)
        self.upper = torch.tensor(1.0 + self.eps_high, dtype=torch.float32)
        self.targets: Optional[CalibrationTargets] = None
        if cfg.target_source == "static":
            self.targets = CalibrationTargets.of(cfg.static_alpha, cfg.static_rho)
        self.solved = False
        self.step = 0
        self._pending = False
        self._step_sums: Optional[torch.Tensor] = None
        self.last: Optional[BoundsSolution] = None

    def is_calibration_step(self, step: int) -> bool:
        """True on steps that calibrate (every `calibrate_every`, starting at step 0)."""
        return step % self.cfg.calibrate_every == 0

    def wants_shadow(self, step: int, microbatch: int) -> bool:
        """Whether micro-batch `microbatch` of `step` should run the high-precision shadow forward (rank-independent draw)."""
        if self.cfg.target_source != "shadow" or not self.is_calibration_step(step):
            return False
        if self.cfg.shadow_fraction >= 1.0:
            return True
        g = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + step) * 1_000_003 + microbatch)
        return bool(torch.rand((), generator=g) < self.cfg.shadow_fraction)

    def begin_step(self, step: int) -> None:
        """Call once per step before its micro-batches: starts the step's pooled shadow statistics; static targets re-solve on the first micro-batch of calibration steps."""
        self.step = step
        self._pending = self.cfg.target_source == "static" and self.is_calibration_step(step)
        self._step_sums = None

    def _merge_targets(self, new: CalibrationTargets) -> None:
        old = self.targets
        if old is None:
            self.targets = new
            return
        # an empty side of the reference pass says nothing: keep what we knew
        alpha = new.alpha if float(new.num_neg) > 0 else old.alpha
        rho = new.rho if float(new.num_neg) > 0 and float(new.num_pos) > 0 else old.rho
        self.targets = CalibrationTargets(alpha, rho, new.num_neg, new.num_pos)

    def update(
        self,
        ratio: torch.Tensor,
        adv: torch.Tensor,
        *,
        ratio_hp: Optional[torch.Tensor] = None,
        group: Optional[object] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bounds for this micro-batch (1-D FP8 ratios and advantages of its valid tokens); may run collectives."""
        new_targets = False
        if ratio_hp is not None:
            if self.cfg.target_source != "shadow":
                raise ValueError("ratio_hp given but algo.calibration.target_source is not 'shadow'")
            sums = reference_sums(ratio_hp, adv, eps_low=self.eps_low, eps_high=self.eps_high, group=group)
            # targets pool every shadow micro-batch of the step: more tokens, steadier alpha and rho
            self._step_sums = sums if self._step_sums is None else self._step_sums + sums
            self._merge_targets(targets_from_sums(self._step_sums))
            new_targets = True
        resolve = self.cfg.bounds_update == "per_microbatch" or new_targets or self._pending
        if resolve and self.targets is not None:
            self._solve(ratio, adv, group)
            self._pending = False
        return self.lower, self.upper

    def _solve(self, ratio: torch.Tensor, adv: torch.Tensor, group: Optional[object]) -> None:
        c = self.cfg
        stats = gather_ratio_stats(
            ratio, adv, group=group, backend=c.backend, max_samples_per_rank=c.max_samples_per_rank,
            hist_spec=self.hist_spec, generator=self.generator,
        )
        sol = solve_bounds(
            stats, self.targets, eps_low=self.eps_low, eps_high=self.eps_high, upper=c.upper,
            lower_min=c.lower_min, lower_max=c.lower_max, upper_min=c.upper_min, upper_max=c.upper_max,
            previous=(float(self.lower), float(self.upper)),
        )
        s = c.smoothing if self.solved else 0.0
        self.lower = (s * self.lower + (1.0 - s) * sol.lower).to(torch.float32)
        self.upper = (s * self.upper + (1.0 - s) * sol.upper).to(torch.float32)
        self.solved = True
        self.last = sol

    def bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The current (lower, upper) bounds as 0-d tensors, without re-solving."""
        return self.lower, self.upper

    def metrics(self) -> dict[str, float]:
        """Current bounds, targets and the achieved alpha/rho of the last solve (nan where undefined)."""
        out = {"calib/lower": float(self.lower), "calib/upper": float(self.upper)}
        out["calib/alpha_target"] = float(self.targets.alpha) if self.targets is not None else math.nan
        out["calib/rho_target"] = float(self.targets.rho) if self.targets is not None else math.nan
        out["calib/alpha_achieved"] = self.last.alpha_achieved if self.last is not None else math.nan
        out["calib/rho_achieved"] = self.last.rho_achieved if self.last is not None else math.nan
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: bounds, targets, schedule flags and the subsampling RNG."""
        t = self.targets
        return {
            "lower": float(self.lower),
            "upper": float(self.upper),
            "solved": self.solved,
            "step": self.step,
            "pending": self._pending,
            "step_sums": None if self._step_sums is None else self._step_sums.tolist(),
            "targets": None if t is None else {k: float(getattr(t, k)) for k in ("alpha", "rho", "num_neg", "num_pos")},
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()` output."""
        self.lower = torch.tensor(state["lower"], dtype=torch.float32)
        self.upper = torch.tensor(state["upper"], dtype=torch.float32)
        self.solved = bool(state["solved"])
        self.step = int(state["step"])
        self._pending = bool(state["pending"])
        sums = state.get("step_sums")
        self._step_sums = None if sums is None else torch.tensor(sums, dtype=torch.float64)
        t = state["targets"]
        self.targets = None if t is None else CalibrationTargets(*(_f64(t[k]) for k in ("alpha", "rho", "num_neg", "num_pos")))
        self.generator.set_state(state["generator"])


def make_clipper(cfg: AlgoConfig) -> Optional[CalibratedClipper]:
    """A CalibratedClipper for `cfg` (eps from cfg.policy_loss), or None when calibration is off."""
    if not cfg.calibration.enabled:
        return None
    return CalibratedClipper(cfg.calibration, eps_low=cfg.policy_loss.eps_low, eps_high=cfg.policy_loss.eps_high)
