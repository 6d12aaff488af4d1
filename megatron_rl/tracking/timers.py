"""Per-phase timers of the loop (`with timers("rollout"): ...`): wall seconds and this process's CPU seconds.

Wall time measures what a user waits for but moves with everything else the machine runs; the process's CPU time
(all its threads; rollout engines are processes of their own) moves less with load, though not nothing on a
shared core, so side-by-side cost comparisons read `cpu/*` beside `time/*` (benchmarks/calibration_step_cost.py)."""
from __future__ import annotations

import contextlib
import time
from typing import Iterator


class Timers:
    """Accumulates wall and CPU seconds per phase name for the current step."""

    def __init__(self) -> None:
        """Start with no recorded phases."""
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time the enclosed block under `name` (accumulating if the name repeats)."""
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + time.process_time() - cpu_start

    def pop(self) -> dict[str, float]:
        """The step's timings as metrics `time/<phase>` (wall) and `cpu/<phase>` (process CPU), with their sums
        `time/step` and `cpu/step` (and reset)."""
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out["time/step"] = sum(self.seconds.values())
        out.update({f"cpu/{k}": v for k, v in self.cpu_seconds.items()})
        out["cpu/step"] = sum(self.cpu_seconds.values())
        self.seconds, self.cpu_seconds = {}, {}
        return out
