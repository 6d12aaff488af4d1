"""Supervised warm start: teach the tiny model the task format so RL starts from a non-trivial accuracy.

Trains through the same Learner (megatron schedules, optimizer, FP8 policy) with a token-level
NLL on the answer tokens, then exports an HF directory (<out>/hf) and a megatron distributed
checkpoint (<out>/checkpoints). Run: `megatron-rl sft examples/configs/tiny_fp8_grpo.yaml`.
"""
from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Sequence

import torch

from megatron_rl.config import RunConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.data.jsonl import PromptRow
from megatron_rl.parallel import state
from megatron_rl.phases import batching
from megatron_rl.phases.batching import dp_shard
from megatron_rl.tracking.report import Progress
from megatron_rl.types import TrainBatch


def sft_batch(tokenizer, rows: Sequence[PromptRow], seq_multiple: int = 1) -> TrainBatch:
    """prompt + answer + EOS sequences with the loss on answer and EOS tokens, weights summing to 1."""
    seqs, starts = [], []
    for r in rows:
        p = tokenizer(r.prompt, add_special_tokens=False)["input_ids"]
        a = tokenizer(str(r.answer), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(p + a)
        starts.append(len(p) - 1)
    s = max(len(x) for x in seqs) - 1
    s = -(-s // seq_multiple) * seq_multiple
    b = len(rows)
    input_ids = torch.full((b, s), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((b, s), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(b, s)
    for i, (x, st) in enumerate(zip(seqs, starts)):
        input_ids[i, : len(x) - 1] = torch.tensor(x[:-1])
        labels[i, : len(x) - 1] = torch.tensor(x[1:])
        mask[i, st: len(x) - 1] = 1.0
    zeros = torch.zeros(b, s)
    return TrainBatch(input_ids=input_ids, labels=labels, loss_mask=mask, advantages=zeros, rollout_logprobs=zeros,
                      token_weight=mask / mask.sum())


def nll_loss(logprobs: torch.Tensor, entropy: torch.Tensor, mb: TrainBatch, ctx) -> tuple[torch.Tensor, dict]:
    """Token-weighted negative log-likelihood in global sum form."""
    loss = -(mb.token_weight * logprobs).sum()
    return loss, {"tokens": mb.loss_mask.sum()}


def run_sft(cfg: RunConfig, tokenizer, train_rows: Sequence[PromptRow], out_dir: Path) -> dict[str, float]:
    """Train cfg.sft.steps steps from a fresh model, export <out_dir>/hf and a distributed checkpoint."""
    from megatron_rl.trainer.checkpoint import save_checkpoint
    from megatron_rl.trainer.learner import Learner
    from megatron_rl.warm_start import export_hf_dir

    s = cfg.sft
    optim = cfg.optim.model_copy(update={"lr": s.lr, "clip_grad": s.clip_grad, "lr_warmup_steps": 0, "lr_decay_style": "constant"})
    precision = PrecisionConfig() if s.high_precision else cfg.precision
    learner = Learner(cfg.model, cfg.parallel, optim, precision, vocab_size=len(tokenizer), seed=cfg.train.seed)
    dp, rank = state.dp_size(), state.dp_rank()
    if s.global_batch_size % (dp * s.micro_batch_size) != 0:
        raise ValueError(f"sft.global_batch_size={s.global_batch_size} must be divisible by DP size {dp} * sft.micro_batch_size={s.micro_batch_size}")
    rng = random.Random(cfg.data.seed)
    seq_multiple = batching.seq_multiple(cfg.parallel)
    bar = Progress(s.steps, desc="SFT warm start", keys=(("loss", "loss"),),
                   enabled=state.is_controller() and cfg.tracking.progress_bar)
    start = time.perf_counter()
    loss = float("nan")
    for _step in range(s.steps):
        rows = [train_rows[rng.randrange(len(train_rows))] for _ in range(s.global_batch_size)]
        batch = dp_shard(sft_batch(tokenizer, rows, seq_multiple), rank, dp)
        metrics = learner.train_step(batch, nll_loss, s.micro_batch_size)
        loss = metrics["loss"]
        bar.update({"loss": loss})
    bar.close()
    export_hf_dir(learner, tokenizer, out_dir / "hf")
    save_checkpoint(learner, str(out_dir / "checkpoints"), s.steps, {"step": s.steps, "kind": "sft"}, keep_last=1)
    result = {"sft/final_loss": loss, "sft/time_s": time.perf_counter() - start}
    if state.is_controller():
        print(f"SFT warm start: {s.steps} steps, final loss {loss:.4f}, {result['sft/time_s']:.1f} s -> {out_dir / 'hf'}", flush=True)
    del learner
    return result

