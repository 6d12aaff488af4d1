"""Samples -> padded TrainBatch, and the split of a step's batch into mini-batches and DP shards.

Every rank holds the same global batch (the controller broadcasts it), so mini-batch membership,
shards and the global token counts of the aggregation weights are computed locally and agree.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from megatron_rl.algo.aggregation import count_tokens_and_seqs, token_weights
from megatron_rl.config.model import ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.config.train import TrainConfig
from megatron_rl.types import Sample, TrainBatch


def build_train_batch(samples: Sequence[Sample], advantages: torch.Tensor, pad_id: int, seq_multiple: int = 1,
                      max_seq_len: int | None = None) -> TrainBatch:
    """Right-padded [B, S] batch; S is the longest prompt+response minus one, rounded up to `seq_multiple`."""
    if len(samples) != len(advantages):
        raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
    lengths = [len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples]
    seq = max(max(lengths), 1)
    seq = -(-seq // seq_multiple) * seq_multiple
    if max_seq_len is not None and seq > max_seq_len:
        raise ValueError(f"a prompt+response of {seq} tokens exceeds the model's max_seq_len={max_seq_len}; "
                         "lower rollout.sampling.max_new_tokens or use shorter prompts")
    b = len(samples)
    # built on the host from Python samples (the controller broadcasts it; the Learner moves each micro-batch)
    input_ids = torch.full((b, seq), pad_id, dtype=torch.long)  # device-ok: host-side batch
    labels = torch.full((b, seq), pad_id, dtype=torch.long)  # device-ok: host-side batch
    loss_mask = torch.zeros(b, seq)  # device-ok: host-side batch
    adv = torch.zeros(b, seq)  # device-ok: host-side batch
    rollout_lp = torch.zeros(b, seq)  # device-ok: host-side batch
    for i, s in enumerate(samples):
        tokens = list(s.prompt_ids) + list(s.response_ids)
        n = len(tokens) - 1
        input_ids[i, :n] = torch.tensor(tokens[:-1])  # device-ok: host-side batch
        labels[i, :n] = torch.tensor(tokens[1:])  # device-ok: host-side batch
        start = len(s.prompt_ids) - 1
        r = len(s.response_ids)
        if r:
            loss_mask[i, start:start + r] = 1.0
            adv[i, start:start + r] = float(advantages[i])
            rollout_lp[i, start:start + r] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)  # device-ok: host-side batch
    return TrainBatch(input_ids=input_ids, labels=labels, loss_mask=loss_mask, advantages=adv,
                      rollout_logprobs=rollout_lp, sample_index=torch.arange(b))  # device-ok: host-side batch


def minibatch_seed(train_seed: int, step: int, epoch: int) -> int:
    """Seed of the row shuffle of `step`'s epoch `epoch` (every rank draws the same permutation)."""
    return train_seed * 7919 + step * 31 + epoch


def minibatch_rows(batch_size: int, num_minibatches: int, seed: int) -> list[torch.Tensor]:
    """Row indices of each mini-batch: a seeded shuffle cut into equal parts."""
    perm = torch.randperm(batch_size, generator=torch.Generator().manual_seed(seed))  # device-ok: seeded CPU draw, same on every rank
    size = batch_size // num_minibatches
    return [perm[k * size:(k + 1) * size] for k in range(num_minibatches)]


def minibatches(batch: TrainBatch, num_minibatches: int, seed: int) -> list[TrainBatch]:
    """Shuffle rows (same permutation on every rank) and cut them into equal mini-batches."""
    return [batch.select(rows) for rows in minibatch_rows(batch.batch_size, num_minibatches, seed)]


def on_policy_only_rows(batch_size: int, num_minibatches: int, ppo_epochs: int, train_seed: int, step: int) -> tuple[int, ...]:
    """Rows that only the step's first (on-policy) update trains on: its mini-batch's rows with one epoch, none with
    more (a later epoch trains every row off-policy). No calibration statistic needs their high-precision log-probs."""
    if ppo_epochs > 1 or num_minibatches < 2:
        return ()
    return tuple(sorted(minibatch_rows(batch_size, num_minibatches, minibatch_seed(train_seed, step, 0))[0].tolist()))


def old_logprob_row_groups(batch_size: int, train: TrainConfig, step: int) -> Optional[list[torch.Tensor]]:
    """The row groups pi_old is forwarded as (train.old_logprob_batches): "update" gives the first epoch's mini-batches,
    each then cut into the DP shards and micro-batches the update trains on; "rollout" gives None (rollout order)."""
    if train.old_logprob_batches == "rollout":
        return None
    groups = minibatch_rows(batch_size, train.num_minibatches, minibatch_seed(train.seed, step, 0))
    if sum(len(g) for g in groups) != batch_size:  # the config's divisibility check makes mini-batches cover the step
        raise ValueError(f"{batch_size} rows do not split into {train.num_minibatches} equal mini-batches")
    return groups


def agg_max_len(cfg) -> int:
    """The constant normaliser of the seq-mean-token-sum-norm (Dr.GRPO) aggregation: the configured one or the generation budget."""
    return cfg.algo.policy_loss.max_response_length or cfg.rollout.sampling.max_new_tokens


def with_token_weights(batch: TrainBatch, mode: str, max_response_length: int | None = None) -> TrainBatch:
    """Attach aggregation weights computed over the whole (global) mini-batch."""
    tokens, seqs = count_tokens_and_seqs(batch.loss_mask)
    weight = token_weights(batch.loss_mask, mode, max(tokens, 1.0), max(seqs, 1.0), max_response_length=max_response_length)
    return batch.with_fields(token_weight=weight)


def dp_shard(batch: TrainBatch, dp_rank: int, dp_size: int) -> TrainBatch:
    """This data-parallel rank's contiguous slice of rows."""
    size = batch.batch_size // dp_size
    return batch.select(slice(dp_rank * size, (dp_rank + 1) * size))


TOKEN_ALIGNMENT = {"none": 1, "mxfp8": 32, "mxfp4": 32}
"""Tokens per GEMM row block each learner recipe needs (default 16 for the other FP8/FP4 recipes): TE asserts
leading dims % 8 and the last dim % 16 for FP8 GEMMs (transformer_engine.pytorch.utils.assert_dim_for_fp8_exec),
and the wgrad GEMM puts the tokens last; MX formats scale 1x32 blocks, so they need 32."""


def token_alignment(precision: Optional[PrecisionConfig]) -> int:
    """Multiple that every rank's token count must be for the learner's low-precision GEMMs (1 without FP8)."""
    if precision is None:
        return 1
    return TOKEN_ALIGNMENT.get(precision.recipe, 16)


def seq_multiple(parallel: ParallelConfig, precision: Optional[PrecisionConfig] = None) -> int:
    """Padded sequence lengths divide by 2*CP (load-balanced CP chunks) and TP under sequence parallelism, and
    leave each rank (S / (CP * TP_sp) tokens per row) a multiple of the recipe's token alignment."""
    sp = parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1
    cp = parallel.context_parallel_size
    base = (2 * cp if cp > 1 else 1) * sp
    align = token_alignment(precision)
    return base if align == 1 else math.lcm(base, cp * sp * align)
