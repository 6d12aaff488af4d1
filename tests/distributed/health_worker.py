"""Worker for tests/distributed/test_health_guard.py: three Learner steps with a non-finite value injected on one rank.

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/distributed/health_worker.py \
        --poison loss --poison-rank 1 --poison-step 1 --init INIT.pt --out OUT_DIR

--poison loss makes that rank's loss NaN on that step; --poison grad leaves the loss finite and makes that
rank's gradient inf (an identity whose backward multiplies by inf). Every rank saves OUT_DIR/rank{R}.pt with
each step's metrics, a digest of its local parameters after each step, and (rank 0) the final full weights.
"""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

from dist_report import report  # noqa: E402
from learner_worker import B, LAYERS, VOCAB, global_batch, loss_fn  # noqa: E402

from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from megatron_rl.config.precision import PrecisionConfig  # noqa: E402
from megatron_rl.parallel import state  # noqa: E402
from megatron_rl.trainer.learner import Learner  # noqa: E402


class _InfGrad(torch.autograd.Function):
    """Identity forward, inf-scaled backward: a finite loss with a non-finite gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


def main() -> None:
    """Run three train steps, poisoning one rank's loss or gradient on one step."""
    p = argparse.ArgumentParser()
    p.add_argument("--poison", choices=["loss", "grad"], required=True)
    p.add_argument("--poison-rank", type=int, required=True)
    p.add_argument("--poison-step", type=int, required=True)
    p.add_argument("--init", default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    state.init_distributed(ParallelConfig(), seed=11)
    learner = Learner(ModelConfig(preset="tiny", num_layers=LAYERS), ParallelConfig(), OptimConfig(lr=5e-4, clip_grad=1.0),
                      PrecisionConfig(), vocab_size=VOCAB, seed=11)
    out = Path(a.out)
    if a.init:
        learner.load_full_state_dict(torch.load(a.init))
    else:
        init = learner.gather_full_state_dict()
        if state.global_rank() == 0:
            torch.save(init, out / "init.pt")
    dp, r, rank = state.dp_size(), state.dp_rank(), state.global_rank()
    mine = global_batch().select(slice(r * B // dp, (r + 1) * B // dp))
    steps, digests = [], []
    for step in range(3):
        poisoned = step == a.poison_step and rank == a.poison_rank

        def poisoned_loss(lp, ent, mb, ctx, poisoned=poisoned):
            if poisoned and a.poison == "grad":
                lp = _InfGrad.apply(lp)
            loss, metrics = loss_fn(lp, ent, mb, ctx)
            return (loss * float("nan") if poisoned and a.poison == "loss" else loss), metrics

        steps.append(learner.train_step(mine, poisoned_loss, micro_batch_size=mine.batch_size))
        digests.append(sum(float(p.detach().double().abs().sum()) for chunk in learner.model for p in chunk.parameters()))
    final = learner.gather_full_state_dict()
    torch.save({"steps": steps, "digests": digests, "final": final, "step_count": learner.step_count}, out / f"rank{rank}.pt")
    report({"rank": rank})
    state.destroy_distributed()


if __name__ == "__main__":
    main()
