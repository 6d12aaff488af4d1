"""Precision layer: the FP8 policy's leaf implementations (TE on GPU, fake-quant emulation on CPU).

Public surface used by the rest of the code:
- `linear_classes_for_layer(cfg, layer_index, num_layers)`: (column, row) parallel linear classes
  for one transformer layer's spec.
- `high_precision()`: context manager that disables FP8 for shadow passes.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from megatron_rl.config.precision import PrecisionConfig

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


def linear_classes_for_layer(cfg: PrecisionConfig, layer_index: int, num_layers: int):
    """(ColumnParallelLinear-like, RowParallelLinear-like) classes for transformer layer `layer_index`."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear
