"""Disk weight sync: a versioned HF checkpoint per weight version, written bucket by bucket, then loaded by every engine.

Each stage sender writes each bucket as its own safetensors shard into a staging directory in
`sync_dir` (`model-pp{stage}-{k}.safetensors`), so no rank ever holds the whole model. The
controller then writes `model.safetensors.index.json` (read from the shards' headers) and
config.json, renames the staging directory into place (atomic within one filesystem: an engine
never reads a half-written checkpoint), and posts /update_weights_from_disk with the version. A
single-shard checkpoint is stored as plain `model.safetensors`. Only the newest `keep_last`
versions are kept. Every stage sender and every engine must see `sync_dir` (a shared filesystem
across nodes); real SGLang servers load these directories as they are.
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

from megatron_rl.rollout.client import RolloutClient, run_sync
from megatron_rl.rollout.sync.base import Bucket, WeightTransport

VERSION_PREFIX = "weights_"
STAGING_PREFIX = ".tmp_weights_"
CONFIG_FILES = ("config.json", "generation_config.json")
INDEX_FILE = "model.safetensors.index.json"


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


def write_shard(tensors: Bucket, path: str) -> int:
    """Write one safetensors shard (CPU copies where storage is shared or partial) and fsync it; returns its bytes."""
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, value in tensors:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(value).__name__}, not a tensor")
        if name in out:
            raise ValueError(f"tensor {name!r} appears twice in one bucket")
        t = value.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # safetensors refuses shared or partial storage (tied embeddings, views)
        seen.add(key)
        out[name] = t
    save_file(out, path, metadata={"format": "pt"})
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return sum(t.numel() * t.element_size() for t in out.values())


def shard_names(path: str) -> list[str]:
    """Tensor names stored in a safetensors file (header only)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return list(f.keys())


def finalize_checkpoint(staging: str, hf_config_dir: str, config_updates: Optional[Mapping[str, Any]] = None) -> None:
    """Turn a directory of shards into an HF checkpoint: config files plus an index (or one model.safetensors)."""
    src_config = os.path.join(hf_config_dir, "config.json")
    if not os.path.isfile(src_config):
        raise FileNotFoundError(f"hf_config_dir {hf_config_dir!r} has no config.json")
    shards = sorted(f for f in os.listdir(staging) if f.endswith(".safetensors"))
    if not shards:
        raise ValueError(f"{staging}: no tensors were written")
    weight_map: dict[str, str] = {}
    for shard in shards:
        for name in shard_names(os.path.join(staging, shard)):
            if name in weight_map:
                raise ValueError(f"tensor {name!r} was written twice ({weight_map[name]} and {shard})")
            weight_map[name] = shard
    if len(shards) == 1:
        os.rename(os.path.join(staging, shards[0]), os.path.join(staging, "model.safetensors"))
    else:
        total = sum(os.path.getsize(os.path.join(staging, s)) for s in shards)
        with open(os.path.join(staging, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(src_config) as f:
        config = json.load(f)
    config.update(config_updates or {})
    with open(os.path.join(staging, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in CONFIG_FILES[1:]:
        src, dst = os.path.join(hf_config_dir, name), os.path.join(staging, name)
        if os.path.isfile(src) and not (os.path.exists(dst) and os.path.samefile(src, dst)):
            shutil.copyfile(src, dst)
    _fsync_dir(staging)


def write_hf_checkpoint(state_dict: Mapping[str, torch.Tensor], hf_config_dir: str, out_dir: str,
                        config_updates: Optional[Mapping[str, Any]] = None) -> None:
    """Write config.json (+ generation_config.json) from `hf_config_dir` and model.safetensors into the existing `out_dir`."""
    if not state_dict:
        raise ValueError("state_dict is empty")
    write_shard(list(state_dict.items()), os.path.join(out_dir, "model-pp00-00000.safetensors"))
    finalize_checkpoint(out_dir, hf_config_dir, config_updates)


class DiskWeightSync(WeightTransport):
    """Transport 'disk': versioned HF checkpoints in `sync_dir`, loaded by each engine via /update_weights_from_disk."""

    name = "disk"

    def __init__(self, sync_dir: str, hf_config_dir: str, worker_urls: Sequence[str], keep_last: int = 2,
                 client: Optional[RolloutClient] = None, load_format: Optional[str] = None,
                 request_timeout_s: float = 600.0, bucket_mb: float = 512.0, pause_mode: str = "abort",
                 api_key: Optional[str] = None):
        """`worker_urls` are the engines themselves (a router does not forward weight updates)."""
        super().__init__(worker_urls, bucket_mb, request_timeout_s, pause_mode, client, api_key)
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        if not os.path.isfile(os.path.join(hf_config_dir, "config.json")):
            raise FileNotFoundError(f"hf_config_dir {hf_config_dir!r} has no config.json")
        self.sync_dir = os.path.abspath(sync_dir)
        self.hf_config_dir = hf_config_dir
        self.keep_last = keep_last
        self.load_format = load_format
        self.request_timeout_s = request_timeout_s
        self._staging = ""
        self._shards = 0
        os.makedirs(self.sync_dir, exist_ok=True)

    def staging_dir(self, weight_version: Any) -> str:
        """Where the stage senders write version `weight_version` before it is published."""
        return os.path.join(self.sync_dir, STAGING_PREFIX + _version_dirname(weight_version)[len(VERSION_PREFIX):])

    # ------------------------------------------------------------------ streaming (phases/weights.py)
    def begin(self, weight_version: Any) -> None:
        """Pause the engines and start an empty staging directory for the version."""
        staging = self.staging_dir(weight_version)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        super().begin(weight_version)

    def begin_stage(self, stage: int, num_stages: int, weight_version: Any) -> None:
        """Write this stage's shards into the version's staging directory (made by the controller's begin)."""
        super().begin_stage(stage, num_stages, weight_version)
        self._staging = self.staging_dir(weight_version)
        self._shards = 0
        if not os.path.isdir(self._staging):
            raise RuntimeError(f"disk weight sync: {self._staging} does not exist on this rank; "
                               "rollout.weight_sync.sync_dir must be on a filesystem every learner node shares")

    def send_bucket(self, bucket: Bucket, final: bool) -> None:
        """Write the bucket as the stage's next shard."""
        write_shard(bucket, os.path.join(self._staging, f"model-pp{self.stage:02d}-{self._shards:05d}.safetensors"))
        self._shards += 1

    def commit(self, weight_version: Any, config_updates: Optional[Mapping[str, Any]] = None) -> None:
        """Publish the staged shards as version `weight_version`, have every engine load it, prune old versions."""
        path = self.publish(self.staging_dir(weight_version), weight_version, config_updates)
        run_sync(self.client.update_weights_from_disk(path, str(weight_version), load_format=self.load_format,
                                                      flush_cache=True, timeout_s=self.request_timeout_s))
        self.prune(keep=path)

    # ------------------------------------------------------------------ whole state dicts (tests, tools)
    def publish(self, staging: str, weight_version: Any, config_updates: Optional[Mapping[str, Any]] = None) -> str:
        """Finalize `staging` and rename it to the version's directory (replacing an older copy); returns it."""
        final = os.path.join(self.sync_dir, _version_dirname(weight_version))
        try:
            finalize_checkpoint(staging, self.hf_config_dir, config_updates)
            if os.path.exists(final):
                trash = os.path.join(self.sync_dir, f".old_{uuid.uuid4().hex}")
                os.rename(final, trash)
                os.rename(staging, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(staging, final)
            _fsync_dir(self.sync_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        # the directory's mtime orders versions; touch it so a re-pushed version counts as newest
        now = time.time()
        os.utime(final, (now, now))
        return final

    def write(self, state_dict: Mapping[str, torch.Tensor], weight_version: Any,
              config_updates: Optional[Mapping[str, Any]] = None) -> str:
        """Atomically write version `weight_version` from a whole state dict; returns its directory."""
        _version_dirname(weight_version)
        staging = os.path.join(self.sync_dir, f".tmp_{uuid.uuid4().hex}")
        os.makedirs(staging)
        try:
            if not state_dict:
                raise ValueError("state_dict is empty")
            items = list(state_dict.items())
            start, size = 0, 0
            shards = 0
            for i, (_, t) in enumerate(items):  # the same bucket size as the streaming path
                n = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
                if i > start and size + n > self.bucket_bytes:
                    write_shard(items[start:i], os.path.join(staging, f"model-pp00-{shards:05d}.safetensors"))
                    start, size, shards = i, 0, shards + 1
                size += n
            write_shard(items[start:], os.path.join(staging, f"model-pp00-{shards:05d}.safetensors"))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return self.publish(staging, weight_version, config_updates)

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
        await self.client.update_weights_from_disk(path, str(weight_version), load_format=self.load_format,
                                                   flush_cache=True, timeout_s=self.request_timeout_s)
        self.prune(keep=path)
        return path

    def push(self, state_dict: Mapping[str, torch.Tensor], weight_version: Any,
             config_updates: Optional[Mapping[str, Any]] = None) -> str:
        """Blocking `push_async`."""
        return run_sync(self.push_async(state_dict, weight_version, config_updates))
