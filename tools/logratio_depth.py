"""Low-precision log-prob / log-ratio error against model depth and position in the answer.

    python tools/logratio_depth.py examples/configs/deep_addtrace_base.yaml --out runs/depth_error \
        [--depths 2 4 8 16] [--recipes tensorwise blockwise nvfp4] [--seed 1] [--prompts 16] [--samples 8]

What it measures and writes: megatron_rl/study/precision_error.py. Runs with one CPU thread and the pinned
AVX2 kernel paths (megatron_rl/cpu_kernels.py; the process re-executes itself with them when they are unset).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    """Parse the command line and run the measurement."""
    from megatron_rl.cpu_kernels import reexec_pinned

    reexec_pinned()
    from megatron_rl.study.precision_error import DEFAULT_DEPTHS, DEFAULT_RECIPES, run

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", type=Path, help="run config whose model, data, SFT and loss are used")
    p.add_argument("--out", type=Path, required=True, help="output directory (warm starts per depth are reused)")
    p.add_argument("--depths", type=int, nargs="+", default=list(DEFAULT_DEPTHS))
    p.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES))
    p.add_argument("--seed", type=int, default=1, help="which prompts and samples")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--bucket-width", type=int, default=5, help="answer positions per bucket")
    a = p.parse_args()
    if not a.config.is_file():
        print(f"error: config not found: {a.config}", file=sys.stderr)
        return 2
    run(a.config, a.out, a.depths, a.recipes, a.seed, a.prompts, a.samples, a.bucket_width,
        say=lambda m: print(m, flush=True))
    print(f"wrote {a.out}/error_seed{a.seed}.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
