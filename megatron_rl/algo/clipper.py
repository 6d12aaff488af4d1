"""`CalibratedClipper`: the state of Calibrated Clipping for a training run, and its one `solve`.

It holds the targets (alpha, rho), the held bounds (L, H) with their EMA, the last solution
(for the metrics) and the subsampling RNG. It never decides *when* anything happens: the
per-step `CalibrationPlan` (megatron_rl/algo/calibration_plan.py) does, and the callers hand
the clipper a `RatioStats` of the pooled token set when the plan says a solve is due:

    stats = RatioStats(...); stats.add(ratio, adv, ratio_hp=...)   # every micro-batch, local
    clipper.solve(stats, group, smooth=True)                         # once: reduce + targets + L, H
    lower, upper = clipper.bounds(device)                            # 0-d tensors for the loss

`solve` (docs/CALIBRATED_CLIPPING.md section 2; order of the guard rails in algo/calibration.py):
reduce the statistics over `group` (one collective round, every rank of the group calls it);
if they hold high-precision sums (a calibration event), update the targets; if they hold FP8
statistics and targets exist, solve L and H and hold them: with `smooth`, new = smoothing * held +
(1 - smoothing) * applied (the first solve of a run is taken as is); without, the applied bounds themselves.
applied = the solved bounds (w = 1) or w of the way to them from the vanilla bounds in log space; w is 1 under strength=full,
0 or 1 under strength=gated (1 once the run's pooled excess clipping passes the tolerance, `gate_strength`),
and each calibration event's excess clipping under strength=excess (`excess_strength`). Under strength=decision (the
default) no bound ever moves: the bounds stay vanilla and the loop decides every clip on high-precision ratios from the
first step (`decides_on_high_precision`, phases/error_scale.py); likewise an open gate (w = 1) under
gate_opens_to=high_precision_decision, from the step after it opens.
The targets and w take the pooled counts of the last `target_events` calibration events (1: each event alone).
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

from megatron_rl.algo.calibration import (Agreement, BoundsSolution, CalibrationTargets, RatioStats, agreement_counts,
                                         agreement_grid, best_agreement, solve_bounds, targets_from_sums)
from megatron_rl.algo.ratio_stats import HistSpec
from megatron_rl.config.algo import AlgoConfig, CalibrationConfig
from megatron_rl.config.run import ConfigError

def _f32(x: float) -> float:
    """x rounded to float32, the precision the loss compares ratios in."""
    return float(np.float32(x))


class CalibratedClipper:
    """Targets, held bounds (EMA), last solution and subsampling RNG; checkpointed via state_dict()."""

    def __init__(self, cfg: CalibrationConfig, *, eps_low: float, eps_high: float) -> None:
        """Start at the uncalibrated bounds 1 - eps_low, 1 + eps_high (static targets are set at once)."""
        self.cfg = cfg
        self.eps_low, self.eps_high = float(eps_low), float(eps_high)
        self.hist_spec = HistSpec(cfg.hist_bins, cfg.hist_log_min, cfg.hist_log_max)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.lower, self.upper = _f32(1.0 - self.eps_low), _f32(1.0 + self.eps_high)
        self.targets: Optional[CalibrationTargets] = None
        if cfg.target_source == "static":
            self.targets = CalibrationTargets.of(cfg.static_alpha, cfg.static_rho)
        self.solved = False
        self.last: Optional[BoundsSolution] = None
        self.strength = 1.0 if cfg.strength == "full" else 0.0
        """Share w of the way from the vanilla bounds to the solved ones (strength=excess and gated: set at every
        calibration event)."""
        self.gate_counts = [0.0, 0.0, 0.0, 0.0]
        """strength=gated and decision (where they only measure): negative tokens below 1 - eps_low and all negative tokens, under the shadow's high-precision
        ratios and under the low-precision ones, summed over every calibration event of the run."""
        self.alpha_lp = math.nan
        """Fraction of negative tokens the low-precision ratios put below 1 - eps_low at the last calibration event(s)."""
        self.deflation = 1.0
        """lower_target=deflated: pooled alpha_hp / alpha_lp of the recent events (shrunk toward 1), the share of the
        low-precision clipping high precision would do."""
        self.alpha_solved = math.nan
        """The fraction of negative tokens the last solve aimed below L (the held alpha, or the deflated one)."""
        self.events: list[list[float]] = []
        """Per recent calibration event (at most cfg.target_events): its reference sums, then its low-precision
        (|N below 1 - eps_low|, |N|), then (lower_target=agreement) its `agreement_counts`; the targets and w pool them."""
        self.agreement: Optional[Agreement] = None
        """lower_target=agreement: the best-agreeing candidate of the recent events, whose alpha later solves hold."""
        self.grid: Optional[list[float]] = None
        if cfg.lower_target == "agreement":
            top = min(1.0 - self.eps_low, cfg.lower_max) if cfg.relax_only else cfg.lower_max
            self.grid = agreement_grid(min(cfg.lower_min, top), top, cfg.agreement_points)

    def new_stats(self, *, fp8: bool = True, reference: bool = False, record: bool = False, weighted: bool = False) -> RatioStats:
        """An empty `RatioStats` with this clipper's backend, eps and bins (`weighted`: tokens carry weights)."""
        return RatioStats(self.cfg.backend, fp8=fp8, reference=reference, eps_low=self.eps_low, eps_high=self.eps_high,
                          hist_spec=self.hist_spec, record=record, weighted=weighted,
                          agreement=reference and self.grid is not None)

    def solve(self, stats: RatioStats, group: Optional[object] = None, *, smooth: bool = True,
              quantile: str = "same_tokens") -> Optional[BoundsSolution]:
        """Reduce `stats` over `group`, update targets and held bounds (see module docstring); the solution, or None when none ran.
        `quantile` (calibration.QUANTILES): same_tokens for bounds applied to the solved tokens, next_tokens for later ones."""
        c = self.cfg
        reduced = stats.reduce(group, max_samples_per_rank=c.max_samples_per_rank, generator=self.generator)
        event = reduced.targets
        if event is not None:
            fp8 = reduced.fp8
            lp = [fp8.neg_count_below(1.0 - self.eps_low), fp8.num_neg] if fp8 is not None else [0.0, 0.0]
            scored = agreement_counts(reduced.agreement, self.grid) if reduced.agreement is not None else []
            # an event recorded under another rule (a resume that switched it on) has no counts: it cannot pool
            width = 7 + len(scored)
            self.events = ([e for e in self.events if len(e) == width] + [list(event.sums) + lp + scored])[-c.target_events:]
            pooled = [sum(col) for col in zip(*self.events)]
            event = targets_from_sums(pooled[:5])
            self.targets = event.merged_into(self.targets)
        if reduced.fp8 is None or self.targets is None:
            return None
        if event is not None and pooled[6] > 0 and event.num_neg > 0:
            self.alpha_lp = pooled[5] / pooled[6]
            if c.strength == "excess":
                self.strength = excess_strength(event.alpha, self.alpha_lp, c.excess_tolerance)
            if c.lower_target == "deflated":
                self.deflation = deflation(event.alpha, self.alpha_lp, event.num_neg, c.deflate_prior_tokens)
        if reduced.targets is not None and c.strength in ("gated", "decision"):
            # this event's own counts (not the target_events pool, which would count an event several times)
            new = self.events[-1]
            self.gate_counts = [total + n for total, n in zip(self.gate_counts, (new[1], new[0], new[5], new[6]))]
            if c.strength == "gated":
                self.strength = gate_strength(*self.gate_counts, c.excess_tolerance, c.gate_min_tokens)
        if event is not None and self.grid is not None and len(pooled) > 7:
            self.agreement = best_agreement(pooled[7:], self.grid, num_neg=pooled[0], num_hp_clipped=pooled[1],
                                            beta=c.agreement_beta) or self.agreement
        targets = self.targets
        if self.agreement is not None:
            targets = CalibrationTargets(self.agreement.alpha, targets.rho, targets.num_neg, targets.num_pos, targets.sums)
        if c.lower_target == "deflated" and reduced.fp8.num_neg > 0:
            alpha_now = reduced.fp8.neg_count_below(1.0 - self.eps_low) / reduced.fp8.num_neg
            targets = CalibrationTargets(alpha_now * self.deflation, targets.rho, targets.num_neg, targets.num_pos, targets.sums)
        self.alpha_solved = targets.alpha
        sol = solve_bounds(
            reduced.fp8, targets, eps_low=self.eps_low, eps_high=self.eps_high, upper=c.upper,
            lower_min=c.lower_min, lower_max=c.lower_max, upper_min=c.upper_min, upper_max=c.upper_max,
            relax_only=c.relax_only, previous=(self.lower, self.upper), quantile=quantile, lower_floor=c.lower_floor,
        )
        w = 0.0 if self.high_precision_decision_rule else self.strength  # that rule decides instead of moving bounds
        lower = _toward(1.0 - self.eps_low, sol.lower, w)
        upper = _toward(1.0 + self.eps_high, sol.upper, w)
        s = c.smoothing if smooth and self.solved else 0.0
        self.lower = _f32(s * self.lower + (1.0 - s) * lower)
        self.upper = _f32(s * self.upper + (1.0 - s) * upper)
        self.solved = True
        self.last = sol
        return sol

    def bounds(self, device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The held (lower, upper) as 0-d float32 tensors on `device` (the loss data's device)."""
        return self.as_bounds(self.lower, self.upper, device)

    def on_policy_bounds(self, device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Bounds of a step's on-policy update under on_policy_bounds=open: the guard rails' outer limits [lower_min,
        upper_max], or the held bounds while a closed gate (strength=gated, w = 0) or a high-precision decision keeps
        the run at the vanilla ones."""
        if self.high_precision_decision_rule or (self.cfg.strength == "gated" and self.strength == 0.0):
            return self.bounds(device)
        return self.as_bounds(self.cfg.lower_min, self.cfg.upper_max, device)

    @property
    def high_precision_decision_rule(self) -> bool:
        """Whether this run's rule decides clips on high-precision ratios instead of moving the bounds: always
        (strength=decision) or once its gate opens (strength=gated, gate_opens_to=high_precision_decision)."""
        c = self.cfg
        return c.strength == "decision" or (c.strength == "gated" and c.gate_opens_to == "high_precision_decision")

    def decides_on_high_precision(self) -> bool:
        """Whether the clip is decided on high-precision ratios (at the vanilla bounds) now: on every step under
        strength=decision, while the gate is open under that gated form (until a calibration event closes it)."""
        if self.cfg.strength == "decision":
            return True
        return self.high_precision_decision_rule and self.strength == 1.0

    @staticmethod
    def as_bounds(lower: float, upper: float, device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(lower, upper) as the loss takes them: 0-d float32 tensors on `device` (never Python floats: no recompiles)."""
        return (torch.tensor(_f32(lower), dtype=torch.float32, device=device),
                torch.tensor(_f32(upper), dtype=torch.float32, device=device))

    def metrics(self) -> dict[str, float]:
        """Held bounds, targets, and the achieved alpha/rho of the last solve (nan where undefined)."""
        t, last, c = self.targets, self.last, self.cfg
        return {
            "calib/lower": self.lower, "calib/upper": self.upper,
            "calib/alpha_target": t.alpha if t is not None else math.nan,
            "calib/rho_target": t.rho if t is not None else math.nan,
            "calib/alpha_achieved": last.alpha_achieved if last is not None else math.nan,
            "calib/rho_achieved": last.rho_achieved if last is not None else math.nan,
            "calib/strength": self.strength, "calib/alpha_lp": self.alpha_lp,
            "calib/deflation": self.deflation, "calib/alpha_solved": self.alpha_solved,
            **({} if c.strength not in ("gated", "decision") else {
                "calib/gate_ratio": gate_ratio(*self.gate_counts), "calib/gate_hp_tokens": self.gate_counts[0]}),
            **({} if self.grid is None else {
                f"calib/agreement_{k}": getattr(self.agreement, k) if self.agreement is not None else math.nan
                for k in ("lower", "precision", "recall")}),
        }

    @staticmethod
    def solution_metrics(sol: Optional[BoundsSolution]) -> dict[str, float]:
        """calib/solve_*: one solve's bounds after the guard rails (before EMA) and before them (raw); empty without a solve."""
        if sol is None:
            return {}
        return {"calib/solve_lower": sol.lower, "calib/solve_upper": sol.upper,
                "calib/solve_lower_raw": sol.lower_raw, "calib/solve_upper_raw": sol.upper_raw}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume and to log the same metrics: bounds, targets, last solution, RNG."""
        t, last = self.targets, self.last
        return {
            "lower": self.lower,
            "upper": self.upper,
            "solved": self.solved,
            "targets": None if t is None else {**{k: getattr(t, k) for k in ("alpha", "rho", "num_neg", "num_pos")},
                                               "sums": list(t.sums)},
            "last": None if last is None else last._asdict(),
            "generator": self.generator.get_state(),
            "strength": self.strength,
            "strength_rule": self.cfg.strength,
            "gate_opens_to": self.cfg.gate_opens_to,
            "gate_counts": list(self.gate_counts),
            "alpha_lp": self.alpha_lp,
            "events": [list(e) for e in self.events],
            "deflation": self.deflation,
            "alpha_solved": self.alpha_solved,
            "agreement": None if self.agreement is None else self.agreement._asdict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()` output; ConfigError when it was written under another `strength` rule."""
        recorded = state.get("strength_rule")
        allowed = {recorded}
        if recorded is None and "gate_counts" not in state and state.get("targets") is not None:
            recorded, allowed = "full or excess", {"full", "excess"}  # calibrated before strength=gated existed
        if recorded is not None and self.cfg.strength not in allowed:
            # the default changed on 2026-12-02, -04 and twice on -05: resuming an older run under it would switch rules mid-run
            raise ConfigError(
                f"algo.calibration.strength={self.cfg.strength}, but the checkpoint was written by a run calibrating with "
                f"strength={recorded}: set algo.calibration.strength to the rule it ran with (gated was the default "
                f"2026-12-05 until session 42, full 2026-12-04..05, excess 2026-12-02..04) to resume it as it ran, or start a new run "
                f"(checkpoint.resume=false or another run_dir) to change the rule")
        # checkpoints from before gate_opens_to existed moved the bounds when the gate opened
        opens_to = state.get("gate_opens_to", "solved_bounds")
        if self.cfg.strength == "gated" and recorded == "gated" and opens_to != self.cfg.gate_opens_to:
            raise ConfigError(
                f"algo.calibration.gate_opens_to={self.cfg.gate_opens_to}, but the checkpoint was written by a run whose "
                f"open gate went to {opens_to}: set algo.calibration.gate_opens_to={opens_to} to resume it as it ran, or "
                f"start a new run (checkpoint.resume=false or another run_dir) to change it")
        self.lower, self.upper = _f32(state["lower"]), _f32(state["upper"])
        self.solved = bool(state["solved"])
        t = state["targets"]
        self.targets = None if t is None else CalibrationTargets(
            **{k: float(t[k]) for k in ("alpha", "rho", "num_neg", "num_pos")}, sums=tuple(float(x) for x in t.get("sums", ())))
        last = state.get("last")
        self.last = None if last is None else BoundsSolution(**last)
        self.generator.set_state(state["generator"])
        # checkpoints from before strength=excess applied the solved bounds in full
        self.strength = float(state.get("strength", 1.0))
        # checkpoints from before strength=gated counted nothing
        self.gate_counts = [float(x) for x in state.get("gate_counts", [0.0, 0.0, 0.0, 0.0])]
        self.alpha_lp = float(state.get("alpha_lp", math.nan))
        # checkpoints from before target_events pooled nothing across events
        self.events = [[float(x) for x in e] for e in state.get("events", [])]
        # checkpoints from before lower_target=deflated
        self.deflation = float(state.get("deflation", 1.0))
        self.alpha_solved = float(state.get("alpha_solved", math.nan))
        agreement = state.get("agreement")
        self.agreement = None if agreement is None else Agreement(**{k: float(v) for k, v in agreement.items()})


def excess_strength(alpha_hp: float, alpha_lp: float, tolerance: float) -> float:
    """w = clamp(1 - (1 + tolerance) alpha_hp / alpha_lp, 0, 1): the share of the low-precision clipping beyond what
    high precision clips, past the tolerated excess (0 when low precision clips nothing)."""
    if not alpha_lp > 0:
        return 0.0
    return min(max(1.0 - (1.0 + tolerance) * alpha_hp / alpha_lp, 0.0), 1.0)


def gate_strength(hp_below: float, hp_neg: float, lp_below: float, lp_neg: float, tolerance: float,
                  min_tokens: float) -> float:
    """1 (calibrate in full) when the low-precision fraction of negative tokens below 1 - eps_low exceeds (1 + tolerance)
    times the high-precision one and high precision put at least `min_tokens` (and at least one) below it, else 0
    (vanilla bounds); counts summed over the run's calibration events."""
    if not (hp_below >= max(min_tokens, 1.0) and hp_neg > 0 and lp_neg > 0):
        return 0.0
    return 1.0 if lp_below / lp_neg > (1.0 + tolerance) * hp_below / hp_neg else 0.0


def gate_ratio(hp_below: float, hp_neg: float, lp_below: float, lp_neg: float) -> float:
    """The run's pooled low-precision fraction of negative tokens below 1 - eps_low over the high-precision one on the
    same shadow tokens (what strength=gated compares with 1 + excess_tolerance); nan before high precision clipped any."""
    if not (hp_below > 0 and hp_neg > 0 and lp_neg > 0):
        return math.nan
    return (lp_below / lp_neg) / (hp_below / hp_neg)


def deflation(alpha_hp: float, alpha_lp: float, num_neg: float, prior_tokens: float) -> float:
    """(n_hp + prior) / (n_lp + prior) with n = alpha * num_neg: the share of the low-precision clipping below
    1 - eps_low that high precision does on the same tokens, shrunk toward 1 (no distortion) by `prior_tokens`
    pseudo-tokens on both sides; at most 1 (calibration only relaxes; relax_only would cap a larger share anyway)."""
    n_hp, n_lp = alpha_hp * num_neg + prior_tokens, alpha_lp * num_neg + prior_tokens
    if not n_lp > 0:
        return 1.0
    return min(n_hp / n_lp, 1.0)


def _toward(vanilla: float, solved: float, w: float) -> float:
    """The bound w of the way from `vanilla` to `solved` in log space (ratios are compared multiplicatively)."""
    if w >= 1.0:
        return solved
    if w <= 0.0:
        return vanilla
    return math.exp((1.0 - w) * math.log(vanilla) + w * math.log(solved))


def make_clipper(cfg: AlgoConfig) -> Optional[CalibratedClipper]:
    """A CalibratedClipper for `cfg` (eps from cfg.policy_loss), or None when calibration is off."""
    if not cfg.calibration.enabled:
        return None
    return CalibratedClipper(cfg.calibration, eps_low=cfg.policy_loss.eps_low, eps_high=cfg.policy_loss.eps_high)
