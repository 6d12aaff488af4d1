"""Colocated tensor sync: which learner rank feeds which TP rank of which engine, decided once at start-up.

A colocated SGLang engine sees only its own GPUs (rollout/sglang_launcher.py sets CUDA_VISIBLE_DEVICES),
and it opens a CUDA-IPC handle only when the handle's device UUID is one of them: SGLang's
`_device_from_maybe_uuid` (srt/utils/patch_torch.py) raises "Invalid device_uuid=..." otherwise, in
`deserialize_own_rank` (managers/tp_worker.py), uncaught, and the scheduler exits. So each engine
receives tensors that live on its own GPUs, as slime's colocated `update_weight_from_tensor` sends
them (slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py: every learner rank
holds the full tensors, the ranks on an engine's GPUs gather their handles, the first posts them):
engine TP rank r gets the payload of the learner rank on the engine's r-th device.

Devices are named as the engines see them: a CUDA device by its UUID (what SGLang's patched
reductions write); on CPU by `cpu:<index>`, the stand-in an embedded engine is given as
--visible-devices (engine/tensor_payload.py refuses another device's payload with SGLang's text).
A learner rank's device is its CUDA device (torchrun's LOCAL_RANK), on CPU index LOCAL_RANK.
Engine e's device indices are the ones the launchers give it when colocated: rollout.engine_gpus
split in order (engine=sglang), else [e*k, (e+1)*k) with k = engine_tp_size * engine_dp_size
(sglang_launcher.engine_gpu_groups; embedded engines have one device each). Engine e is the e-th
weight-sync target: engines this run starts are listed in start order; external ones in
rollout.weight_update_urls order (a router's worker list has no order, so several colocated
external engines must be listed there).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class EngineFeed:
    """One learner rank's part of a colocated tensor sync: its own device's tensors to TP rank `tp_rank` of `url`."""

    url: str
    """The engine."""
    tp_rank: int
    """The engine TP rank whose payload this rank builds."""
    devices: tuple[str, ...]
    """The engine's devices by engine TP rank (the only devices its payloads may name)."""
    feeders: tuple[int, ...]
    """Global learner ranks building the payloads of TP ranks 0..k-1 (the first posts the request)."""

    @property
    def device(self) -> str:
        """The device this rank's payload names (its own)."""
        return self.devices[self.tp_rank]

    @property
    def poster(self) -> bool:
        """Whether this rank posts the engine's request (it feeds TP rank 0)."""
        return self.tp_rank == 0


def device_identity(index: int) -> str:
    """The name of device `index` (as this process numbers them) that engines see: its CUDA UUID, else `cpu:<index>`."""
    import torch

    if torch.cuda.is_available():
        from megatron_rl.rollout.sync.serialization import device_uuid

        return device_uuid(index)
    return f"cpu:{index}"


def own_device_index() -> int:
    """This learner rank's device index: its CUDA device, on CPU torchrun's LOCAL_RANK (0 outside torchrun)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.current_device()
    return int(os.environ.get("LOCAL_RANK", "0"))


def engine_device_groups(rollout) -> list[list[int]]:
    """Device indices of each colocated engine, in engine order, as the launchers assign them (module docstring)."""
    k = rollout.engine_tp_size * rollout.engine_dp_size
    if rollout.engine == "sglang" and rollout.engine_gpus:
        gpus = list(rollout.engine_gpus)
        return [gpus[e * k:(e + 1) * k] for e in range(rollout.num_engines)]
    return [list(range(e * k, (e + 1) * k)) for e in range(rollout.num_engines)]


def colocated_engines(rollout, urls: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """(url, device names by engine TP rank) of each colocated engine; ValueError naming the fields when `urls`
    (the weight-sync targets, in engine order) are not rollout.num_engines engines."""
    urls = [u.rstrip("/") for u in urls]
    if len(urls) != rollout.num_engines:
        raise ValueError(f"rollout.placement=colocated: {len(urls)} engine(s) receive weights ({', '.join(urls)}) but "
                         f"rollout.num_engines={rollout.num_engines}; each engine is fed by the learner ranks on its own "
                         "devices, so the count must match (list the engines in rollout.weight_update_urls, in the "
                         "order they were started)")
    groups = engine_device_groups(rollout)
    return [(url, tuple(device_identity(i) for i in group)) for url, group in zip(urls, groups)]


def assign_feeds(engines: Sequence[tuple[str, Sequence[str]]], rank_devices: Sequence[str]) -> dict[int, EngineFeed]:
    """Global learner rank -> its EngineFeed, for `engines` [(url, devices by TP rank)] and each rank's device name.

    ValueError when an engine device is no learner rank's (its handles could come from nowhere it can open) or
    when two ranks or two engines claim one device.
    """
    owner: dict[str, int] = {}
    for rank, device in enumerate(rank_devices):
        if device in owner:
            raise ValueError(f"learner ranks {owner[device]} and {rank} both run on device {device}")
        owner[device] = rank
    feeds: dict[int, EngineFeed] = {}
    claimed: dict[str, str] = {}
    for url, devices in engines:
        devices = tuple(devices)
        for device in devices:
            if device in claimed:
                raise ValueError(f"engines {claimed[device]} and {url} both list device {device}")
            claimed[device] = url
            if device not in owner:
                raise ValueError(
                    f"rollout.placement=colocated: engine {url} runs on device {device}, where no learner rank runs "
                    f"(learner devices: {list(owner)}); a colocated engine receives CUDA-IPC handles only from the "
                    "learner ranks on its own GPUs, so every engine GPU must be a learner GPU (check rollout.num_engines, "
                    "engine_tp_size and engine_gpus against the learner's GPUs on this node)")
        feeders = tuple(owner[d] for d in devices)
        for r, rank in enumerate(feeders):
            feeds[rank] = EngineFeed(url, r, devices, feeders)
    return feeds
