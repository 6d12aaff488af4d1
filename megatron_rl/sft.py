"""Supervised warm start: teach the tiny model the task format so RL starts from a non-trivial accuracy.

Trains through the same Learner (megatron schedules, optimizer, FP8 policy) with a token-level
NLL on the answer tokens, then exports an HF directory (<out>/hf) and a megatron distributed
checkpoint (<out>/checkpoints). Run: `megatron-rl sft examples/configs/tiny_fp8_grpo.yaml`.

With `sft.eval_every` the greedy accuracy on the first `sft.eval_prompts` training prompts, which
the warm start then never trains on, is measured every that many steps (<out>/metrics.jsonl);
`sft.stop_accuracy` ends the warm start once the median of the last `sft.stop_window` checks reaches
it. The tiny task's SFT accuracy rises in a sudden jump whose position moves by hundreds of steps
with the seed and the CPU's kernels, and at the constant learning rate single checks swing by tens of
points (docs/miniatures.md), so a warm start of a fixed length lands anywhere on the curve; stopping at a
measured accuracy of prompts it has not seen (memorized prompts would count too early), confirmed by
the next check, lands at the same place wherever the jump happens. Writes <out>/warm_start.json
(steps taken, why it stopped, last accuracy).
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from megatron_rl.config import RunConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.data.jsonl import PromptRow
from megatron_rl.data.tasks import teacher_drops_units_carry
from megatron_rl.parallel import state
from megatron_rl.parallel.comm import all_gather_dp_rows
from megatron_rl.phases import batching
from megatron_rl.phases.batching import dp_shard
from megatron_rl.phases.weights import export_hf_dir
from megatron_rl.tracking.report import Progress
from megatron_rl.types import TrainBatch

WARM_START_FILE = "warm_start.json"
"""Record of a finished warm start in its output directory (steps, stop reason, last greedy accuracy)."""


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


def greedy_accuracy(learner, tokenizer, rows: Sequence[PromptRow], seq_multiple: int, micro_batch_size: int) -> float:
    """Fraction of `rows` whose greedy completion is exactly answer + EOS (collective over the learner's ranks).

    Greedy decoding emits the answer exactly when, along the answer's own tokens, each next token is the
    model's argmax; so one teacher-forced forward over prompt + answer decides every row, without decoding.
    Rows are padded (with copies of the first) to a multiple of DP size x micro_batch_size; copies are not counted.
    """
    dp, per = state.dp_size(), state.dp_size() * micro_batch_size
    padded = list(rows) + [rows[0]] * (-len(rows) % per)
    batch = sft_batch(tokenizer, padded, seq_multiple)
    hits = learner.forward_greedy_hits(dp_shard(batch, state.dp_rank(), dp), micro_batch_size)
    hits = all_gather_dp_rows(hits.to(torch.uint8)).bool()
    row_ok = (hits | (batch.loss_mask == 0)).all(dim=1)[: len(rows)]
    return int(row_ok.sum()) / len(rows)


def run_sft(cfg: RunConfig, tokenizer, train_rows: Sequence[PromptRow], out_dir: Path) -> dict[str, float]:
    """Train up to cfg.sft.steps steps from a fresh model (fewer when stop_accuracy is reached), export <out_dir>/hf
    and a distributed checkpoint."""
    from megatron_rl.trainer.checkpoint import save_checkpoint
    from megatron_rl.trainer.learner import Learner

    s = cfg.sft
    optim = cfg.optim.model_copy(update={"lr": s.lr, "clip_grad": s.clip_grad, "lr_warmup_steps": 0, "lr_decay_style": "constant"})
    precision = PrecisionConfig() if s.high_precision else cfg.precision
    learner = Learner(cfg.model, cfg.parallel, optim, precision, vocab_size=len(tokenizer), seed=cfg.train.seed)
    dp, rank = state.dp_size(), state.dp_rank()
    if s.global_batch_size % (dp * s.micro_batch_size) != 0:
        raise ValueError(f"sft.global_batch_size={s.global_batch_size} must be divisible by DP size {dp} * sft.micro_batch_size={s.micro_batch_size}")
    rng = random.Random(cfg.data.seed)
    seq_multiple = batching.seq_multiple(cfg.parallel, precision)
    check_rows = list(train_rows[: s.eval_prompts]) if s.eval_every else []
    pool = train_rows[len(check_rows):]  # the checks score prompts the warm start never trains on
    if s.teacher_carry_drop:  # the checks above keep the true answers: they measure what the model can do
        pool = [teacher_drops_units_carry(r, s.teacher_carry_drop, cfg.data.seed) for r in pool]
    if not pool:
        raise ValueError(f"sft.eval_prompts={s.eval_prompts} leaves none of the {len(train_rows)} training prompts for the "
                         "warm start to train on (the checks score prompts it never trains on): lower it or set sft.eval_every=0")
    out_dir.mkdir(parents=True, exist_ok=True)
    log = open(out_dir / "metrics.jsonl", "w") if state.is_controller() and s.eval_every else None
    bar = Progress(s.steps, desc="SFT warm start", keys=(("loss", "loss"), ("accuracy", "acc")),
                   enabled=state.is_controller() and cfg.tracking.progress_bar)
    start = time.perf_counter()
    loss, accuracy, steps, reason = float("nan"), None, s.steps, "steps"
    checks: list[float] = []
    reached_at: Optional[int] = None  # the step whose checks first reached stop_accuracy
    for step in range(1, s.steps + 1):
        rows = [pool[rng.randrange(len(pool))] for _ in range(s.global_batch_size)]
        batch = dp_shard(sft_batch(tokenizer, rows, seq_multiple), rank, dp)
        loss = learner.train_step(batch, nll_loss, s.micro_batch_size)["loss"]
        shown: dict[str, float] = {"loss": loss}
        if s.eval_every and step % s.eval_every == 0:
            accuracy = greedy_accuracy(learner, tokenizer, check_rows, seq_multiple, s.micro_batch_size)
            checks.append(accuracy)
            shown["accuracy"] = accuracy
            if log is not None:
                log.write(json.dumps({"step": step, "loss": loss, "greedy_accuracy": accuracy}) + "\n")
                log.flush()
        bar.update(shown)
        if reached_at is None and s.stop_accuracy is not None and len(checks) >= s.stop_window and \
                sorted(checks[-s.stop_window:])[s.stop_window // 2] >= s.stop_accuracy:
            reached_at = step
        if reached_at is not None and step >= reached_at + s.settle_steps:
            steps, reason = step, "stop_accuracy"
            break
    bar.close()
    if log is not None:
        log.close()
    export_hf_dir(learner, tokenizer, out_dir / "hf")
    save_checkpoint(learner, str(out_dir / "checkpoints"), steps, {"step": steps, "kind": "sft"}, keep_last=1)
    result = {"sft/steps": float(steps), "sft/final_loss": loss, "sft/time_s": time.perf_counter() - start}
    if state.is_controller():
        record = {"steps": steps, "stopped_by": reason, "greedy_accuracy": accuracy, "final_loss": loss,
                  "stop_accuracy": s.stop_accuracy, "reached_at": reached_at, "settle_steps": s.settle_steps,
                  "max_steps": s.steps}
        (out_dir / WARM_START_FILE).write_text(json.dumps(record, indent=1) + "\n")
        acc = "" if accuracy is None else f", greedy accuracy {100 * accuracy:.1f}% on {len(check_rows)} prompts it did not train on"
        why = f" (reached sft.stop_accuracy={s.stop_accuracy} at step {reached_at})" if reason == "stop_accuracy" else ""
        print(f"SFT warm start: {steps} steps{why}, final loss {loss:.4f}{acc}, {result['sft/time_s']:.1f} s -> {out_dir / 'hf'}",
              flush=True)
    del learner
    return result


def warm_start_record(out_dir: Path) -> Optional[dict]:
    """The <out_dir>/warm_start.json of a finished warm start (None for one made before it existed)."""
    path = Path(out_dir) / WARM_START_FILE
    return json.loads(path.read_text()) if path.exists() else None
