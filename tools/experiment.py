"""Thin wrapper of `megatron-rl study`: arms x seeds from one shared warm start, then RESULTS.md and plots.

    python tools/experiment.py examples/studies/tiny_precision.yaml [--report-only]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["study", *sys.argv[1:]]))
