"""The composed per-micro-batch RL objective the learner's loss_fn calls.

    loss, metrics = policy_objective(logprobs, old_logprobs, advantages, token_weight,
                                     loss_mask, bounds=(lower, upper), ...)

`loss` is sum(token_weight * per_token_loss): summing it over micro-batches and DP ranks
gives the globally aggregated loss (token_weight from megatron_rl.algo.aggregation).
`metrics` are in sum form (see megatron_rl/algo/metrics.py): sum them the same way, then
call `finalize_metrics`.

Per-token loss = policy_loss * rollout_correction_weight + kl_coef * KL - entropy_coef * entropy.

The learner's loss_fn (megatron_rl/phases/loss.py) calls it with the bounds the step's
CalibrationPlan chose (held calibrated bounds, a per_minibatch solve, or None for 1 -/+ eps).
Every tensor created here takes the device (and dtype) of the log-probs, bounds included.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.algo import metrics as M
from megatron_rl.algo.kl import entropy_bonus, kl_penalty
from megatron_rl.algo.losses import log_ratio, policy_loss
from megatron_rl.algo.rollout_correction import rollout_correction
from megatron_rl.config.algo import AlgoConfig


def default_bounds(cfg: AlgoConfig, device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The uncalibrated ratio bounds (1 - eps_low, 1 + eps_high) as 0-d float32 tensors on `device`."""
    p = cfg.policy_loss
    return (torch.tensor(1.0 - p.eps_low, dtype=torch.float32, device=device),
            torch.tensor(1.0 + p.eps_high, dtype=torch.float32, device=device))


def policy_objective(
    logprobs: torch.Tensor,
    old_logprobs: Optional[torch.Tensor],
    advantages: torch.Tensor,
    token_weight: torch.Tensor,
    loss_mask: torch.Tensor,
    bounds: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    rollout_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    cfg: AlgoConfig = AlgoConfig(),
    *,
    rollout_weight: Optional[torch.Tensor] = None,
    clip_ratio: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0-d loss = sum(token_weight * per-token loss) of one micro-batch, and its metrics in sum form.

    All per-token tensors are [B, S]. old_logprobs=None means on-policy (pi_old = pi,
    detached). rollout_weight (precomputed correction weights, e.g. sequence-level under
    context parallelism) overrides the correction computed from rollout_logprobs. clip_ratio (experiment only,
    algo/error_scale.py) decides which tokens the ppo / dual_clip bounds clip; clip metrics then count by it.
    """
    if token_weight is None:
        raise ValueError("policy_objective needs token_weight (megatron_rl.algo.aggregation.token_weights)")
    p = cfg.policy_loss
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    dev, dt = logprobs.device, logprobs.dtype
    lower, upper = default_bounds(cfg, dev) if bounds is None else (torch.as_tensor(b, device=dev) for b in bounds)
    mask = (loss_mask > 0).to(dt)
    adv = advantages.to(dt)
    out = policy_loss(
        p.name, logprobs, old, adv, lower, upper,
        dual_clip_c=torch.tensor(p.dual_clip_c, dtype=dt, device=dev), log_ratio_clamp=p.log_ratio_clamp,
        **({} if clip_ratio is None else {"decision_ratio": clip_ratio}),
    )
    w = token_weight.to(logprobs.dtype) * mask
    sums: dict[str, torch.Tensor] = {}

    rc = cfg.rollout_correction
    pg = out.loss
    if rollout_weight is not None:
        pg = pg * rollout_weight.detach()
        sums.update(M.rollout_correction_sums(rollout_weight.detach(), torch.zeros_like(mask, dtype=torch.bool), loss_mask))
    elif rollout_logprobs is not None and rc.mode != "none":
        corr = rollout_correction(
            old, rollout_logprobs, loss_mask, mode=rc.mode, level=rc.level,
            tis_cap=torch.tensor(rc.tis_cap, device=dev), mis_low=torch.tensor(rc.mis_low, device=dev),
            mis_high=torch.tensor(rc.mis_high, device=dev),
        )
        pg = pg * corr.weight
        sums.update(M.rollout_correction_sums(corr.weight, corr.clipped, loss_mask))
    if rollout_logprobs is not None:
        sums.update(M.mismatch_sums(old, rollout_logprobs, loss_mask, p.log_ratio_clamp))

    total = pg
    sums["loss/pg"] = (w * pg).sum().detach().to(torch.float64)
    if cfg.kl.coef > 0:
        if ref_logprobs is None:
            raise ValueError("algo.kl.coef > 0 needs ref_logprobs in the batch")
        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl.estimator)
        total = total + torch.tensor(cfg.kl.coef, dtype=dt, device=dev) * kl
        sums["loss/kl"] = (w * kl).sum().detach().to(torch.float64)
        sums.update(M.masked_mean_sums("kl_ref", kl, loss_mask))
    if p.entropy_coef > 0:
        if entropy is None:
            raise ValueError("algo.policy_loss.entropy_coef > 0 needs the per-token entropy")
        total = total + entropy_bonus(entropy, torch.tensor(p.entropy_coef, dtype=entropy.dtype, device=entropy.device))
    if entropy is not None:
        sums.update(M.masked_mean_sums("entropy", entropy, loss_mask))

    loss = (w * total).sum()
    sums["loss/total"] = loss.detach().to(torch.float64)
    sums.update(M.clip_fraction_sums(out.ratio, adv, loss_mask, lower, upper))
    sums.update(M.masked_mean_sums("ppo_kl", -log_ratio(logprobs.detach(), old.detach(), p.log_ratio_clamp), loss_mask))
    if p.name == "dual_clip":
        sums.update(M.masked_mean_sums("clipfrac_dual", out.clipped_dual.to(torch.float64), loss_mask))
    sums.update(M.ratio_histograms(out.ratio, adv, loss_mask, cfg.ratio_hist_bins, cfg.ratio_hist_log_range))
    return loss, sums
