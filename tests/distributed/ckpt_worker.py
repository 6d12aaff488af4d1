"""Worker for tests/distributed/test_checkpoint_reshard.py: save a checkpoint under one layout, or load it under another.

Run (normally through tests/conftest.py:run_distributed):
    python -m torch.distributed.run --standalone --nproc-per-node=4 tests/distributed/ckpt_worker.py \
        --mode save --tp 2 --pp 2 --ckpt CKPT_ROOT --out OUT_DIR
    python -m torch.distributed.run --standalone --nproc-per-node=1 tests/distributed/ckpt_worker.py \
        --mode load --ckpt CKPT_ROOT --out OUT_DIR

save: one train step (so Adam state exists), save_checkpoint at step 1, then record the eval
      batch's log-probs, a second train step's metrics and the log-probs after it.
load: record log-probs before loading (other seed: must differ), load_checkpoint, then record
      the same three things; they must match the save run's within float tolerance.
Global rank 0 writes OUT_DIR/result.pt; every rank reports its rl_state and metrics as JSON.
"""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

from dist_report import report_cases  # noqa: E402

from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from megatron_rl.config.precision import PrecisionConfig  # noqa: E402
from megatron_rl.parallel import state  # noqa: E402
from megatron_rl.trainer import checkpoint  # noqa: E402
from megatron_rl.trainer.learner import Learner  # noqa: E402
from megatron_rl.types import TrainBatch  # noqa: E402

VOCAB, B, S, LAYERS = 96, 8, 16, 4


def make_batch(seed: int, rows: int) -> TrainBatch:
    """A fixed right-padded batch (masked prompt and padding, per-row advantages, global token_weight)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, S), generator=g)
    labels = torch.randint(0, VOCAB, (rows, S), generator=g)
    prompt = torch.randint(2, 6, (rows,), generator=g)
    length = torch.randint(9, S + 1, (rows,), generator=g)
    pos = torch.arange(S)[None]
    mask = ((pos >= prompt[:, None]) & (pos < length[:, None])).float()
    adv = (torch.randn(rows, 1, generator=g) * mask).contiguous()
    return TrainBatch(input_ids=ids, labels=labels, loss_mask=mask, advantages=adv,
                      rollout_logprobs=torch.zeros(rows, S), token_weight=mask / mask.sum())


def loss_fn(lp, ent, mb, ctx):
    """Global-sum-form policy-gradient loss with an entropy bonus."""
    return (mb.token_weight * (-mb.advantages * lp - 0.05 * ent)).sum(), {}


def train_rows(batch: TrainBatch) -> TrainBatch:
    """This DP rank's share of the global training batch."""
    dp, r = state.dp_size(), state.dp_rank()
    return batch.select(slice(r * B // dp, (r + 1) * B // dp))


def parser() -> argparse.ArgumentParser:
    """The arguments of one case."""
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["save", "load"], required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--sp", action="store_true")
    p.add_argument("--distopt", action="store_true")
    p.add_argument("--tied", action="store_true", help="tied embeddings: qwen3-0.6b shapes shrunk to hidden 64")
    p.add_argument("--weights-only", action="store_true", help="load without optimizer state")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    return p


def run_case(a: argparse.Namespace) -> dict:
    """Save or load under the layout of `a`, write rank 0's results to a.out; this rank's report."""
    print(f"case: {vars(a)}", flush=True)  # a failing launch of several cases says which one it was in
    pcfg = ParallelConfig(tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
                          virtual_pipeline_model_parallel_size=a.vpp, context_parallel_size=a.cp,
                          sequence_parallel=a.sp, use_distributed_optimizer=a.distopt)
    seed = 11 if a.mode == "save" else 12
    state.init_distributed(pcfg, seed=seed)
    learner = Learner(
        ModelConfig(preset="qwen3-0.6b", num_layers=LAYERS, hidden_size=64, max_seq_len=64) if a.tied
        else ModelConfig(preset="tiny", num_layers=LAYERS), pcfg,
        OptimConfig(lr=5e-4, clip_grad=1.0, lr_warmup_steps=3, lr_decay_style="cosine", min_lr=1e-5),
        PrecisionConfig(), vocab_size=VOCAB, seed=seed, total_steps=10,
    )
    # Step 2 uses another batch than step 1 so that its update depends on the restored Adam moments.
    train, train2, evals = make_batch(7, B), make_batch(9, B), make_batch(8, 4)
    result: dict = {}
    if a.mode == "save":
        learner.train_step(train_rows(train), loss_fn, 1)
        rl_state = {"step": 1, "cursor": 123, "weight_version": 1}
        result["path"] = checkpoint.save_checkpoint(learner, a.ckpt, step=1, rl_state=rl_state)
    else:
        result["logprobs_before"], _ = learner.forward_logprobs(evals, 2)
        rl_state = checkpoint.load_checkpoint(learner, a.ckpt, load_optimizer=not a.weights_only)
    result["logprobs"], result["entropy"] = learner.forward_logprobs(evals, 2)
    result["step2"] = learner.train_step(train_rows(train2), loss_fn, 1)
    result["logprobs_after"], _ = learner.forward_logprobs(evals, 2)
    result["full_after"] = learner.gather_full_state_dict()
    if state.global_rank() == 0:
        torch.save(result, Path(a.out) / "result.pt")
    return {"rank": state.global_rank(), "rl_state": rl_state, "step2": result["step2"], "step_count": learner.step_count}


def main() -> None:
    """One case, or every case of --cases FILE in these processes (megatron's groups rebuilt per layout)."""
    report_cases(parser, run_case)
    state.destroy_distributed()


if __name__ == "__main__":
    main()
