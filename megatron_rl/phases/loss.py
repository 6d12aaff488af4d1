"""The learner's loss_fn for RL: calibrated clip bounds (collective over DP x CP) + the policy objective.

Runs on the last pipeline stage inside megatron's schedule, once per micro-batch, never inside an
activation-recompute region (the Learner calls it on the final logits). Every DP rank runs the
same number of micro-batches and calls the clipper on each, so the ratio collectives match up
even on ranks whose micro-batch holds no response tokens.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.algo import metrics as M
from megatron_rl.algo.clipper import CalibratedClipper
from megatron_rl.algo.objective import policy_objective
from megatron_rl.algo.rollout_correction import rollout_correction
from megatron_rl.config.algo import AlgoConfig
from megatron_rl.types import TrainBatch


def with_sequence_rollout_weights(batch: TrainBatch, algo: AlgoConfig) -> TrainBatch:
    """Attach sequence-level correction weights computed on whole rows (before any CP split); token level is left to the loss."""
    rc = algo.rollout_correction
    if rc.mode == "none" or rc.level != "sequence":
        return batch
    corr = rollout_correction(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, mode=rc.mode, level=rc.level,
                              tis_cap=rc.tis_cap, mis_low=rc.mis_low, mis_high=rc.mis_high)
    return batch.with_fields(rollout_weight=corr.weight.detach())


class RLLoss:
    """Callable `loss_fn(logprobs, entropy, mb, ctx)` for Learner.train_step."""

    def __init__(self, algo: AlgoConfig, clipper: Optional[CalibratedClipper], step: int, first_micro_batch: int = 0,
                 bounds: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        """`first_micro_batch` numbers micro-batches across the step's mini-batches (shadow sub-sampling is keyed on it).

        Without a clipper the loss clips at `bounds` (the last calibrated ones on the on-policy first mini-batch,
        whose ratios are 1 up to FP8 noise and say nothing to calibrate on) or at the default 1 -/+ eps.
        """
        self.algo = algo
        self.clipper = clipper
        self.fixed_bounds = bounds
        self.step = step
        self.first_micro_batch = first_micro_batch
        self.sums: Optional[dict[str, torch.Tensor]] = None
        """Metric sums of this rank's micro-batches (vector histograms included), reduced by the loop."""

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: TrainBatch, ctx) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """0-d loss in global sum form for one micro-batch (its metric sums accumulate in `self.sums`)."""
        if mb.old_logprobs is None or mb.token_weight is None:
            raise ValueError("RL micro-batches need old_logprobs and token_weight")
        valid = mb.loss_mask > 0
        bounds = self.fixed_bounds
        extra: dict[str, torch.Tensor] = {}
        if self.clipper is not None:
            index = self.first_micro_batch + ctx.micro_batch_index
            log_ratio = (logprobs.detach() - mb.old_logprobs).clamp(-20.0, 20.0)
            ratio_hp = None
            if mb.logprobs_hp is not None and mb.old_logprobs_hp is not None and self.clipper.wants_shadow(self.step, index):
                ratio_hp_full = torch.exp((mb.logprobs_hp - mb.old_logprobs_hp).clamp(-20.0, 20.0))
                ratio_hp = ratio_hp_full[valid]
                lo_ref = torch.tensor(1.0 - self.algo.policy_loss.eps_low)
                hi_ref = torch.tensor(1.0 + self.algo.policy_loss.eps_high)
                extra.update(M.clip_fraction_sums(ratio_hp_full, mb.advantages, mb.loss_mask, lo_ref, hi_ref, prefix="hp/"))
                extra.update(M.clip_fraction_sums(torch.exp(log_ratio), mb.advantages, mb.loss_mask, lo_ref, hi_ref, prefix="uncalibrated/"))
                # FP8 ratio noise: how far the FP8 log-ratio sits from the high-precision one, token by token.
                noise = (log_ratio - (mb.logprobs_hp - mb.old_logprobs_hp).clamp(-20.0, 20.0)).abs()
                extra.update(M.masked_mean_sums("fp8/log_ratio_abs_err", noise, mb.loss_mask))
            bounds = self.clipper.update(torch.exp(log_ratio)[valid], mb.advantages[valid], ratio_hp=ratio_hp, group=ctx.group)
        loss, sums = policy_objective(
            logprobs, mb.old_logprobs, mb.advantages, mb.token_weight, mb.loss_mask, bounds,
            rollout_logprobs=mb.rollout_logprobs, ref_logprobs=mb.ref_logprobs, entropy=entropy, cfg=self.algo,
            rollout_weight=mb.rollout_weight,
        )
        sums.update(extra)
        self.sums = M.add_sums(self.sums, sums)
        return loss, {}
