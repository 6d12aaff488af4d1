"""Weight-sync transports from learner to rollout engines, by name (one module per transport)."""
from __future__ import annotations

from megatron_rl.rollout.sync.disk import DiskWeightSync

TRANSPORTS: dict[str, type] = {"disk": DiskWeightSync}


def get_transport(name: str) -> type:
    """The transport class registered as `name`."""
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"rollout.weight_sync={name!r} is not available; registered transports: {sorted(TRANSPORTS)}") from None
