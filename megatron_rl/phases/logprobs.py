"""Log-prob phase: pi_old (FP8 forward), its high-precision shadow and the reference policy.

Each DP rank computes its rows, then the rows are all-gathered so every rank holds the whole
step batch (mini-batch membership is decided after this, identically on every rank). The
high-precision shadow forwards run only on the CalibrationPlan's shadow rows (shadow_fraction),
so their cost falls with the fraction; rows outside it hold 0 and are never read.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional, Sequence

import torch

from megatron_rl.algo.calibration_plan import CalibrationPlan
from megatron_rl.parallel import state
from megatron_rl.parallel.comm import all_gather_dp_rows
from megatron_rl.phases.batching import dp_shard
from megatron_rl.precision import high_precision
from megatron_rl.precision.scale_book import book_of
from megatron_rl.types import TrainBatch


def _local_parameters(learner):
    """(chunk-qualified name, parameter) of this rank's model chunks, all-gathered first (every rank calls this)."""
    learner.finish_param_sync()
    for i, chunk in enumerate(learner.model):
        for name, p in chunk.named_parameters():
            yield f"{i}.{name}", p


class ReferencePolicy:
    """The frozen initial policy for the KL term, kept as this rank's parameter shards (no gather)."""

    def __init__(self, learner) -> None:
        """Snapshot the learner's current local parameters."""
        self.params = {name: p.detach().clone() for name, p in _local_parameters(learner)}

    def logprobs(self, learner, batch: TrainBatch, micro_batch_size: int) -> torch.Tensor:
        """Reference log-probs: swap the snapshot in, forward, swap the live weights back bit-exactly."""
        live = {name: p.detach().clone() for name, p in _local_parameters(learner)}
        with torch.no_grad(), book_of(learner).paused():  # other weights: never pi_old's scales
            for name, p in _local_parameters(learner):
                p.copy_(self.params[name])
            try:
                lp, _ = learner.forward_logprobs(batch, micro_batch_size)
            finally:
                for name, p in _local_parameters(learner):
                    p.copy_(live[name])
        return lp


def _global_forward(learner, batch: TrainBatch, micro_batch_size: int,
                    row_groups: Optional[Sequence[torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy of the whole step batch: each DP rank does its shard, then rows are gathered. With
    `row_groups` each group of rows is forwarded on its own (DP shards and micro-batches cut from the group, as an
    update over those rows cuts them) and the results go back to their rows."""
    if row_groups is None:
        shard = dp_shard(batch, state.dp_rank(), state.dp_size())
        lp, ent = learner.forward_logprobs(shard, micro_batch_size)
        return all_gather_dp_rows(lp), all_gather_dp_rows(ent)
    lp = ent = None
    for rows in row_groups:
        lp_g, ent_g = _global_forward(learner, batch.select(rows), micro_batch_size)
        if lp is None:
            lp = lp_g.new_zeros((batch.batch_size, *lp_g.shape[1:]))
            ent = ent_g.new_zeros((batch.batch_size, *ent_g.shape[1:]))
        lp[rows.to(lp.device)] = lp_g
        ent[rows.to(ent.device)] = ent_g
    return lp, ent


def _padded(batch: TrainBatch, rows: list[int], multiple: int) -> TrainBatch:
    """Rows `rows` of `batch`, padded with copies of the first to a multiple of `multiple` rows (forwards need whole micro-batches)."""
    pad = -len(rows) % multiple
    return batch.select(rows + rows[:1] * pad)


def shadow_old_logprobs(learner, batch: TrainBatch, rows: list[int], micro_batch_size: int) -> torch.Tensor:
    """High-precision pi_old of step-batch rows `rows` ([B, S], zero on other rows): only those rows are forwarded, balanced over DP."""
    if len(rows) == batch.batch_size:
        with high_precision():
            return _global_forward(learner, batch, micro_batch_size)[0]
    if not rows:
        return torch.zeros_like(batch.loss_mask, dtype=torch.float32)
    # a few rows forward in micro-batches of their own size, not padded up to whole training micro-batches
    mbs = min(micro_batch_size, -(-len(rows) // state.dp_size()))
    sub = _padded(batch, rows, state.dp_size() * mbs)
    with high_precision():
        lp_sub, _ = _global_forward(learner, sub, mbs)
    out = torch.zeros_like(batch.loss_mask, dtype=lp_sub.dtype, device=lp_sub.device)
    out[rows] = lp_sub[: len(rows)]
    return out


def old_logprobs(learner, batch: TrainBatch, micro_batch_size: int, *, plan: Optional[CalibrationPlan] = None,
                 reference: Optional[ReferencePolicy] = None,
                 probe_rows: Optional[int] = None, kv_cache=None,
                 row_groups: Optional[Sequence[torch.Tensor]] = None) -> tuple[TrainBatch, dict[str, float]]:
    """Attach pi_old (learner precision), the high-precision shadow pi_old on the plan's shadow rows, and reference log-probs.

    `row_groups` (batching.old_logprob_row_groups) forwards pi_old in the first epoch's mini-batches, so each update's
    micro-batches are the tensors pi_old saw: current per-tensor scaling then gives the on-policy update a ratio of
    exactly 1 and later updates only the noise of the weights' change, not of a new batch composition.

    With `probe_rows`, also the mean entropy of pi_old on the first `probe_rows` rows (health/probe_entropy_before):
    the health probe's tokens before the step's updates. The forward fills learner.scale_book (consistent scales).
    With `kv_cache` (phases/kv_cache.py KvCacheScales) the pi_old
    forward also measures the FP8 KV cache's per-layer K/V amax over the rollout batch (kv_cache/* metrics).
    """
    # precision.ratio_consistent_scales: the step's later FP8 forwards of these micro-batches reuse the scales recorded here
    book = book_of(learner)
    if row_groups is None and book.enabled:
        raise ValueError("precision.ratio_consistent_scales needs train.old_logprob_batches=update (pi_old forwarded in the "
                         "micro-batches the updates train on: scales are recorded per micro-batch)")
    with kv_cache.measuring() if kv_cache is not None else nullcontext(), book.recording():
        lp, ent = _global_forward(learner, batch, micro_batch_size, row_groups)
    changes = {"old_logprobs": lp}
    mask = batch.loss_mask > 0
    metrics = {"entropy_old": float(ent[mask].mean()) if mask.any() else float("nan")}
    if kv_cache is not None:
        metrics.update(kv_cache.observe())
    if probe_rows is not None:
        probed = mask[:probe_rows]
        metrics["health/probe_entropy_before"] = float(ent[:probe_rows][probed].mean()) if probed.any() else float("nan")
    if plan is not None and plan.shadow:
        rows = list(plan.shadow_rows)
        lp_hp = shadow_old_logprobs(learner, batch, rows, micro_batch_size)
        changes["old_logprobs_hp"] = lp_hp
        shadow_mask = mask & plan.row_mask(batch.sample_index, batch.batch_size).to(mask.device)[:, None]
        if shadow_mask.any():
            # FP8 noise as seen by the policy: how far the FP8 forward's log-probs sit from high precision.
            d = (lp - lp_hp)[shadow_mask]
            metrics["fp8/logprob_abs_err_mean"] = float(d.abs().mean())
            metrics["fp8/logprob_err_std"] = float(d.std()) if d.numel() > 1 else 0.0
    if reference is not None:
        shard = dp_shard(batch, state.dp_rank(), state.dp_size())
        changes["ref_logprobs"] = all_gather_dp_rows(reference.logprobs(learner, shard, micro_batch_size))
    return batch.with_fields(**changes), metrics


def current_logprobs_hp(learner, shard: TrainBatch, micro_batch_size: int, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """High-precision log-probs of the current policy on this rank's rows (the shadow pi_theta before an update).

    With `rows` ([b] bool, the plan's shadow rows of the shard) only those rows are forwarded (zero elsewhere);
    the ranks of one model replica hold the same shard, so they agree on whether any forward runs.
    """
    if rows is None or bool(rows.all()):
        with high_precision():
            return learner.forward_logprobs(shard, micro_batch_size)[0]
    picked = rows.nonzero().flatten().tolist()
    out = torch.zeros_like(shard.loss_mask)
    if not picked:
        return out
    mbs = min(micro_batch_size, len(picked))
    with high_precision():
        lp, _ = learner.forward_logprobs(_padded(shard, picked, mbs), mbs)
    out = out.to(dtype=lp.dtype, device=lp.device)
    out[picked] = lp[: len(picked)]
    return out


def current_logprobs(learner, shard: TrainBatch, micro_batch_size: int) -> torch.Tensor:
    """No-grad log-probs of the current policy in the learner's precision (FP8) on this rank's rows: the per_minibatch pre-pass."""
    return learner.forward_logprobs(shard, micro_batch_size)[0]
