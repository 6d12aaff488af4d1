"""Checkpoint conversion (a thin wrapper over `megatron-rl convert`; same arguments, see megatron_rl/convert).

    python tools/convert_checkpoint.py hf-to-megatron  HF_DIR MG_DIR [--config CONFIG] [overrides]
    torchrun --nproc-per-node 8 tools/convert_checkpoint.py hf-to-megatron HF_DIR MG_DIR \
        parallel.tensor_model_parallel_size=8          # each rank builds only its shard (large models)
    python tools/convert_checkpoint.py megatron-to-hf  MG_DIR HF_DIR [--hf-config BASE_HF_DIR] [--dtype bf16]
    python tools/convert_checkpoint.py hf-to-fp8       HF_DIR FP8_DIR [--scale-fmt ue8m0]
    python tools/convert_checkpoint.py megatron-to-fp8 MG_DIR FP8_DIR [--hf-config BASE_HF_DIR]
"""
import sys

from megatron_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
