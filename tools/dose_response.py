"""Dose-response table and figure of a study whose arms vary algo.experimental.clip_error_scale.

    python tools/dose_response.py examples/studies/deep_addtrace_dose.yaml   # -> <report_dir>/DOSE.md, dose.png

Reads the finished runs only (megatron_rl/study/dose.py says what is in the report).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    """Load the spec, write the report, print its path."""
    from megatron_rl.study import StudyError, load_study
    from megatron_rl.study.dose import write_dose_report

    if len(sys.argv) != 2:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    try:
        study = load_study(sys.argv[1])
        out = write_dose_report(study)
    except StudyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
