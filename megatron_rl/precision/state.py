"""The one piece of scoped state in precision/: whether a high_precision() block is active."""
from __future__ import annotations

import contextlib
from typing import Iterator

_HIGH_PRECISION_DEPTH = 0


@contextlib.contextmanager
def high_precision() -> Iterator[None]:
    """Run the enclosed forward passes with FP8 disabled (shadow passes of Calibrated Clipping)."""
    global _HIGH_PRECISION_DEPTH
    _HIGH_PRECISION_DEPTH += 1
    try:
        yield
    finally:
        _HIGH_PRECISION_DEPTH -= 1


def high_precision_active() -> bool:
    """True inside `high_precision()`."""
    return _HIGH_PRECISION_DEPTH > 0
