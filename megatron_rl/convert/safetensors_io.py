"""Streaming safetensors I/O for HF directories: read tensor by tensor, write size-bounded shards plus the index.

Neither side holds a whole model: `iter_hf_tensors` opens one file at a time with safetensors'
lazy `safe_open`, and `ShardedWriter` flushes a shard as soon as it reaches `max_shard_bytes`,
naming shards `model-0000i-of-0000N.safetensors` and writing `model.safetensors.index.json`
({"metadata": {"total_size"}, "weight_map"}) as transformers, SGLang and vLLM read it; like
transformers' save_pretrained, a model that fits one shard is a single `model.safetensors`.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import torch

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
"""HF's default shard size (5 GB)."""
SIDE_FILE_PREFIXES = ("tokenizer", "special_tokens", "generation_config", "vocab", "merges", "chat_template")
"""Files of an HF directory that travel with the weights (tokenizer, chat template, generation defaults)."""
INDEX_FILE = "model.safetensors.index.json"
"""Name of the shard index."""
SINGLE_FILE = "model.safetensors"
"""Name of the weights file of a model that fits one shard."""


def hf_weight_files(hf_dir: str | Path) -> list[Path]:
    """The safetensors files of an HF directory (from its index when there is one); FileNotFoundError if none."""
    d = Path(hf_dir)
    index = d / INDEX_FILE
    if index.exists():
        files = sorted({d / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    return files


def iter_hf_tensors(hf_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight of an HF directory, one tensor in memory at a time."""
    from safetensors import safe_open

    for f in hf_weight_files(hf_dir):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


class SlicedHFReader:
    """Reads an HF directory's tensors lazily (safetensors `safe_open` per file, `get_slice` per read).

    A read materializes only the rows or columns it asks for, so a learner rank holds its own TP/PP share of
    the checkpoint, not the model; `bytes_read` counts what the reads materialized.
    """

    def __init__(self, hf_dir: str | Path) -> None:
        """Open every weight file of `hf_dir` (FileNotFoundError when it has none); nothing is read yet."""
        from safetensors import safe_open

        self._files = [safe_open(str(f), framework="pt") for f in hf_weight_files(hf_dir)]
        self._where = {name: fh for fh in self._files for name in fh.keys()}
        self.bytes_read = 0
        """Bytes of every tensor the reads returned."""

    def names(self) -> list[str]:
        """Names of every tensor of the directory."""
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor `name` (from the file header; nothing is read)."""
        return tuple(self._where[name].get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor `name`, or only its [start, stop) along `dim` (the rest of it is never read)."""
        fh = self._where[name]
        if dim is None:
            t = fh.get_tensor(name)
        else:
            index = [slice(None)] * len(self.shape(name))
            index[dim] = slice(start, stop)
            t = fh.get_slice(name)[tuple(index)]
        self.bytes_read += t.numel() * t.element_size()
        return t


def hf_tensor_dtype(hf_dir: str | Path) -> torch.dtype:
    """Dtype of the first floating-point tensor of an HF directory (what the checkpoint stores)."""
    for _, t in iter_hf_tensors(hf_dir):
        if t.is_floating_point():
            return t.dtype
    raise ValueError(f"{hf_dir} holds no floating-point tensor")


class ShardedWriter:
    """Collects tensors and writes them as size-bounded safetensors shards plus the index (call `close`)."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        """Write into `out_dir` (created); a shard closes once adding a tensor would pass `max_shard_bytes`."""
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor (a duplicate name is an error)."""
        if name in self._pending or any(name in names for _, names in self._shards):
            raise ValueError(f"tensor {name!r} written twice")
        n = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + n > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().cpu().contiguous()
        self._pending_bytes += n
        self.total_bytes += n

    def _flush(self) -> None:
        """Write the queued tensors as the next shard (a temporary name until the shard count is known)."""
        from safetensors.torch import save_file

        path = self.out / f".shard-{len(self._shards) + 1:05d}.safetensors.partial"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> dict[str, str]:
        """Flush, give shards their final names, write the index; returns the weight map."""
        if self._pending or not self._shards:
            self._flush()
        count = len(self._shards)
        weight_map: dict[str, str] = {}
        if count == 1:  # as transformers' save_pretrained: one file needs no index
            path, names = self._shards[0]
            path.replace(self.out / SINGLE_FILE)
            return {n: SINGLE_FILE for n in names}
        for i, (path, names) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            path.replace(self.out / final)
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map


def copy_side_files(src_dir: str | Path, dst_dir: str | Path, include_config: bool = False) -> list[str]:
    """Copy tokenizer / chat-template / generation files (and config.json when asked) between HF directories."""
    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and (f.name.startswith(SIDE_FILE_PREFIXES) or (include_config and f.name == "config.json")):
            shutil.copyfile(f, dst / f.name)
            copied.append(f.name)
    return copied
