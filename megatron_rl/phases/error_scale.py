"""A clip decision on high-precision ratios inside a step: the dose-response instrument (experiment only:
algo.experimental.clip_error_scale = k != 1) and its k = 0: the supported algo.policy_loss.clip_decision=high_precision
and algo.calibration.strength=decision (every step). `gate_open` reads the calibration's choice once at the start of
a step from the clipper, so every rank and a resumed run agree.

The clip decision of every training token uses r_k = r_hp * (r_lp / r_hp)^k (algo/error_scale.py), so
every token needs its high-precision ratio: pi_old_hp of the step batch's off-policy rows after the log-probs phase
(`with_old_logprobs_hp`) and the current policy's high-precision log-probs before every update
(`with_logprobs_hp`; the step's first update runs on pi_old's weights, so it reuses pi_old_hp). Calibration
steps that already ran these shadow forwards (all off-policy rows) are not repeated. In the loss
(`clip_decision`): r_k for the clip masks, plus `experimental/*` clip fractions under the unscaled
low-precision and the high-precision ratios of the same tokens and bounds. Off (k = 1) everything here is
a no-op and costs nothing.

Under algo.calibration.strength=targeted (`with_targeted_rows`) only the step's targeted answers
(algo/targeting.py: the off-policy rows whose engine and FP8 learner log-probs disagree most) run these forwards and decide at
k = 0; every other row decides at the instrument's k (1 = its own FP8 ratio, bit for bit). With the instrument on
(k != 1) every row still runs them, as the instrument needs the high-precision ratio of every token.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_rl.algo import metrics as M
from megatron_rl.algo.error_scale import error_scaled_ratio
from megatron_rl.algo.losses import log_ratio
from megatron_rl.algo.objective import default_bounds
from megatron_rl.algo.targeting import engine_gap, targeted_rows
from megatron_rl.config.algo import AlgoConfig
from megatron_rl.phases.logprobs import current_logprobs_hp, shadow_old_logprobs
from megatron_rl.types import TrainBatch


def gate_open(clipper, recipe: str) -> bool:
    """Whether calibration decides this step's clip on high-precision ratios (algo.calibration.strength=decision);
    read once at the start of a step. Never under
    precision.recipe=none, whose own ratios are already the high-precision ones (the forwards would change nothing)."""
    return clipper is not None and recipe != "none" and clipper.decides_on_high_precision()


def decision_scale(algo: AlgoConfig, gate_open: bool = False) -> float:
    """k of the clip decision: 0 under algo.policy_loss.clip_decision=high_precision or calibration's high-precision
    decision (`gate_open`), else the instrument's (1 = off)."""
    if algo.policy_loss.clip_decision == "high_precision" or gate_open:
        return 0.0
    return algo.experimental.clip_error_scale


def active(algo: AlgoConfig, gate_open: bool = False) -> bool:
    """Whether the clip decision needs high-precision ratios (k != 1)."""
    return decision_scale(algo, gate_open) != 1.0


def with_targeted_rows(batch: TrainBatch, clipper, gate_open: bool, on_policy_only_rows: Sequence[int] = ()) -> TrainBatch:
    """strength=targeted: the step batch with `hp_decision_rows`, its targeted off-policy rows (the answers where the
    rollout engine's and the learner's FP8 pi_old log-probs disagree most; every rank holds the global batch and picks
    the same) and the `on_policy_only_rows`, which only the on-policy first update trains: their high-precision ratio
    is exactly 1 without any forward (the decision's too); unchanged otherwise."""
    fraction = clipper.targeted_fraction() if gate_open else None
    if fraction is None:
        return batch
    if batch.old_logprobs is None:
        raise ValueError("algo.calibration.strength=targeted ranks answers by pi_old's log-probs: run the log-prob phase first")
    if batch.rollout_logprobs is None:
        raise ValueError("algo.calibration.strength=targeted ranks answers by the engine's log-probs against the learner's; "
                         "this step batch carries no rollout log-probs")
    skip = set(on_policy_only_rows)
    candidates = [i for i in range(batch.batch_size) if i not in skip]
    rows = targeted_rows(engine_gap(batch.rollout_logprobs, batch.old_logprobs), batch.loss_mask, candidates, fraction)
    rows[list(skip)] = True
    return batch.with_fields(hp_decision_rows=rows)


def targeted_metrics(batch: TrainBatch, on_policy_only_rows: Sequence[int] = ()) -> dict[str, float]:
    """calib/targeted_token_share: the targeted answers' share of the off-policy answers' tokens (strength=targeted)."""
    if batch.hp_decision_rows is None:
        return {}
    off = torch.ones(batch.batch_size, dtype=torch.bool, device=batch.loss_mask.device)
    off[list(on_policy_only_rows)] = False
    tokens = (batch.loss_mask > 0).sum(dim=1)
    targeted = batch.hp_decision_rows.to(off.device) & off
    total = int(tokens[off].sum())
    return {"calib/targeted_token_share": int(tokens[targeted].sum()) / total if total else float("nan")}


def _forwarded_rows(batch: TrainBatch, algo: AlgoConfig) -> Optional[torch.Tensor]:
    """[b] bool: the rows that need high-precision log-probs when not all do (targeted, instrument off), else None."""
    if batch.hp_decision_rows is None or algo.experimental.clip_error_scale != 1.0:
        return None
    return batch.hp_decision_rows


def row_scale(mb: TrainBatch, algo: AlgoConfig, gate_open: bool, device: torch.device) -> float | torch.Tensor:
    """k of each row's clip decision: `decision_scale`, or under strength=targeted a [b, 1] tensor, 0 on the targeted
    rows and the instrument's k elsewhere."""
    if not gate_open or mb.hp_decision_rows is None:
        return decision_scale(algo, gate_open)
    k = torch.full((mb.batch_size, 1), algo.experimental.clip_error_scale, dtype=torch.float32, device=device)
    return k.masked_fill(mb.hp_decision_rows.to(device)[:, None], 0.0)


def with_old_logprobs_hp(learner, batch: TrainBatch, micro_batch_size: int, algo: AlgoConfig,
                         gate_open: bool = False, on_policy_only_rows: Sequence[int] = ()) -> TrainBatch:
    """The step batch with high-precision pi_old on every row an off-policy update trains on (each DP rank forwards
    its share, rows all-gathered). `on_policy_only_rows` (batching.on_policy_only_rows) hold 0: only the step's first
    update reads them, as its own current policy too, so their high-precision ratio is exactly 1 whatever they hold
    (at 2 mini-batches this spares a third of the decision's high-precision forwards)."""
    if not active(algo, gate_open) or batch.old_logprobs_hp is not None:
        return batch
    skip = set(on_policy_only_rows)
    rows = [i for i in range(batch.batch_size) if i not in skip]
    limit = _forwarded_rows(batch, algo)  # on-policy-only rows are in it, but need no forward
    if limit is not None:
        rows = [i for i in rows if bool(limit[i])]
    return batch.with_fields(old_logprobs_hp=shadow_old_logprobs(learner, batch, rows, micro_batch_size))


def with_logprobs_hp(learner, mb: TrainBatch, micro_batch_size: int, algo: AlgoConfig, first_update: bool,
                     gate_open: bool = False) -> TrainBatch:
    """This rank's mini-batch shard with the current policy's high-precision log-probs (pi_old_hp on the first update)."""
    if not active(algo, gate_open) or mb.logprobs_hp is not None:
        return mb
    if first_update:  # no optimizer step yet: the current weights are pi_old's
        return mb.with_fields(logprobs_hp=mb.old_logprobs_hp)
    return mb.with_fields(logprobs_hp=current_logprobs_hp(learner, mb, micro_batch_size, rows=_forwarded_rows(mb, algo)))


def observed_ratio(logprobs: torch.Tensor, mb: TrainBatch, algo: AlgoConfig) -> Optional[torch.Tensor]:
    """The low-precision ratio calibration observes: r_k at the instrument's k (None when it is off: the learner's own).
    Calibration's high-precision decision changes the decision, not this: the events keep measuring the learner's distortion."""
    k = algo.experimental.clip_error_scale
    if k == 1.0:
        return None
    clamp = algo.policy_loss.log_ratio_clamp
    return error_scaled_ratio(logprobs, mb.old_logprobs, mb.logprobs_hp.to(logprobs.device),
                              mb.old_logprobs_hp.to(logprobs.device), k, clamp)


def clip_decision(logprobs: torch.Tensor, mb: TrainBatch, algo: AlgoConfig,
                  bounds: Optional[tuple[torch.Tensor, torch.Tensor]],
                  gate_open: bool = False) -> tuple[Optional[torch.Tensor], dict[str, torch.Tensor]]:
    """(r_k for the loss's clip masks, `experimental/*` metric sums); (None, {}) when the decision is the learner's."""
    if not active(algo, gate_open):
        return None, {}
    if mb.logprobs_hp is None or mb.old_logprobs_hp is None:
        raise ValueError("a high-precision clip decision (algo.policy_loss.clip_decision, algo.calibration.strength="
                         "decision or algo.experimental."
                         "clip_error_scale) needs logprobs_hp and old_logprobs_hp in every micro-batch")
    clamp = algo.policy_loss.log_ratio_clamp
    lp_hp, old_hp = mb.logprobs_hp.to(logprobs.device), mb.old_logprobs_hp.to(logprobs.device)
    r_k = error_scaled_ratio(logprobs, mb.old_logprobs, lp_hp, old_hp, row_scale(mb, algo, gate_open, logprobs.device), clamp)
    lower, upper = default_bounds(algo, logprobs.device) if bounds is None else bounds
    sums: dict[str, torch.Tensor] = {}
    r_lp = torch.exp(log_ratio(logprobs.detach(), mb.old_logprobs, clamp))
    r_hp = torch.exp(log_ratio(lp_hp, old_hp, clamp))
    mask = mb.loss_mask
    forwarded = _forwarded_rows(mb, algo)
    if forwarded is not None:  # the high-precision ratio exists on the targeted rows only: compare both there
        mask = mask * forwarded.to(mask.device)[:, None]
    sums.update(M.clip_fraction_sums(r_lp, mb.advantages, mask, lower, upper, prefix="experimental/lp_"))
    sums.update(M.clip_fraction_sums(r_hp, mb.advantages, mask, lower, upper, prefix="experimental/hp_"))
    return r_k, sums
