"""Worker-side half of tests/conftest.py's run_distributed: write this rank's JSON result."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def report(obj: Any) -> None:
    """Write `obj` (JSON-serialisable) as this rank's result for run_distributed."""
    out = os.environ.get("RUN_DISTRIBUTED_RESULT_DIR")
    if not out:
        raise RuntimeError("report() must run under tests/conftest.py:run_distributed (RUN_DISTRIBUTED_RESULT_DIR unset)")
    rank = int(os.environ.get("RANK", "0"))
    tmp = Path(out) / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(obj))
    tmp.rename(Path(out) / f"rank{rank}.json")


def report_cases(parser, run_case, argv=None) -> None:
    """Worker main: `--cases FILE` (a JSON list of argument lists) runs every case in turn in these processes and
    reports the list of their results; other arguments are one case, reported alone. A test module then pays its
    ranks' interpreter, torch and megatron start-up once per world size instead of once per case."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--cases":
        report([run_case(parser().parse_args(args)) for args in json.loads(Path(argv[1]).read_text())])
    else:
        report(run_case(parser().parse_args(argv)))
