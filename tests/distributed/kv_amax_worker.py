"""Worker of tests/distributed/test_kv_amax_parallel.py: the learner's K/V amax probe (trainer/kv_scales.py) on the
step batch under a parallel layout, through the log-prob phase's own forward (each DP rank its rows).

Run (normally through tests/conftest.py:run_distributed):
    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/distributed/kv_amax_worker.py \
        --tp 2 --init INIT.pt --out OUT_DIR
Without --init it saves its initial full state dict to OUT_DIR/init.pt (the world-1 reference does this). Every rank
reports the all-reduced [L, 2] amax. `--cases FILE` runs several layouts in one launch (dist_report.report_cases).
"""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

from dist_report import report_cases  # noqa: E402
from learner_worker import LAYERS, VOCAB, global_batch  # noqa: E402

from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from megatron_rl.config.precision import PrecisionConfig  # noqa: E402
from megatron_rl.parallel import state  # noqa: E402
from megatron_rl.phases.logprobs import _global_forward  # noqa: E402
from megatron_rl.trainer.kv_scales import KvAmaxProbe  # noqa: E402
from megatron_rl.trainer.learner import Learner  # noqa: E402


def parser() -> argparse.ArgumentParser:
    """The arguments of one case."""
    p = argparse.ArgumentParser()
    for flag in ("--tp", "--pp", "--cp"):
        p.add_argument(flag, type=int, default=1)
    p.add_argument("--sp", action="store_true")
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--init", default=None)
    p.add_argument("--out", required=True)
    return p


def run_case(a: argparse.Namespace) -> dict:
    """Record one forward of the global batch under the layout of `a`; this rank's report (the reduced amax)."""
    pcfg = ParallelConfig(tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
                          context_parallel_size=a.cp, sequence_parallel=a.sp)
    state.init_distributed(pcfg, seed=11)
    learner = Learner(ModelConfig(preset="tiny", num_layers=LAYERS), pcfg, OptimConfig(), PrecisionConfig(),
                      vocab_size=VOCAB, seed=11)
    if a.init:
        learner.load_full_state_dict(torch.load(a.init))
    else:
        init = learner.gather_full_state_dict()
        if state.global_rank() == 0:
            torch.save(init, Path(a.out) / "init.pt")
    probe = KvAmaxProbe(learner)
    with probe.recording():
        _global_forward(learner, global_batch(), a.mbs)
    return {"rank": state.global_rank(), "amax": probe.result().tolist()}


def main() -> None:
    """One case, or every case of --cases FILE in these processes (megatron's groups rebuilt per layout)."""
    report_cases(parser, run_case)
    state.destroy_distributed()


if __name__ == "__main__":
    main()
