"""Worker of tests/distributed/test_colocated_tensor_sync.py: a PP=2 learner colocated with two engines (engine e sees
only device cpu:e, the learner rank of LOCAL_RANK e), or with one TP-2 engine on both devices (--engine-tp 2), syncs
FP8 weights with the `tensor` transport.

--mode colocated: the run's own start-up (runtime.attach_weight_senders) gives every rank its engine feed, then
phases/weights.py sync_weights streams the whole model into each engine from the rank on its device.
--mode stage-senders: the old layout, one sender per stage posting to every engine; the engine of the other device
refuses it (Invalid device_uuid), as a colocated SGLang engine refuses another GPU's CUDA-IPC handle.

Run (normally through tests/conftest.py:run_distributed):
    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/distributed/colocated_sync_worker.py \
        --target HF_DIR --urls URL0,URL1 --version v1 --run-dir DIR [--mode colocated|stage-senders] [--engine-tp 2]
"""
from __future__ import annotations

import argparse
import types
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

from dist_report import report  # noqa: E402
from weight_sync_worker import BUCKET_MB, LAYERS, VOCAB, architecture  # noqa: E402

from megatron_rl.config.model import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from megatron_rl.config.precision import PrecisionConfig  # noqa: E402
from megatron_rl.config.rollout import RolloutConfig  # noqa: E402
from megatron_rl.parallel import state  # noqa: E402
from megatron_rl.phases.weights import sync_weights  # noqa: E402
from megatron_rl.rollout.sync import TensorWeightSync  # noqa: E402
from megatron_rl.runtime import attach_weight_senders  # noqa: E402
from megatron_rl.trainer.learner import Learner  # noqa: E402
from megatron_rl.trainer.weight_export import StreamingExporter  # noqa: E402
from megatron_rl.warm_start import load_initial_weights  # noqa: E402


def main() -> None:
    """Load the target weights, sync them into the engines under the chosen layout, report what each rank did."""
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--urls", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--mode", default="colocated", choices=["colocated", "stage-senders"])
    p.add_argument("--engine-tp", type=int, default=1, help="TP size of every engine (its devices: cpu:e*tp ...)")
    a = p.parse_args()
    pcfg = ParallelConfig(pipeline_model_parallel_size=2)
    state.init_distributed(pcfg, seed=3)
    learner = Learner(ModelConfig(preset="tiny", num_layers=LAYERS), pcfg, OptimConfig(), PrecisionConfig(),
                      vocab_size=VOCAB, seed=3, architecture=architecture())
    load_initial_weights(learner, a.target)
    precision = PrecisionConfig(rollout_quantization="fp8-blockwise")
    urls = a.urls.split(",")
    rollout = RolloutConfig(engine="external", urls=urls, weight_update_urls=urls, placement="colocated",
                            num_engines=len(urls), engine_tp_size=a.engine_tp,
                            weight_sync={"transport": "tensor", "bucket_mb": BUCKET_MB, "timeout_s": 60})
    transport = TensorWeightSync(urls, bucket_mb=BUCKET_MB, timeout_s=60) if state.is_controller() else None
    feed, error = None, None
    if a.mode == "colocated":
        session = types.SimpleNamespace(cfg=types.SimpleNamespace(rollout=rollout), transport=transport,
                                        hf_dir=a.target, run_dir=Path(a.run_dir), learner=learner)
        attach_weight_senders(session)
        transport = session.transport
        feed = transport.feed if transport is not None else None
    elif StreamingExporter(learner).is_sender and transport is None:
        transport = TensorWeightSync(urls, bucket_mb=BUCKET_MB, timeout_s=60)
    try:
        metrics = sync_weights(learner, transport, precision, weight_version=a.version)
    except RuntimeError as exc:
        metrics, error = {}, str(exc)
    if transport is not None:
        transport.close()
    report({"rank": state.global_rank(), "stage": state.pp_rank(), "metrics": metrics, "error": error,
            "feed": None if feed is None else {"url": feed.url, "tp_rank": feed.tp_rank, "devices": list(feed.devices),
                                               "feeders": list(feed.feeders)}})
    state.destroy_distributed()


if __name__ == "__main__":
    main()
