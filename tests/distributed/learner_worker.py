"""Worker for tests/distributed/test_learner_parallel.py: one Learner run under a parallel layout.

Run (normally through tests/conftest.py:run_distributed):
    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/distributed/learner_worker.py \
        --tp 2 --init INIT.pt --out OUT_DIR
Without --init it initialises from its own seed and saves the initial full state dict to
OUT_DIR/init.pt (the world-1 reference does this). Every rank saves OUT_DIR/rank{R}.pt with its
DP rows' log-probs/entropy, the step metrics, and (rank 0) the final full state dict.

    ... learner_worker.py --cases CASES.json
runs several cases (a JSON list of argument lists, each with its own --out) one after another in the same
processes: megatron's groups are rebuilt for each layout on the same world, so a test module pays the
interpreter, torch and megatron start-up of its ranks once, not once per layout.
"""
from __future__ import annotations

import argparse
import dataclasses
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

from dist_report import report_cases  # noqa: E402

from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from megatron_rl.config.precision import PrecisionConfig  # noqa: E402
from megatron_rl.models.presets import resolve_architecture  # noqa: E402
from megatron_rl.parallel import state  # noqa: E402
from megatron_rl.trainer.learner import Learner  # noqa: E402
from megatron_rl.types import TrainBatch  # noqa: E402

VOCAB, B, S, LAYERS = 96, 8, 16, 4


def global_batch() -> TrainBatch:
    """The fixed global batch every run sees (right-padded rows, varying prompt/response lengths)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    prompt = torch.randint(2, 6, (B,), generator=g)
    length = torch.randint(9, S + 1, (B,), generator=g)
    pos = torch.arange(S)[None]
    mask = ((pos >= prompt[:, None]) & (pos < length[:, None])).float()
    adv = torch.randn(B, 1, generator=g).expand(B, S) * mask
    return TrainBatch(
        input_ids=ids, labels=labels, loss_mask=mask, advantages=adv.contiguous(),
        rollout_logprobs=torch.zeros(B, S), token_weight=mask / mask.sum(), sample_index=torch.arange(B),
    )


def greedy_check() -> tuple[torch.Tensor, torch.Tensor]:
    """(vocab_parallel_label_is_argmax on fixed logits split into this rank's TP vocab slice, the answer from the whole
    logits): labels are the argmax on about half the positions, random elsewhere."""
    from megatron_rl.trainer.logprobs import vocab_parallel_label_is_argmax

    g = torch.Generator().manual_seed(3)
    full = torch.randn(B, S, VOCAB, generator=g)
    labels = torch.where(torch.rand(B, S, generator=g) < 0.5, full.argmax(-1), torch.randint(0, VOCAB, (B, S), generator=g))
    tp, r = state.tp_size(), state.tp_rank()
    shard = full[..., r * VOCAB // tp:(r + 1) * VOCAB // tp]
    return vocab_parallel_label_is_argmax(shard, labels, state.tp_group()), labels == full.argmax(-1)


def loss_fn(lp, ent, mb, ctx):
    """Global-sum-form policy-gradient-like loss with an entropy bonus (exercises both gradients)."""
    w = mb.token_weight
    loss = (w * (-mb.advantages * lp - 0.05 * ent)).sum()
    return loss, {"tokens": mb.loss_mask.sum(), "weight": w.sum(), "entropy_sum": (w * ent).sum().detach()}


def parser() -> argparse.ArgumentParser:
    """The arguments of one case."""
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--sp", action="store_true")
    p.add_argument("--distopt", action="store_true")
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--chunk", type=int, default=5)
    p.add_argument("--tied", action="store_true", help="tie the output layer to the embedding")
    p.add_argument("--recipe", default="none", help="PrecisionConfig.recipe (FP8 emulation on CPU)")
    p.add_argument("--hp-ends", type=int, default=0, help="PrecisionConfig.first_last_layers_high_precision")
    p.add_argument("--unsafe-batch-p2p", action="store_true",
                   help="undo the pinned batch_p2p_comm=False (shows the VPP-on-gloo corruption it prevents)")
    p.add_argument("--init", default=None)
    p.add_argument("--out", required=True)
    return p


def run_case(a: argparse.Namespace) -> dict:
    """Run forward + 2 train steps under the layout of `a`, save this rank's results to a.out; the rank's report."""
    pcfg = ParallelConfig(
        tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
        virtual_pipeline_model_parallel_size=a.vpp, context_parallel_size=a.cp, sequence_parallel=a.sp,
        use_distributed_optimizer=a.distopt, logprob_chunk_size=a.chunk,
    )
    state.init_distributed(pcfg, seed=11)
    model_cfg = ModelConfig(preset="tiny", num_layers=LAYERS)
    arch = dataclasses.replace(resolve_architecture(model_cfg, VOCAB), tie_word_embeddings=a.tied)
    learner = Learner(
        model_cfg, pcfg, OptimConfig(lr=5e-4, clip_grad=1.0),
        PrecisionConfig(recipe=a.recipe, first_last_layers_high_precision=a.hp_ends), vocab_size=VOCAB, seed=11,
        architecture=arch,
    )
    if a.unsafe_batch_p2p:
        learner.config.batch_p2p_comm = True
    out = Path(a.out)
    if a.init:
        learner.load_full_state_dict(torch.load(a.init))
    else:
        init = learner.gather_full_state_dict()
        if state.global_rank() == 0:
            torch.save(init, out / "init.pt")
    batch = global_batch()
    dp, r = state.dp_size(), state.dp_rank()
    rows = slice(r * B // dp, (r + 1) * B // dp)
    mine = batch.select(rows)
    lp, ent = learner.forward_logprobs(mine, a.mbs)
    steps = [learner.train_step(mine, loss_fn, a.mbs) for _ in range(2)]
    lp_after, _ = learner.forward_logprobs(mine, a.mbs)
    final = learner.gather_full_state_dict()
    rank = state.global_rank()
    greedy_hits, greedy_want = greedy_check()
    torch.save({"rows": (rows.start, rows.stop), "logprobs": lp, "entropy": ent, "logprobs_after": lp_after,
                "steps": steps, "final": final, "greedy_hits": greedy_hits, "greedy_want": greedy_want,
                "expected_shapes": learner.expected_full_shapes()}, out / f"rank{rank}.pt")
    return {"rank": rank, "dp_rank": r, "steps": steps}


def main() -> None:
    """One case from the command line, or every case of --cases FILE in turn (one report: the list of theirs)."""
    report_cases(parser, run_case)
    state.destroy_distributed()


if __name__ == "__main__":
    main()
