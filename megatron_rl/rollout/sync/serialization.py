"""`serialized_named_tensors` of SGLang's /update_weights_from_tensor: pickled tensor handles, base64 in JSON.

SGLang's `MultiprocessingSerializer` pickles `[(name, tensor), ...]` with `ForkingPickler`, so
torch.multiprocessing's reductions replace each tensor by a handle: a CUDA-IPC handle for a CUDA
tensor, a shared-memory segment for a CPU one. Only the handle crosses HTTP; the engine maps the
same memory. This module writes exactly that (CPU tensors through torch's `file_system` sharing
strategy, the one whose handles a process that did not fork from the sender can open); the engine
side reads it back in engine/tensor_payload.py.

As SGLang's own `Engine._serialize_tensors_per_rank` does, the request carries one payload per TP
rank of the engine, each pickled on its own (`serialize_per_rank`): TP rank r opens only entry r, so
every CUDA-IPC handle is opened once and the sender's reference counts (torch's CudaIPCSentData)
drop cleanly after each load. A CUDA tensor's device travels as the GPU's UUID instead of this
process's device index (SGLang's `monkey_patch_torch_reductions`, applied by every engine before it
deserializes, maps the UUID back to the index the engine sees), so an engine whose
CUDA_VISIBLE_DEVICES orders the GPUs differently still opens the right device.
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


DEVICE_ARG = 6
"""Position of the device index in the rebuild arguments torch's `reduce_tensor` gives a CUDA tensor (the one
SGLang's patch replaces by the UUID; tests/gpu checks it against torch)."""


def device_uuid(index: int) -> str:
    """The UUID of CUDA device `index` as SGLang writes it (str of the device properties' uuid)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def _tensor_pickler():
    """A ForkingPickler whose CUDA tensors name their device by UUID (SGLang's patched reduction), others as torch does."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    class UuidPickler(ForkingPickler):
        def reducer_override(self, obj):
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                rebuild, args = reductions.reduce_tensor(obj)
                if rebuild is not reductions.rebuild_cuda_tensor or not isinstance(args[DEVICE_ARG], int):
                    raise RuntimeError(f"torch {torch.__version__} reduces CUDA tensors differently than SGLang's patch "
                                       f"expects (device index at argument {DEVICE_ARG} of rebuild_cuda_tensor)")
                return rebuild, (*args[:DEVICE_ARG], device_uuid(args[DEVICE_ARG]), *args[DEVICE_ARG + 1:])
            return NotImplemented

    return UuidPickler


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """base64 ForkingPickler bytes of `[(name, tensor)]` (SGLang's MultiprocessingSerializer with output_str=True).

    CPU tensors must already live in shared memory (`share_memory_()`) and stay alive until the
    engine answered; CUDA tensors travel as CUDA-IPC handles naming their device by UUID.
    """
    import torch.multiprocessing.reductions  # noqa: F401  (registers the tensor reducers)

    buf = io.BytesIO()
    with _file_system_sharing():
        _tensor_pickler()(buf).dump([(str(n), t) for n, t in named])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_per_rank(named: Sequence[tuple[str, torch.Tensor]], tp_size: int) -> list[str]:
    """`serialized_named_tensors` for an engine of `tp_size` TP ranks: one payload per rank, each pickled on its own."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    return [serialize_named_tensors(named) for _ in range(tp_size)]
