"""Read the model weights of a megatron_rl distributed checkpoint (torch_dist) as full tensors, without a model.

Works for a checkpoint saved under any TP/PP/VPP/DP/CP layout, in one process: megatron stores
each tensor in global coordinates (ShardedTensors), with the per-layer tensors stacked on a global
layer axis (`decoder.layers.<suffix>` of shape [num_layers, ...]). `iter_full_tensors` asks
megatron's `dist_checkpointing.load` for one checkpoint key at a time, so memory holds the largest
key (e.g. Qwen3-32B's linear_fc1 over 64 layers: 33.5 GB in bf16), never the whole model. (Loading
one layer's slice would need other ranks to own the rest: megatron's torch_dist loader assumes a
regular grid of shards over the world, which a single process cannot describe.)
Names come back megatron-style and un-stacked (`decoder.layers.<i>.<suffix>`), in whichever norm
naming the saving spec used (local `input_layernorm` or TE's fused `linear_qkv.layer_norm_weight`);
models/hf_mapping.py reads both. Optimizer state and `_extra_state` objects are skipped.

    arch = checkpoint_architecture("runs/x/checkpoints")
    for name, tensor in iter_full_tensors("runs/x/checkpoints"): ...
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator

import torch

from megatron_rl.models.presets import Architecture

MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
"""ShardedTensor keys of model weights (everything else is optimizer state)."""
_STACKED = "decoder.layers."


def resolve_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint directory: `path` itself, or the newest complete one under a checkpoint root."""
    from megatron_rl.trainer.checkpoint import COMPLETE_MARKER, latest_checkpoint

    p = Path(path)
    if (p / COMPLETE_MARKER).is_file():
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise FileNotFoundError(f"no complete megatron_rl checkpoint at {p} (a step_<N> directory with a "
                                f"{COMPLETE_MARKER} marker, or a root holding one)")
    return Path(latest)


def checkpoint_architecture(path: str | Path) -> Architecture:
    """The Architecture recorded in the checkpoint's meta.json."""
    from megatron_rl.trainer.checkpoint import checkpoint_meta

    ckpt = resolve_checkpoint(path)
    recorded: dict[str, Any] = checkpoint_meta(ckpt).get("arch") or {}
    names = {f.name for f in dataclasses.fields(Architecture)}
    missing = [f.name for f in dataclasses.fields(Architecture)
               if f.default is dataclasses.MISSING and f.name not in recorded]
    if missing:
        raise ValueError(f"{ckpt}/meta.json records no architecture fields {missing}")
    return Architecture(**{k: v for k, v in recorded.items() if k in names})


def _ensure_process_group() -> None:
    """megatron's loader asks torch.distributed for its rank: give a plain process a world of one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    from megatron_rl.config.model import ParallelConfig
    from megatron_rl.parallel import state

    state.init_distributed(ParallelConfig(backend="gloo"))


def tensor_metadata(path: str | Path) -> dict[str, Any]:
    """{key: ShardedTensor metadata (global shape, dtype)} of the model weights in the checkpoint."""
    from megatron.core import dist_checkpointing

    ckpt = resolve_checkpoint(path)
    _ensure_process_group()
    meta = dist_checkpointing.load_tensors_metadata(str(ckpt / "dist"))
    return {k: v for k, v in meta.items() if k.startswith(MODEL_PREFIXES) and hasattr(v, "global_shape")}


def _load(keys_to_tensors: dict[str, Any], dist_dir: str) -> dict[str, torch.Tensor]:
    """megatron dist_checkpointing.load of the given ShardedTensors (no access-integrity check: one reader)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(keys_to_tensors, dist_dir, validate_access_integrity=False)


def iter_full_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(megatron name, full tensor) of every model weight, one checkpoint key (all its layers) in memory at a time."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    ckpt = resolve_checkpoint(path)
    dist_dir = str(ckpt / "dist")
    for key, md in sorted(tensor_metadata(ckpt).items()):
        request = {key: ShardedTensor.from_rank_offsets(key, torch.empty(tuple(md.global_shape), dtype=md.dtype))}
        tensor = _load(request, dist_dir)[key]
        if not key.startswith(_STACKED):
            yield key, tensor
            continue
        suffix = key[len(_STACKED):]
        for i in range(tensor.shape[0]):
            yield f"{_STACKED}{i}.{suffix}", tensor[i].clone()
        del tensor


def layer_of(name: str) -> int:
    """Layer index of a `decoder.layers.<i>.` name, -1 for other tensors."""
    if not name.startswith(_STACKED):
        return -1
    return int(name[len(_STACKED):].split(".", 1)[0])
