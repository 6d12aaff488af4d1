"""Consistent quantization (precision.ratio_consistent_scales): theta's forwards reuse theta_old's FP8 scales.

The importance ratio of an RL update compares two FP8 forwards of the same tokens, pi_theta and pi_old. Under
current (per-tensor) scaling every GEMM operand of the theta forward is scaled by its own new amax, so a weight or
activation element that did not move still re-rounds when the amax moved, and that re-rounding enters the log-ratio
as noise. A ScaleBook records, during pi_old's forward, the amax of every per-tensor GEMM operand (weights and
activations of each fake-quant linear), keyed by (micro-batch, quantizer, operand); a later FP8 forward of the same
micro-batch (the training forwards of the step's updates, a per_minibatch pre-pass, a health probe of the same rows)
quantizes with the recorded amax instead of its own, so unchanged elements round exactly as pi_old rounded them.
Values above the recorded amax saturate at the format's max (as under delayed scaling). Backward operands (output
gradients) keep fresh scales: they never enter a ratio.

The book is filled by `recording()` (phases/logprobs.py, pi_old's forward; it first forgets the previous step) and
read by every later forward inside `micro_batch(key)` (trainer/learner.py sets the key of each micro-batch: its
rows' sample indices) until the next recording; `paused()` keeps a forward of other weights (the KL reference
policy) on its own scales. Recording costs one stored 0-d amax per operand and micro-batch and no extra forward;
replaying skips the amax reduction. Implemented for recipe=tensorwise (config/precision.py rejects the others).
"""
from __future__ import annotations

import contextlib
from typing import Hashable, Iterator, Optional

import torch

from megatron_rl.precision import numerics as nx


class ScaleBook:
    """theta_old's per-tensor amaxes of one RL step, keyed by (micro-batch key, quantizer, operand role)."""

    def __init__(self) -> None:
        """An empty book, not recording, outside any micro-batch."""
        self._amax: dict[tuple, torch.Tensor] = {}
        self._recording = False
        self._key: Optional[Hashable] = None
        self._paused = 0
        self.replayed = 0
        """Operands quantized with a recorded amax since the last recording (a check that replay happens)."""
        self.enabled = False
        """True once attached to a linear (precision.ratio_consistent_scales); an unattached book records nothing."""

    def __len__(self) -> int:
        """Recorded operands."""
        return len(self._amax)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Forget the previous step's amaxes and record those of the enclosed forwards (pi_old)."""
        self._amax.clear()
        self.replayed = 0
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    @contextlib.contextmanager
    def micro_batch(self, key: Optional[Hashable]) -> Iterator[None]:
        """The enclosed forward is of micro-batch `key` (None: neither recorded nor replayed)."""
        outer, self._key = self._key, key
        try:
            yield
        finally:
            self._key = outer

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The enclosed forwards use their own scales (another policy's weights: the KL reference)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def amax(self, owner: int, role: str, x: torch.Tensor, given: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The amax operand `role` of quantizer `owner` is scaled by: recorded (and returned) while recording, the
        recorded one when replaying a recorded micro-batch, else `given` (None: the tensor's own)."""
        if self._key is None or self._paused:
            return given
        k = (self._key, owner, role)
        if self._recording:
            a = (nx.tensor_amax(x) if given is None else given).detach().reshape(())
            self._amax[k] = a
            return a
        a = self._amax.get(k)
        if a is None:
            return given
        self.replayed += 1
        return a


def micro_batch_key(batch) -> Optional[tuple]:
    """A micro-batch's identity within a step: its rows' sample indices (None when the batch carries none)."""
    index = getattr(batch, "sample_index", None)
    return None if index is None else tuple(int(i) for i in index.tolist())


def attach(modules, book: ScaleBook) -> int:
    """Give every fake-quant linear among `modules` (an iterable of nn.Modules) the book; returns how many."""
    n = 0
    for m in modules:
        quant = getattr(m, "fp8_quant", None)
        if quant is not None and hasattr(quant, "scale_book"):
            quant.scale_book = book
            n += 1
    book.enabled = book.enabled or n > 0
    return n


_INERT = ScaleBook()


def book_of(learner) -> ScaleBook:
    """The learner's scale book (an inert one for learners without: stand-ins of tests and tools)."""
    book = getattr(learner, "scale_book", None)
    return _INERT if book is None else book
