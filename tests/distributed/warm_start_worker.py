"""torchrun worker: the HF warm start (warm_start.load_initial_weights) under a TP x PP layout; reports the bytes this
rank read from the checkpoint, its parameters' share of it, its largest parameter, and (rank 0) the largest difference of the loaded model
from the checkpoint.

    python -m torch.distributed.run --nproc-per-node 4 warm_start_worker.py HF_DIR TP PP
"""
import sys

import torch
from dist_report import report

from megatron_rl.config import load_config
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.convert.safetensors_io import iter_hf_tensors
from megatron_rl.models import hf_mapping
from megatron_rl.models.hf_arch import architecture_from_hf, read_hf_config
from megatron_rl.parallel import state
from megatron_rl.trainer.learner import Learner
from megatron_rl.warm_start import load_initial_weights

if __name__ == "__main__":
    src, tp, pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cfg = load_config(None, [f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}"])
    arch = architecture_from_hf(read_hf_config(src))
    state.init_distributed(cfg.parallel, 0)
    learner = Learner(cfg.model, cfg.parallel, cfg.optim.model_copy(update={"params_dtype": "bf16"}), PrecisionConfig(),
                      vocab_size=arch.vocab_size, seed=0, architecture=arch, total_steps=1)
    read = load_initial_weights(learner, src)
    share = sum(p.numel() * 2 for chunk in learner.model for p in chunk.parameters())  # bf16, as the checkpoint
    largest = max(p.numel() for chunk in learner.model for p in chunk.parameters())
    full = learner.gather_full_state_dict()
    diff = None
    if full is not None:
        want = hf_mapping.to_megatron(dict(iter_hf_tensors(src)), arch)
        diff = max(float((full[k] - want[k].float()).abs().max()) for k in want)
    report({"read": read, "share": share, "largest": largest, "diff": diff})
    state.destroy_distributed()
