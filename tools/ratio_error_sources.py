"""Where the low-precision log-ratio error comes from: which GEMMs/layers, tokens and sequences carry its tail, and
how much of it is the change of per-tensor scales between theta_old and theta rather than the rounding itself.

    python tools/ratio_error_sources.py CONFIG --out OUT [dotted overrides ...] [--seed 51] [--prompts 16]
        [--samples 8] [--warm-start RUN_DIR]

e.g. the deep miniature's FP8 tensorwise learner, from a study's warm start:

    python tools/ratio_error_sources.py examples/configs/deep_addtrace_grpo.yaml --out runs/ratio_error_sources \
        precision.recipe=tensorwise precision.rollout_quantization=fp8-blockwise --seed 51 \
        --warm-start outputs/studies/deep_addtrace_consistent_scales/warm_start

What it measures and writes: megatron_rl/study/ratio_error_sources.py. Without --warm-start the config's SFT runs
once under OUT/. One CPU thread and the pinned kernel paths (megatron_rl/cpu_kernels.py), as tools/logratio_depth.py.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    """Parse the command line and run the measurement."""
    from megatron_rl.cpu_kernels import reexec_pinned

    reexec_pinned()
    from megatron_rl.study.ratio_error_sources import run

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", type=Path, help="run config whose model, data, learner precision, loss and lr are used")
    p.add_argument("overrides", nargs="*", help="dotted config overrides (key=value), e.g. precision.recipe=tensorwise")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--seed", type=int, default=51, help="which prompts and samples")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--warm-start", type=Path, default=None,
                   help="a run directory holding sft/hf and data/ (a study's warm_start/) instead of a new SFT")
    a = p.parse_intermixed_args()
    if not a.config.is_file():
        print(f"error: config not found: {a.config}", file=sys.stderr)
        return 2
    command = "python tools/ratio_error_sources.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    run(a.config, a.out, a.overrides, a.seed, a.prompts, a.samples, a.warm_start, command=command,
        say=lambda m: print(m, flush=True))
    print(f"wrote {a.out}/ratio_error_sources_seed{a.seed}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
