"""`CalibratedClipper`: the state of Calibrated Clipping for a training run, and its one `solve`.

It holds the targets (alpha, rho), the held bounds (L, H) with their EMA, the last solution
(for the metrics) and the subsampling RNG. It never decides *when* anything happens: the
per-step `CalibrationPlan` (megatron_rl/algo/calibration_plan.py) does, and the callers hand
the clipper a `RatioStats` of the pooled token set when the plan says a solve is due:

    stats = RatioStats(...); stats.add(ratio, adv, ratio_hp=...)   # every micro-batch, local
    clipper.solve(stats, group, smooth=True)                         # once: reduce + targets + L, H
    lower, upper = clipper.bounds(device)                            # 0-d tensors for the loss

`solve` (docs/calibration.md; order of the guard rails in algo/calibration.py): reduce the statistics
over `group` (one collective round, every rank of the group calls it); if they hold high-precision
sums (a calibration event), take that event's targets; if they hold FP8 statistics and targets exist,
solve L and H. Under strength=full the solved bounds are held: with `smooth`, new = smoothing * held +
(1 - smoothing) * solved (the first solve of a run is taken as is); without, the solved bounds themselves.
Under strength=decision no bound moves: the bounds stay vanilla and the loop decides every
clip on high-precision ratios (`decides_on_high_precision`, phases/error_scale.py); the events still
measure the targets and how much more the low-precision ratios clip (`calib/gate_ratio`). Under
strength=targeted (the default) the bounds stay vanilla too and only the targeted answers are decided in high precision
(`targeted_fraction`); no event runs (CalibrationPlan), so nothing is solved or measured.
The solve's `quantile` says whom the bounds are for: the tokens solved on (per_calibration's event,
per_minibatch's pre-pass) or the next step's (per_step, which re-solves every step).
The state lives on the last pipeline stage (where the loss runs); the loop copies it to the other
stages after every step, so what rank 0 logs and checkpoints is the last stage's.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch

from megatron_rl.algo.calibration import (HIST_BINS, HIST_LOG_MAX, HIST_LOG_MIN, LOWER_MAX, MAX_SAMPLES_PER_RANK, SEED,
                                         UPPER_MIN, BoundsSolution, CalibrationTargets, RatioStats, solve_bounds)
from megatron_rl.algo.ratio_stats import HistSpec
from megatron_rl.config.algo import REMOVED_STRENGTHS, AlgoConfig, CalibrationConfig
from megatron_rl.config.run import ConfigError


def _f32(x: float) -> float:
    """x rounded to float32, the precision the loss compares ratios in."""
    return float(np.float32(x))


class CalibratedClipper:
    """Targets, held bounds (EMA), last solution and subsampling RNG; checkpointed via state_dict()."""

    def __init__(self, cfg: CalibrationConfig, *, eps_low: float, eps_high: float) -> None:
        """Start at the uncalibrated bounds 1 - eps_low, 1 + eps_high."""
        self.cfg = cfg
        self.eps_low, self.eps_high = float(eps_low), float(eps_high)
        self.hist_spec = HistSpec(HIST_BINS, HIST_LOG_MIN, HIST_LOG_MAX)
        self.generator = torch.Generator().manual_seed(SEED)
        self.lower, self.upper = _f32(1.0 - self.eps_low), _f32(1.0 + self.eps_high)
        self.targets: Optional[CalibrationTargets] = None
        self.solved = False
        self.last: Optional[BoundsSolution] = None
        self.gate_counts = [0.0, 0.0, 0.0, 0.0]
        """Negative tokens below 1 - eps_low and all negative tokens, under the shadow's high-precision ratios and under
        the low-precision ones, summed over every calibration event of the run."""
        self.alpha_lp = math.nan
        """Fraction of negative tokens the low-precision ratios put below 1 - eps_low at the last calibration event."""

    def new_stats(self, *, fp8: bool = True, reference: bool = False, record: bool = False, weighted: bool = False) -> RatioStats:
        """An empty `RatioStats` with this clipper's backend, eps and bins (`weighted`: tokens carry weights)."""
        return RatioStats(self.cfg.backend, fp8=fp8, reference=reference, eps_low=self.eps_low, eps_high=self.eps_high,
                          hist_spec=self.hist_spec, record=record, weighted=weighted)

    def solve(self, stats: RatioStats, group: Optional[object] = None, *, smooth: bool = True,
              quantile: str = "same_tokens") -> Optional[BoundsSolution]:
        """Reduce `stats` over `group`, update targets and held bounds (see module docstring); the solution, or None when none ran.
        `quantile` (calibration.QUANTILES): same_tokens for bounds applied to the solved tokens, next_tokens for later ones."""
        c = self.cfg
        reduced = stats.reduce(group, max_samples_per_rank=MAX_SAMPLES_PER_RANK, generator=self.generator)
        event, fp8 = reduced.targets, reduced.fp8
        if event is not None:
            self.targets = event.merged_into(self.targets)
            if fp8 is not None:
                lp_below, lp_neg = fp8.neg_count_below(1.0 - self.eps_low), fp8.num_neg
                if lp_neg > 0 and event.num_neg > 0:
                    self.alpha_lp = lp_below / lp_neg
                hp_neg, hp_below = event.sums[0], event.sums[1]
                self.gate_counts = [t + n for t, n in zip(self.gate_counts, (hp_below, hp_neg, lp_below, lp_neg))]
        if fp8 is None or self.targets is None:
            return None
        sol = solve_bounds(
            fp8, self.targets, eps_low=self.eps_low, eps_high=self.eps_high, upper=c.upper,
            lower_min=c.lower_min, lower_max=LOWER_MAX, upper_min=UPPER_MIN, upper_max=c.upper_max,
            relax_only=c.relax_only, previous=(self.lower, self.upper), quantile=quantile,
        )
        if not self.decides_on_high_precision():  # decision keeps the vanilla bounds
            s = c.smoothing if smooth and self.solved else 0.0
            self.lower = _f32(s * self.lower + (1.0 - s) * sol.lower)
            self.upper = _f32(s * self.upper + (1.0 - s) * sol.upper)
        self.solved = True
        self.last = sol
        return sol

    def bounds(self, device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The held (lower, upper) as 0-d float32 tensors on `device` (the loss data's device)."""
        return self.as_bounds(self.lower, self.upper, device)

    def on_policy_bounds(self, device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Bounds of a step's on-policy update (its high-precision ratio is exactly 1): the guard rails' outer limits
        [lower_min, upper_max] under strength=full, the held (vanilla) bounds under a high-precision decision."""
        if self.decides_on_high_precision():
            return self.bounds(device)
        return self.as_bounds(self.cfg.lower_min, self.cfg.upper_max, device)

    def decides_on_high_precision(self) -> bool:
        """Whether clips are decided on high-precision ratios at the vanilla bounds (strength=decision: every answer;
        strength=targeted: the targeted answers) instead of moving the bounds (strength=full)."""
        return self.cfg.strength in ("decision", "targeted")

    def targeted_fraction(self) -> Optional[float]:
        """The share of off-policy answers decided in high precision under strength=targeted; None when every answer is."""
        return self.cfg.targeted_fraction if self.cfg.strength == "targeted" else None

    @staticmethod
    def as_bounds(lower: float, upper: float, device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(lower, upper) as the loss takes them: 0-d float32 tensors on `device` (never Python floats: no recompiles)."""
        return (torch.tensor(_f32(lower), dtype=torch.float32, device=device),
                torch.tensor(_f32(upper), dtype=torch.float32, device=device))

    def metrics(self) -> dict[str, float]:
        """Held bounds, targets, the achieved alpha/rho of the last solve, and under strength=decision the measured
        low/high-precision clip ratio (nan where undefined)."""
        t, last = self.targets, self.last
        return {
            "calib/lower": self.lower, "calib/upper": self.upper,
            "calib/alpha_target": t.alpha if t is not None else math.nan,
            "calib/rho_target": t.rho if t is not None else math.nan,
            "calib/alpha_achieved": last.alpha_achieved if last is not None else math.nan,
            "calib/rho_achieved": last.rho_achieved if last is not None else math.nan,
            "calib/alpha_lp": self.alpha_lp,
            # only decision's calibration events measure the distortion; targeted runs none
            **({} if self.cfg.strength != "decision" else {
                "calib/gate_ratio": gate_ratio(*self.gate_counts), "calib/gate_hp_tokens": self.gate_counts[0]}),
        }

    @staticmethod
    def solution_metrics(sol: Optional[BoundsSolution]) -> dict[str, float]:
        """calib/solve_*: one solve's bounds after the guard rails (before EMA) and before them (raw); empty without a solve."""
        if sol is None:
            return {}
        return {"calib/solve_lower": sol.lower, "calib/solve_upper": sol.upper,
                "calib/solve_lower_raw": sol.lower_raw, "calib/solve_upper_raw": sol.upper_raw}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume and to log the same metrics: bounds, targets, last solution, RNG, counts."""
        t, last = self.targets, self.last
        return {
            "lower": self.lower,
            "upper": self.upper,
            "solved": self.solved,
            "targets": None if t is None else {**{k: getattr(t, k) for k in ("alpha", "rho", "num_neg", "num_pos")},
                                               "sums": list(t.sums)},
            "last": None if last is None else last._asdict(),
            "generator": self.generator.get_state(),
            "strength_rule": self.cfg.strength,
            "gate_counts": list(self.gate_counts),
            "alpha_lp": self.alpha_lp,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()` output; ConfigError for a state of another or an unsupported `strength` rule."""
        recorded = state.get("strength_rule")
        resume = "start a new run (checkpoint.resume=false or another run_dir)"
        if recorded in REMOVED_STRENGTHS or state.get("agreement") is not None:
            rule = f"strength={recorded}" if recorded in REMOVED_STRENGTHS else "lower_target=agreement"
            raise ConfigError(f"the checkpoint's calibration state was written under algo.calibration.{rule}, which this "
                              f"code does not support: {resume}")
        if recorded is None:
            raise ConfigError(f"the checkpoint's calibration state names no algo.calibration.strength: {resume}")
        if recorded != self.cfg.strength:
            raise ConfigError(
                f"algo.calibration.strength={self.cfg.strength}, but the checkpoint was written by a run calibrating with "
                f"strength={recorded}: set algo.calibration.strength={recorded} to resume it as it ran, or {resume} "
                f"to change the rule")
        self.lower, self.upper = _f32(state["lower"]), _f32(state["upper"])
        self.solved = bool(state["solved"])
        t = state["targets"]
        self.targets = None if t is None else CalibrationTargets(
            **{k: float(t[k]) for k in ("alpha", "rho", "num_neg", "num_pos")}, sums=tuple(float(x) for x in t.get("sums", ())))
        last = state.get("last")
        self.last = None if last is None else BoundsSolution(**last)
        self.generator.set_state(state["generator"])
        self.gate_counts = [float(x) for x in state.get("gate_counts", [0.0, 0.0, 0.0, 0.0])]
        self.alpha_lp = float(state.get("alpha_lp", math.nan))


def gate_ratio(hp_below: float, hp_neg: float, lp_below: float, lp_neg: float) -> float:
    """The run's pooled low-precision fraction of negative tokens below 1 - eps_low over the high-precision one on the
    same shadow tokens; nan before high precision clipped any."""
    if not (hp_below > 0 and hp_neg > 0 and lp_neg > 0):
        return math.nan
    return (lp_below / lp_neg) / (hp_below / hp_neg)


def make_clipper(cfg: AlgoConfig) -> Optional[CalibratedClipper]:
    """A CalibratedClipper for `cfg` (eps from cfg.policy_loss), or None when calibration is off."""
    if not cfg.calibration.enabled:
        return None
    return CalibratedClipper(cfg.calibration, eps_low=cfg.policy_loss.eps_low, eps_high=cfg.policy_loss.eps_high)
