"""Named wall-clock timers, one per loop phase (`with timers("rollout"): ...`)."""
from __future__ import annotations

import contextlib
import time
from typing import Iterator


class Timers:
    """Accumulates seconds per phase name for the current step."""

    def __init__(self) -> None:
        """Start with no recorded phases."""
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time the enclosed block under `name` (accumulating if the name repeats)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        """The step's timings as metrics `time/<phase>` (and reset)."""
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out["time/step"] = sum(self.seconds.values())
        self.seconds = {}
        return out
