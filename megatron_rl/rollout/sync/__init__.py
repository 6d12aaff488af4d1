"""Weight-sync transports from learner to rollout engines, by name (one module per transport; see base.py)."""
from __future__ import annotations

from typing import Sequence

from megatron_rl.rollout.sync.base import WeightTransport
from megatron_rl.rollout.sync.disk import DiskWeightSync
from megatron_rl.rollout.sync.distributed import DistributedWeightSync
from megatron_rl.rollout.sync.tensor import TensorWeightSync

TRANSPORTS: dict[str, type] = {"disk": DiskWeightSync, "distributed": DistributedWeightSync, "tensor": TensorWeightSync}


def get_transport(name: str) -> type:
    """The transport class registered as `name`."""
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"rollout.weight_sync.transport={name!r} is not available; registered transports: "
                         f"{sorted(TRANSPORTS)}") from None


def build_transport(cfg, receiver_urls: Sequence[str], hf_config_dir: str, default_sync_dir: str,
                    client=None, api_key=None) -> WeightTransport:
    """The transport a `WeightSyncConfig` describes, sending to `receiver_urls` (engines, never a router)."""
    cls = get_transport(cfg.transport)
    common = dict(bucket_mb=cfg.bucket_mb, pause_mode=cfg.pause_mode, client=client, api_key=api_key)
    if cls is DiskWeightSync:
        return DiskWeightSync(cfg.sync_dir or default_sync_dir, hf_config_dir, receiver_urls, keep_last=cfg.keep_last,
                              request_timeout_s=cfg.timeout_s, **common)
    if cls is DistributedWeightSync:
        return DistributedWeightSync(receiver_urls, timeout_s=cfg.timeout_s, master_address=cfg.master_address,
                                     master_port=cfg.master_port, group_name=cfg.group_name, **common)
    return cls(receiver_urls, timeout_s=cfg.timeout_s, **common)


__all__ = ["TRANSPORTS", "WeightTransport", "DiskWeightSync", "DistributedWeightSync", "TensorWeightSync",
           "get_transport", "build_transport"]
