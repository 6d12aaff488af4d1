"""Decoding of `serialized_named_tensors` (SGLang's /update_weights_from_tensor) on the engine side.

An entry is base64 text of ForkingPickler bytes of `[(name, tensor), ...]` (SGLang's
MultiprocessingSerializer; rollout/sync/serialization.py writes them): torch.multiprocessing's
reductions replaced each tensor by a handle to shared memory (CPU, `file_system` strategy) or a
CUDA-IPC handle. The unpickler here admits only torch's CPU tensor-rebuild functions, so a request
body can never run arbitrary code in the engine. `load_format="flattened_bucket"` payloads (a dict
with one flat uint8 tensor and SGLang's FlattenedTensorMetadata list) are read too.

Visible devices: a tensor whose payload names the device it was sent from (the sender's CPU stand-in
of a CUDA device UUID, rollout/sync/serialization.py `rebuild_on_device`) opens only on an engine that
sees that device. An engine given `visible_devices` (--visible-devices) refuses any other with the
text SGLang's `_device_from_maybe_uuid` raises for a CUDA-IPC handle of a GPU its process does not
see (srt/utils/patch_torch.py: "Invalid device_uuid=<uuid>"); without the list it sees every device.
"""
from __future__ import annotations

import base64
import io
import pickle
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch


@dataclass
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket (field for field SGLang's class of the same name)."""

    name: str
    """HF name."""
    shape: Any
    """Shape (torch.Size)."""
    dtype: torch.dtype
    """dtype."""
    start_idx: int
    """First byte in the flat uint8 tensor."""
    end_idx: int
    """One past the last byte."""
    numel: int
    """Bytes."""


_REBUILDS = {"rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename", "rebuild_storage_empty",
             "rebuild_typed_storage_child"}


INVALID_DEVICE = "Invalid device_uuid="
"""SGLang's message for a tensor handle naming a device its process does not see (srt/utils/patch_torch.py)."""


def check_device(device: Any, visible_devices: Optional[Sequence[str]]) -> None:
    """ValueError with SGLang's text when `device` is not one of `visible_devices` (None: every device is visible)."""
    if not isinstance(device, str):
        raise ValueError(f"Unknown type: device_maybe_uuid={device!r}")
    if visible_devices is not None and device not in visible_devices:
        raise ValueError(INVALID_DEVICE + device)


class _TensorUnpickler(pickle.Unpickler):
    """Admits torch's CPU tensor rebuilds, dtypes, Size, storages and SGLang's bucket metadata; nothing else."""

    def __init__(self, file, visible_devices: Optional[Sequence[str]] = None) -> None:
        super().__init__(file)
        self.visible_devices = visible_devices

    def _rebuild_on_device(self, device: Any, rebuild: Any, args: Any) -> Any:
        check_device(device, self.visible_devices)
        if not callable(rebuild) or not isinstance(args, tuple):
            raise ValueError("a device-named tensor must hold a tensor rebuild and its arguments")
        return rebuild(*args)

    def find_class(self, module: str, name: str) -> Any:
        if module == "megatron_rl.rollout.sync.serialization" and name == "rebuild_on_device":
            return self._rebuild_on_device
        if module == "torch.multiprocessing.reductions":
            if name in _REBUILDS:
                return getattr(torch.multiprocessing.reductions, name)
            if name == "rebuild_cuda_tensor":
                raise ValueError("CUDA-IPC tensor handles need an engine on a CUDA device; this engine runs on CPU")
            if name == "rebuild_storage_fd":
                raise ValueError("file-descriptor tensor handles cannot be opened by an unrelated process; serialize "
                                 "with torch.multiprocessing's 'file_system' sharing strategy")
        if module == "torch" and (name in ("Tensor", "Size") or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if module == "torch.storage" and name in ("UntypedStorage", "TypedStorage"):
            return getattr(torch.storage, name)
        if module == "torch.nn.parameter" and name == "Parameter":
            return torch.nn.Parameter
        if name == "FlattenedTensorMetadata" and module.startswith(("sglang.", __name__)):
            return FlattenedTensorMetadata
        raise ValueError(f"serialized_named_tensors refers to {module}.{name}, which a tensor payload never needs")


def deserialize_named_tensors(blob: Any, visible_devices: Optional[Sequence[str]] = None) -> Any:
    """The object of one `serialized_named_tensors` entry (base64 text or raw bytes); ValueError when malformed or
    when a tensor names a device outside `visible_devices` (None: all are visible)."""
    import torch.multiprocessing.reductions  # noqa: F401

    if isinstance(blob, str):
        try:
            raw = base64.b64decode(blob, validate=True)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"serialized_named_tensors entry is not base64: {exc}") from None
    elif isinstance(blob, (bytes, bytearray)):
        raw = bytes(blob)
    else:
        raise ValueError(f"serialized_named_tensors entries must be base64 strings, got {type(blob).__name__}")
    try:
        return _TensorUnpickler(io.BytesIO(raw), visible_devices).load()
    except ValueError:
        raise
    except Exception as exc:  # truncated data, vanished shared-memory segment, ...
        raise ValueError(f"serialized_named_tensors entry cannot be read: {type(exc).__name__}: {exc}") from None


def unflatten_bucket(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a flattened_bucket payload {"flattened_tensor", "metadata"}."""
    if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
        raise ValueError("load_format=flattened_bucket expects {'flattened_tensor': uint8 tensor, 'metadata': [...]}")
    flat, metas = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise ValueError("flattened_tensor must be a 1-D tensor")
    flat = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    out = []
    for m in metas:
        if not isinstance(m, FlattenedTensorMetadata):
            raise ValueError("metadata entries must be FlattenedTensorMetadata")
        if not 0 <= m.start_idx <= m.end_idx <= flat.numel():
            raise ValueError(f"metadata of {m.name} points outside the flat tensor")
        out.append((m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(tuple(m.shape))))
    return out


def named_tensor_list(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """Check that a deserialized payload is [(name, tensor), ...]."""
    if not isinstance(obj, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in obj):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return [(n, t) for n, t in obj]
