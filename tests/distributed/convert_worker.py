"""torchrun worker: `megatron-rl convert hf-to-megatron` under a TP x PP layout (collective), then report.

    python -m torch.distributed.run --nproc-per-node 4 convert_worker.py SRC DST TP PP
"""
import sys

from dist_report import report

from megatron_rl.config import load_config
from megatron_rl.convert import hf_to_megatron

if __name__ == "__main__":
    src, dst, tp, pp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cfg = load_config(None, [f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}"])
    path = hf_to_megatron(src, dst, cfg)
    report({"path": path})
