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
