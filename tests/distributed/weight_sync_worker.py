"""Worker of tests/distributed/test_weight_sync_parallel.py: a learner under a parallel layout streams its weights
into running engines with the `distributed` or `tensor` transport (and writes what the `disk` transport would have written).

Run (normally through tests/conftest.py:run_distributed):
    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/distributed/weight_sync_worker.py \
        --pp 2 --target HF_DIR --urls http://127.0.0.1:P1,http://127.0.0.1:P2 --version v1 --out OUT_DIR \
        [--transport distributed|tensor]
"""
from __future__ import annotations

import argparse
import dataclasses
import warnings

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

from dist_report import report  # noqa: E402

from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from megatron_rl.config.precision import PrecisionConfig  # noqa: E402
from megatron_rl.models.presets import resolve_architecture  # noqa: E402
from megatron_rl.parallel import state  # noqa: E402
from megatron_rl.phases.weights import export_rollout_checkpoint, sync_weights  # noqa: E402
from megatron_rl.rollout.sync import get_transport  # noqa: E402
from megatron_rl.trainer.learner import Learner  # noqa: E402
from megatron_rl.trainer.weight_export import StreamingExporter  # noqa: E402
from megatron_rl.warm_start import load_initial_weights  # noqa: E402

VOCAB, LAYERS = 96, 4
BUCKET_MB = 0.02  # ~20 KB: the tiny model travels in many buckets


def architecture():
    """The tiny 4-layer model with tied embeddings (shared with the test, which builds the HF side)."""
    return dataclasses.replace(resolve_architecture(ModelConfig(preset="tiny", num_layers=LAYERS), VOCAB),
                               tie_word_embeddings=True)


def main() -> None:
    """Load the target weights, export them to disk, stream them to the engines, report."""
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--target", required=True)
    p.add_argument("--urls", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--transport", default="distributed", choices=["distributed", "tensor"])
    a = p.parse_args()
    pcfg = ParallelConfig(tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp)
    state.init_distributed(pcfg, seed=3)
    learner = Learner(ModelConfig(preset="tiny", num_layers=LAYERS), pcfg, OptimConfig(), PrecisionConfig(),
                      vocab_size=VOCAB, seed=3, architecture=architecture())
    load_initial_weights(learner, a.target)
    precision = PrecisionConfig(rollout_quantization="fp8-blockwise")
    export_rollout_checkpoint(learner, precision, f"{a.out}/disk", hf_config_dir=a.target, bucket_mb=BUCKET_MB)
    sender = StreamingExporter(learner).is_sender
    transport = get_transport(a.transport)(a.urls.split(","), bucket_mb=BUCKET_MB, timeout_s=60) if sender else None
    metrics = sync_weights(learner, transport, precision, weight_version=a.version)
    group = getattr(transport, "group_name", None)
    if transport is not None:
        transport.close()
    report({"rank": state.global_rank(), "sender": sender, "stage": state.pp_rank(), "group": group,
            "metrics": metrics})
    state.destroy_distributed()


if __name__ == "__main__":
    main()
