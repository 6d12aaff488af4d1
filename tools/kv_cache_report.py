"""Cross-study table of the FP8 KV-cache studies: mismatch, reward, accuracy and the k3 KL target.

    python tools/kv_cache_report.py examples/studies/kv_cache_*.yaml --out docs/studies/kv_cache/KV_CACHE.md

Reads the finished runs only (megatron_rl/study/kv_report.py says what is in the table).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    """Load the specs, write the table, print its path."""
    from megatron_rl.study import StudyError, load_study
    from megatron_rl.study.kv_report import write_kv_report

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("specs", nargs="+", help="study specs (arms: a reference BF16 cache, FP8 at unit / recalibrated scales)")
    p.add_argument("--out", required=True, help="markdown file to write")
    a = p.parse_args()
    try:
        print(write_kv_report([load_study(s) for s in a.specs], Path(a.out)))
    except StudyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
