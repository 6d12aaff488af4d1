"""Metrics sinks: one JSON object per step in <run_dir>/metrics.jsonl, optional TensorBoard scalars."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence


def _clean(value: Any) -> Any:
    """JSON-safe scalar (NaN/inf become null so the file stays standard JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends step metrics; on resume, rows at or after the resumed step are dropped first."""

    def __init__(self, run_dir: str | Path, jsonl: bool = True, tensorboard: bool = False, resume_step: Optional[int] = None,
                 sinks: Sequence[Any] = ()) -> None:
        """Open the sinks; `resume_step` truncates rows from that step on (they will be recomputed); `sinks` are extra
        writers with log(step, metrics) and close() (W&B: tracking/wandb_sink.py)."""
        self.sinks = list(sinks)
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.jsonl = jsonl
        if jsonl and resume_step is not None and self.path.exists():
            kept = [r for r in _rows_before_crash(self.path) if r.get("step", -1) < resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        elif jsonl and resume_step is None:
            self.path.write_text("")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step."""
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        if self.jsonl:
            with self.path.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(float(v)):
                    self.tb.add_scalar(k, v, step)
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        """Flush and close the sinks."""
        if self.tb is not None:
            self.tb.close()
        for sink in self.sinks:
            sink.close()


def _rows_before_crash(path: Path) -> list[dict[str, Any]]:
    """Rows of a run's metrics.jsonl, dropping a torn last line (a process killed mid-write leaves one)."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for k, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if k != len(lines) - 1:
                raise ValueError(f"{path}:{k + 1}: invalid JSON in the middle of the file") from None
    return rows


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a metrics.jsonl file."""
    rows = []
    with Path(path).open() as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
    return rows
