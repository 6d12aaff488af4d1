"""Worker for tests/test_learner_kernels.py: DP=2 Learner steps with megatron DDP's gradient-reduce and parameter-gather
overlap forced on (the GPU settings; the CUDA-only fused kernels stay off), or off, on gloo.

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/distributed/overlap_worker.py --overlap

Reports per rank: step metrics, whether an all-gather was pending after each step, the reference policy's
log-probs between the steps (its weights swapped in while an all-gather was pending), the full state dict's
per-tensor sums (gather_full_state_dict, after finish_param_sync) and whether that changed this rank's raw
parameters, log-probs after the steps, whether a forward after a third step left an all-gather pending and how many
forced all-gathers the export after it ran (with its state dict's sums), and the DDP / config settings.
"""
from __future__ import annotations

import argparse
import warnings

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

from dist_report import report  # noqa: E402
from learner_worker import B, LAYERS, VOCAB, global_batch, loss_fn  # noqa: E402

import megatron_rl.trainer.learner as learner_module  # noqa: E402
from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from megatron_rl.config.precision import PrecisionConfig  # noqa: E402
from megatron_rl.parallel import state  # noqa: E402
from megatron_rl.phases.logprobs import ReferencePolicy  # noqa: E402
from megatron_rl.trainer.model import LearnerKernels  # noqa: E402


def main() -> None:
    """Two train steps (several micro-batches each), reference log-probs between them, a weight read and a forward after."""
    p = argparse.ArgumentParser()
    p.add_argument("--overlap", action="store_true")
    a = p.parse_args()
    pcfg = ParallelConfig(use_distributed_optimizer=True, logprob_chunk_size=5)
    if a.overlap:
        kernels = LearnerKernels(overlap_grad_reduce=True, overlap_param_gather=True)
        learner_module.learner_kernels = lambda facts, parallel_cfg: kernels
    state.init_distributed(pcfg, seed=11)
    learner = learner_module.Learner(ModelConfig(preset="tiny", num_layers=LAYERS), pcfg, OptimConfig(lr=5e-3, clip_grad=1.0),
                                     PrecisionConfig(), vocab_size=VOCAB, seed=11)
    dp, r = state.dp_size(), state.dp_rank()
    mine = global_batch().select(slice(r * B // dp, (r + 1) * B // dp))
    reference = ReferencePolicy(learner)
    steps = [learner.train_step(mine, loss_fn, 1)]
    pending = [learner._params_pending]
    # the reference policy swaps weights in and back by hand: done with an all-gather pending, it would restore the
    # other ranks' stale shards and leave the next forward nothing to gather (step 2 would train on stale weights)
    ref_lp = reference.logprobs(learner, mine, 1)
    steps.append(learner.train_step(mine, loss_fn, 1))
    pending.append(learner._params_pending)
    raw_before = float(sum(p.detach().double().sum() for p in learner.model[0].parameters()))
    full = learner.gather_full_state_dict()  # finish_param_sync first
    raw_after = float(sum(p.detach().double().sum() for p in learner.model[0].parameters()))
    lp, _ = learner.forward_logprobs(mine, 1)
    # a third step, then a forward: its pre-hooks gather the new parameters, so an export after it gathers nothing again
    learner.train_step(mine, loss_fn, 1)
    learner.forward_logprobs(mine, 1)
    after_forward = learner._params_pending
    forced = []
    for chunk in learner.model:
        def counted(*args, _sync=chunk.start_param_sync, **kwargs):
            forced.append(bool(kwargs.get("force_sync")))
            return _sync(*args, **kwargs)
        chunk.start_param_sync = counted
    full3 = learner.gather_full_state_dict()
    ddp = learner.model[0].ddp_config
    report({"rank": state.global_rank(), "steps": steps, "pending": pending, "raw_changed": raw_before != raw_after,
            "sums": {k: float(v.double().sum()) for k, v in sorted(full.items())} if full is not None else None,
            "after_forward": after_forward, "forced_syncs": sum(forced),
            "sums3": {k: float(v.double().sum()) for k, v in sorted(full3.items())} if full3 is not None else None,
            "reference_sum": float(ref_lp.double().sum()), "logprobs_sum": float(lp.double().sum()),
            "overlap": [ddp.overlap_grad_reduce, ddp.overlap_param_gather],
            "sync_funcs": [learner.config.no_sync_func is not None, learner.config.grad_sync_func is not None]})
    state.destroy_distributed()


if __name__ == "__main__":
    main()
