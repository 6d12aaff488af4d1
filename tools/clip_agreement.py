"""Clip decisions against high precision, token by token, from a study's calibration dumps (issue 27 item 6).

    python tools/clip_agreement.py examples/studies/deep_addtrace_dose.yaml   # -> <report_dir>/CLIP_AGREEMENT.md

Reads the finished runs only (megatron_rl/study/clip_agreement.py says what is counted).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    """Load the spec, write the report, print its path."""
    from megatron_rl.study import StudyError, load_study
    from megatron_rl.study.clip_agreement import write_agreement_report

    if len(sys.argv) != 2:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    try:
        out = write_agreement_report(load_study(sys.argv[1]))
    except StudyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
