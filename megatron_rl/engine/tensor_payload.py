"""Decoding of `serialized_named_tensors` (SGLang's /update_weights_from_tensor) on the engine side.

An entry is base64 text of ForkingPickler bytes of `[(name, tensor), ...]` (SGLang's
MultiprocessingSerializer; rollout/sync/serialization.py writes them): torch.multiprocessing's
reductions replaced each tensor by a handle to shared memory (CPU, `file_system` strategy) or a
CUDA-IPC handle. The unpickler here admits only torch's CPU tensor-rebuild functions, so a request
body can never run arbitrary code in the engine. `load_format="flattened_bucket"` payloads (a dict
with one flat uint8 tensor and SGLang's FlattenedTensorMetadata list) are read too.
"""
from __future__ import annotations

import base64
import io
import pickle
from dataclasses import dataclass
from typing import Any

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


class _TensorUnpickler(pickle.Unpickler):
    """Admits torch's CPU tensor rebuilds, dtypes, Size, storages and SGLang's bucket metadata; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
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


def deserialize_named_tensors(blob: Any) -> Any:
    """The object of one `serialized_named_tensors` entry (base64 text or raw bytes); ValueError when malformed."""
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
        return _TensorUnpickler(io.BytesIO(raw)).load()
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
