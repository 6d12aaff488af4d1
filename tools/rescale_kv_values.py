"""Function-preserving V rescaling of an HF warm start (v_proj x factor, o_proj / factor), for FP8 KV cache studies.

    python tools/rescale_kv_values.py WARM_HF_DIR OUT_DIR --factor 1000     # V saturates an FP8 cache at unit scales
    python tools/rescale_kv_values.py WARM_HF_DIR OUT_DIR --factor 1e-4     # V underflows it

Then train from it: `megatron-rl train CONFIG model.init_checkpoint=OUT_DIR precision.kv_cache_dtype=fp8_e4m3
precision.kv_cache_scales=recalibrate|unit` (megatron_rl/study/kv_rescale.py says why the model is unchanged).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    """Parse the command line and write the rescaled directory."""
    from megatron_rl.study.kv_rescale import rescale_hf_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="HF directory of the high-precision warm start")
    p.add_argument("dst", help="output directory (must not exist)")
    p.add_argument("--factor", type=float, required=True, help="V is multiplied, o_proj divided by it")
    a = p.parse_args()
    print(rescale_hf_dir(a.src, a.dst, a.factor))
    return 0


if __name__ == "__main__":
    sys.exit(main())
