"""The learner's loss_fn for RL: the policy objective at given bounds, plus the calibration tap.

Runs on the last pipeline stage inside megatron's schedule, once per micro-batch, never inside an
activation-recompute region (the Learner calls it on the final logits). It runs no collective:
on the updates the CalibrationPlan names it adds the micro-batch's shadow-row tokens (FP8 ratio,
high-precision ratio, advantage) to the step's `RatioStats`, which are reduced over DP x CP once,
when the step's solve runs (phases/calibrate.py). Under rollout.overlap=one_step_off the samples are
one weight version behind the learner and each token enters the statistics with the rollout-correction
weight (TIS/MIS) the loss multiplies it by, so the solve describes the token mix the objective sees.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_rl.algo import metrics as M
from megatron_rl.algo.calibration import RatioStats
from megatron_rl.algo.calibration_plan import CalibrationPlan
from megatron_rl.algo.losses import log_ratio
from megatron_rl.algo.objective import default_bounds, policy_objective
from megatron_rl.algo.rollout_correction import rollout_correction
from megatron_rl.config.algo import AlgoConfig
from megatron_rl.phases import error_scale
from megatron_rl.types import TrainBatch


def with_sequence_rollout_weights(batch: TrainBatch, algo: AlgoConfig) -> TrainBatch:
    """Attach sequence-level correction weights computed on whole rows (before any CP split); token level is left to the loss."""
    rc = algo.rollout_correction
    if rc.mode == "none" or rc.level != "sequence":
        return batch
    corr = rollout_correction(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, mode=rc.mode, level=rc.level,
                              tis_cap=rc.tis_cap, mis_low=rc.mis_low, mis_high=rc.mis_high)
    return batch.with_fields(rollout_weight=corr.weight.detach())


def correction_weight(mb: TrainBatch, algo: AlgoConfig) -> torch.Tensor:
    """[B, S] rollout-correction weight of each token: the factor the loss multiplies its policy term by (1 without one)."""
    rc = algo.rollout_correction
    if mb.rollout_weight is not None:
        return mb.rollout_weight.detach()
    if rc.mode == "none" or mb.rollout_logprobs is None:
        return torch.ones_like(mb.loss_mask, dtype=torch.float64)
    return rollout_correction(mb.old_logprobs, mb.rollout_logprobs, mb.loss_mask, mode=rc.mode, level=rc.level,
                              tis_cap=rc.tis_cap, mis_low=rc.mis_low, mis_high=rc.mis_high).weight.detach()


@dataclass
class CalibrationTap:
    """Where one update's calibration tokens go: the plan (which rows), the step's statistics and the update's index."""

    plan: CalibrationPlan
    """The step's plan (its shadow rows select the tokens)."""
    stats: RatioStats
    """The step's pooled statistics (local to this rank until the solve)."""
    update: int
    """Index of the update within the step (recorded in the ratio dumps)."""


class RLLoss:
    """Callable `loss_fn(logprobs, entropy, mb, ctx)` for Learner.train_step."""

    def __init__(self, algo: AlgoConfig, bounds: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                 tap: Optional[CalibrationTap] = None, off_policy: bool = False, gate_open: bool = False) -> None:
        """Clip at `bounds` (default 1 -/+ eps); with `tap`, add each micro-batch's calibration tokens to tap.stats;
        `off_policy` updates also report their clip fractions under offpolicy/ (what a calibration solve targets);
        `gate_open`: calibration (strength=decision) decides the clip on high-precision ratios this step."""
        self.algo = algo
        self.gate_open = gate_open
        self.bounds = bounds
        self.tap = tap
        self.off_policy = off_policy
        self.sums: Optional[dict[str, torch.Tensor]] = None
        """Metric sums of this rank's micro-batches (vector histograms included), reduced by the loop."""

    def _collect(self, logprobs: torch.Tensor, mb: TrainBatch, observed: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """Add this micro-batch's tokens to the step's statistics (FP8: the plan's FP8 rows; high precision: the shadow
        rows of an event); returns the shadow metrics in sum form."""
        tap, clamp = self.tap, self.algo.policy_loss.log_ratio_clamp
        valid = mb.loss_mask > 0
        tokens = valid & tap.plan.fp8_row_mask(mb.sample_index, mb.batch_size).to(valid.device)[:, None]
        # the same clamp and formula as the objective, so the solve sees the ratios the loss clips
        ratio = torch.exp(log_ratio(logprobs.detach(), mb.old_logprobs, clamp)) if observed is None else observed
        extra: dict[str, torch.Tensor] = {}
        ratio_hp, hp_mask = None, None
        if tap.stats.collect_reference:
            if mb.logprobs_hp is None or mb.old_logprobs_hp is None:
                raise ValueError("a shadow update needs logprobs_hp and old_logprobs_hp in its micro-batches")
            shadow = valid & tap.plan.row_mask(mb.sample_index, mb.batch_size).to(valid.device)[:, None]
            lr_hp = log_ratio(mb.logprobs_hp, mb.old_logprobs_hp, clamp)
            ratio_hp_full = torch.exp(lr_hp)
            ratio_hp, hp_mask = ratio_hp_full[tokens], shadow[tokens]
            lo_ref, hi_ref = default_bounds(self.algo, device=ratio.device)
            shadow_mask = shadow.to(mb.loss_mask.dtype)
            extra.update(M.clip_fraction_sums(ratio_hp_full, mb.advantages, shadow_mask, lo_ref, hi_ref, prefix="hp/"))
            extra.update(M.clip_fraction_sums(ratio, mb.advantages, shadow_mask, lo_ref, hi_ref, prefix="uncalibrated/"))
            # FP8 ratio noise: how far the FP8 log-ratio sits from the high-precision one, token by token.
            noise = (log_ratio(logprobs.detach(), mb.old_logprobs, clamp) - lr_hp).abs()
            extra.update(M.masked_mean_sums("fp8/log_ratio_abs_err", noise, shadow_mask))
        # weighted (one_step_off): stale tokens count as much as the loss weighs them, so the solve sees pi_old's mix
        weight = correction_weight(mb, self.algo).to(valid.device)[tokens] if tap.stats.weighted else None
        tap.stats.add(ratio[tokens], mb.advantages[tokens], ratio_hp=ratio_hp, update=tap.update, weight=weight,
                      hp_mask=None if hp_mask is None or bool(hp_mask.all()) else hp_mask)
        return extra

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: TrainBatch, ctx) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """0-d loss in global sum form for one micro-batch (its metric sums accumulate in `self.sums`)."""
        if mb.old_logprobs is None or mb.token_weight is None:
            raise ValueError("RL micro-batches need old_logprobs and token_weight")
        # a clip decided on high-precision ratios (phases/error_scale.py): None and {} unless one is on
        clip_ratio, dose = error_scale.clip_decision(logprobs, mb, self.algo, self.bounds, self.gate_open)
        # calibration observes the learner's distortion (r_k under the instrument), whatever decides the clip
        extra = self._collect(logprobs, mb, error_scale.observed_ratio(logprobs, mb, self.algo)) if self.tap is not None else {}
        loss, sums = policy_objective(
            logprobs, mb.old_logprobs, mb.advantages, mb.token_weight, mb.loss_mask, self.bounds,
            rollout_logprobs=mb.rollout_logprobs, ref_logprobs=mb.ref_logprobs, entropy=entropy, cfg=self.algo,
            rollout_weight=mb.rollout_weight, clip_ratio=clip_ratio,
        )
        if self.off_policy:
            sums.update({f"offpolicy/{k}": v for k, v in sums.items() if k.startswith("clipfrac")})
        sums.update(extra)
        sums.update(dose)
        self.sums = M.add_sums(self.sums, sums)
        return loss, {}
