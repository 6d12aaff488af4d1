"""`serialized_named_tensors` of SGLang's /update_weights_from_tensor: pickled tensor handles, base64 in JSON.

SGLang's `MultiprocessingSerializer` pickles `[(name, tensor), ...]` with `ForkingPickler`, so
torch.multiprocessing's reductions replace each tensor by a handle: a CUDA-IPC handle for a CUDA
tensor, a shared-memory segment for a CPU one. Only the handle crosses HTTP; the engine maps the
same memory. This module writes exactly that (CPU tensors through torch's `file_system` sharing
strategy, the one whose handles a process that did not fork from the sender can open); the engine
side reads it back in engine/tensor_payload.py.
"""
from __future__ import annotations

import base64
import contextlib
import io
from typing import Iterator, Sequence

import torch


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    """torch.multiprocessing's file_system strategy for the duration (restored after)."""
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """base64 ForkingPickler bytes of `[(name, tensor)]` (SGLang's MultiprocessingSerializer with output_str=True).

    CPU tensors must already live in shared memory (`share_memory_()`) and stay alive until the
    engine answered; CUDA tensors travel as CUDA-IPC handles.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions  # noqa: F401  (registers the tensor reducers)

    buf = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buf).dump([(str(n), t) for n, t in named])
    return base64.b64encode(buf.getvalue()).decode("ascii")
