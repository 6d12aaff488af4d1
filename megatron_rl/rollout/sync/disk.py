"""Disk weight sync: write an HF checkpoint directory per weight version, then have every engine reload it.

Each version is written into a temporary directory inside `sync_dir` and renamed into place
(a rename within one filesystem is atomic), so an engine never reads a half-written checkpoint.
Only the newest `keep_last` versions are kept. Works with real SGLang servers when `sync_dir`
is on a filesystem they share with the trainer.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from typing import Any, Mapping, Optional, Sequence

import torch

from megatron_rl.rollout.client import RolloutClient

VERSION_PREFIX = "weights_"
CONFIG_FILES = ("config.json", "generation_config.json")


def _version_dirname(weight_version: Any) -> str:
    """Directory name of a weight version (safe characters only)."""
    text = str(weight_version)
    if not text or not re.fullmatch(r"[A-Za-z0-9._-]+", text):
        raise ValueError(f"weight_version {text!r} must be non-empty and use only letters, digits, '.', '_' or '-'")
    return VERSION_PREFIX + text


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_hf_checkpoint(state_dict: Mapping[str, torch.Tensor], hf_config_dir: str, out_dir: str,
                        config_updates: Optional[Mapping[str, Any]] = None) -> None:
    """Write config.json (+ generation_config.json) from `hf_config_dir` and model.safetensors into the existing `out_dir`."""
    from safetensors.torch import save_file

    src_config = os.path.join(hf_config_dir, "config.json")
    if not os.path.isfile(src_config):
        raise FileNotFoundError(f"hf_config_dir {hf_config_dir!r} has no config.json")
    if not state_dict:
        raise ValueError("state_dict is empty")
    with open(src_config) as f:
        config = json.load(f)
    config.update(config_updates or {})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in CONFIG_FILES[1:]:
        if os.path.isfile(os.path.join(hf_config_dir, name)):
            shutil.copyfile(os.path.join(hf_config_dir, name), os.path.join(out_dir, name))
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(value).__name__}, not a tensor")
        t = value.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # safetensors refuses shared or partial storage (e.g. tied embeddings)
        seen.add(key)
        tensors[name] = t
    path = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    with open(path, "rb") as f:
        os.fsync(f.fileno())


class DiskWeightSync:
    """Transport 'disk': versioned HF checkpoints in `sync_dir`, loaded by each engine via /update_weights_from_disk."""

    name = "disk"

    def __init__(self, sync_dir: str, hf_config_dir: str, worker_urls: Sequence[str], keep_last: int = 2,
                 client: Optional[RolloutClient] = None, load_format: Optional[str] = None,
                 request_timeout_s: float = 600.0):
        """`worker_urls` are the engines themselves (a router does not forward weight updates)."""
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        if not worker_urls:
            raise ValueError("worker_urls must list at least one engine URL")
        if not os.path.isfile(os.path.join(hf_config_dir, "config.json")):
            raise FileNotFoundError(f"hf_config_dir {hf_config_dir!r} has no config.json")
        self.sync_dir = os.path.abspath(sync_dir)
        self.hf_config_dir = hf_config_dir
        self.keep_last = keep_last
        self.load_format = load_format
        self.request_timeout_s = request_timeout_s
        self.client = client or RolloutClient(list(worker_urls), request_timeout_s=request_timeout_s)
        os.makedirs(self.sync_dir, exist_ok=True)

    def write(self, state_dict: Mapping[str, torch.Tensor], weight_version: Any,
              config_updates: Optional[Mapping[str, Any]] = None) -> str:
        """Atomically write version `weight_version`; returns its directory (replacing an older copy of the same version)."""
        final = os.path.join(self.sync_dir, _version_dirname(weight_version))
        tmp = os.path.join(self.sync_dir, f".tmp_{uuid.uuid4().hex}")
        os.makedirs(tmp)
        try:
            write_hf_checkpoint(state_dict, self.hf_config_dir, tmp, config_updates)
            _fsync_dir(tmp)
            if os.path.exists(final):
                trash = os.path.join(self.sync_dir, f".old_{uuid.uuid4().hex}")
                os.rename(final, trash)
                os.rename(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(tmp, final)
            _fsync_dir(self.sync_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def versions(self) -> list[str]:
        """Version directories in `sync_dir`, oldest first (by modification time)."""
        dirs = [os.path.join(self.sync_dir, d) for d in os.listdir(self.sync_dir)
                if d.startswith(VERSION_PREFIX) and os.path.isdir(os.path.join(self.sync_dir, d))]
        return sorted(dirs, key=lambda d: (os.stat(d).st_mtime_ns, d))

    def prune(self, keep: Optional[str] = None) -> list[str]:
        """Delete all but the newest `keep_last` versions (never `keep`); returns the deleted paths."""
        old = self.versions()[:-self.keep_last]
        removed = []
        for d in old:
            if keep is not None and os.path.samefile(d, keep):
                continue
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
        return removed

    async def push_async(self, state_dict: Mapping[str, torch.Tensor], weight_version: Any,
                         config_updates: Optional[Mapping[str, Any]] = None) -> str:
        """Write the version, have every engine load it (raises RolloutServerError if one fails), prune; returns the path."""
        path = self.write(state_dict, weight_version, config_updates)
        # the directory's mtime orders versions; touch it so a re-pushed version counts as newest
        now = time.time()
        os.utime(path, (now, now))
        await self.client.update_weights_from_disk(path, str(weight_version), load_format=self.load_format,
                                                   flush_cache=True, timeout_s=self.request_timeout_s)
        self.prune(keep=path)
        return path

    def push(self, state_dict: Mapping[str, torch.Tensor], weight_version: Any,
             config_updates: Optional[Mapping[str, Any]] = None) -> str:
        """Blocking `push_async`."""
        from megatron_rl.rollout.client import run_sync

        return run_sync(self.push_async(state_dict, weight_version, config_updates))
