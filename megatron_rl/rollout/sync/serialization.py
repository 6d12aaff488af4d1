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
CUDA_VISIBLE_DEVICES orders the GPUs differently still opens the right device, and an engine that does not
see that GPU at all refuses the payload: `_device_from_maybe_uuid` in SGLang's srt/utils/patch_torch.py raises
"Invalid device_uuid=<uuid>", uncaught in `deserialize_own_rank` (managers/tp_worker.py, called from
managers/scheduler_components/weight_updater.py), so the scheduler exits. A CPU tensor names its device the
same way when the sender gives one (`device`: the sending learner rank's identity, rollout/colocation.py): the
payload rebuilds it through `rebuild_on_device`, where an embedded engine started with --visible-devices
refuses another device's tensor with SGLang's message (engine/tensor_payload.py), so the CPU suite proves the
colocated layout that CUDA-IPC needs.
"""
from __future__ import annotations

import base64
import contextlib
import io
from typing import Iterator, Optional, Sequence

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


def visible_device_uuids() -> list[str]:
    """UUIDs of the CUDA devices this process sees, in index order (empty without CUDA)."""
    return [device_uuid(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def device_index_from_uuid(device, uuids: Sequence[str]) -> int:
    """The index of the device named `device` among `uuids` (an int is an index already), as SGLang's
    `_device_from_maybe_uuid` maps it (srt/utils/patch_torch.py); ValueError with its message when none matches."""
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        for index, uuid in enumerate(uuids):
            if uuid == device:
                return index
        raise ValueError("Invalid device_uuid=" + device)
    raise ValueError(f"Unknown type: device_maybe_uuid={device!r}")


def _rebuild_cuda_tensor_from_uuid(*args):
    """torch's rebuild_cuda_tensor with the device argument mapped from a UUID to this process's index."""
    from torch.multiprocessing import reductions

    if len(args) > DEVICE_ARG and not isinstance(args[DEVICE_ARG], int):
        args = (*args[:DEVICE_ARG], device_index_from_uuid(args[DEVICE_ARG], visible_device_uuids()), *args[DEVICE_ARG + 1:])
    return reductions._rebuild_cuda_tensor_original(*args)


def patch_torch_reductions() -> str:
    """Let this process unpickle CUDA tensors that name their device by UUID (what an SGLang engine does first).

    Uses SGLang's own `monkey_patch_torch_reductions` when sglang imports, else the same rebuild-side patch under
    the same attribute (each applies once); returns which one ("sglang" or "megatron_rl").
    """
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:
        monkey_patch_torch_reductions = None
    if monkey_patch_torch_reductions is not None:
        monkey_patch_torch_reductions()
        return "sglang"
    from torch.multiprocessing import reductions

    if getattr(reductions, "_rebuild_cuda_tensor_original", None) is None:
        reductions._rebuild_cuda_tensor_original = reductions.rebuild_cuda_tensor
        # unpickling looks the rebuild up by name (torch.multiprocessing.reductions.rebuild_cuda_tensor)
        reductions.rebuild_cuda_tensor = _rebuild_cuda_tensor_from_uuid
    return "megatron_rl"


def rebuild_on_device(device: str, rebuild, args):
    """A CPU tensor of a payload that names the device it was sent from (`rebuild(*args)` is torch's own rebuild;
    the engine side maps this name to a check of its visible devices first)."""
    return rebuild(*args)


def _tensor_pickler(device: Optional[str]):
    """A ForkingPickler whose CUDA tensors name their device by UUID (SGLang's patched reduction) and whose CPU
    tensors name `device` when given (else as torch reduces them)."""
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
            if device is not None and isinstance(obj, torch.Tensor):
                return rebuild_on_device, (device, *reductions.reduce_tensor(obj))
            return NotImplemented

    return UuidPickler


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]], device: Optional[str] = None) -> str:
    """base64 ForkingPickler bytes of `[(name, tensor)]` (SGLang's MultiprocessingSerializer with output_str=True).

    CPU tensors must already live in shared memory (`share_memory_()`) and stay alive until the
    engine answered; they name `device` when given. CUDA tensors travel as CUDA-IPC handles naming
    their own device by UUID.
    """
    import torch.multiprocessing.reductions  # noqa: F401  (registers the tensor reducers)

    buf = io.BytesIO()
    with _file_system_sharing():
        _tensor_pickler(device)(buf).dump([(str(n), t) for n, t in named])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def payload_devices(named: Sequence[tuple[str, torch.Tensor]], device: Optional[str] = None) -> set[str]:
    """The device names a payload of `named` carries: each CUDA tensor's UUID, `device` for CPU tensors when given."""
    return {device_uuid(t.device.index if t.device.index is not None else torch.cuda.current_device())
            if t.is_cuda else device for _, t in named} - {None}


def serialize_per_rank(named: Sequence[tuple[str, torch.Tensor]], tp_size: int, device: Optional[str] = None) -> list[str]:
    """`serialized_named_tensors` for an engine of `tp_size` TP ranks: one payload per rank, each pickled on its own
    (CPU tensors naming `device` when given)."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    return [serialize_named_tensors(named, device) for _ in range(tp_size)]
