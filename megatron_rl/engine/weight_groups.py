"""The embedded engine's weight-update process groups (SGLang's /init_weights_update_group and friends).

The engine joins a trainer's group as rank `rank_offset` (rank 0 is the trainer, which hosts the
rendezvous) and receives each tensor of an update as one broadcast from rank 0, as SGLang's TP
workers do. A broadcast that does not arrive within the group timeout destroys the group and fails
the request; a receive for a well-formed request always consumes every tensor, so the group stays
in step.

An SGLang engine with TP size T takes ranks rank_offset .. rank_offset + T - 1, one per TP worker
process. torch registers a process group under one name per process and keys the rendezvous by that
name, so one process cannot take several ranks of a group: an embedded engine started with
`--tp-size T > 1` (which emulates T ranks for tensor updates) refuses to join one.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from megatron_rl.engine.weight_receiver import WeightUpdateError


@dataclass
class _Group:
    """One joined weight-update group."""

    pg: Any
    """The torch ProcessGroup."""
    rank: int
    """This engine's rank in it."""
    world_size: int
    """Ranks in the group."""
    backend: str
    """gloo or nccl."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Serialises receives (broadcasts must be consumed in request order)."""


class WeightGroups:
    """The engine's weight-update groups by name (thread-safe; blocking calls run off the event loop)."""

    def __init__(self, timeout_s: float = 120.0, device: str = "cpu", tp_size: int = 1) -> None:
        """`timeout_s` bounds each rendezvous and broadcast; `tp_size` is the TP size the engine declares."""
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        if tp_size < 1:
            raise ValueError("tp_size must be >= 1")
        self.timeout_s = float(timeout_s)
        self.device = device
        self.tp_size = tp_size
        self._groups: dict[str, _Group] = {}
        self._pending: set[str] = set()
        self._lock = threading.Lock()

    def init(self, master_address: Any, master_port: Any, rank_offset: Any, world_size: Any,
             group_name: Any, backend: Any) -> str:
        """Join a group as rank `rank_offset` (blocks until every rank joined); returns SGLang's success message."""
        from megatron_rl.parallel.weight_group import init_weight_update_group

        if not isinstance(master_address, str) or not master_address:
            raise WeightUpdateError("init_weights_update_group: master_address (string) is required")
        for key, value in (("master_port", master_port), ("rank_offset", rank_offset), ("world_size", world_size)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise WeightUpdateError(f"init_weights_update_group: {key} must be an integer, got {value!r}")
        if not 1 <= master_port <= 65535:
            raise WeightUpdateError(f"init_weights_update_group: master_port={master_port} is not a TCP port")
        if rank_offset < 1 or rank_offset + self.tp_size > world_size:
            raise WeightUpdateError(f"init_weights_update_group: rank_offset={rank_offset} with this engine's "
                                    f"{self.tp_size} rank(s) does not fit world_size={world_size} (rank 0 is the trainer)")
        if not isinstance(group_name, str) or not group_name:
            raise WeightUpdateError("init_weights_update_group: group_name must be a non-empty string")
        if backend not in ("gloo", "nccl"):
            raise WeightUpdateError(f"init_weights_update_group: backend={backend!r} must be 'gloo' or 'nccl'")
        if self.tp_size > 1:
            raise WeightUpdateError(f"init_weights_update_group: this embedded engine emulates {self.tp_size} TP ranks "
                                    "for tensor updates only; one process cannot join a weight-update group as several "
                                    "ranks (start it with --tp-size 1 for distributed updates)")
        if backend == "nccl" and self.device == "cpu":
            raise WeightUpdateError("init_weights_update_group: backend=nccl needs a CUDA engine; this engine runs on "
                                    "CPU, use backend=gloo")
        with self._lock:
            if group_name in self._groups or group_name in self._pending:
                raise WeightUpdateError(f"init_weights_update_group: group {group_name!r} already exists "
                                        "(POST /destroy_weights_update_group first)")
            self._pending.add(group_name)
        try:
            pg = init_weight_update_group(backend, master_address, master_port, rank_offset, world_size, group_name,
                                          self.timeout_s)
        except Exception as exc:
            raise WeightUpdateError(f"init_weights_update_group: joining {group_name!r} at {master_address}:{master_port} "
                                    f"as rank {rank_offset} of {world_size} failed within {self.timeout_s:g} s: "
                                    f"{type(exc).__name__}: {exc}") from None
        finally:
            with self._lock:
                self._pending.discard(group_name)
        with self._lock:
            self._groups[group_name] = _Group(pg, rank_offset, world_size, backend)
        return "Succeeded to initialize custom process group."

    def destroy(self, group_name: Any) -> str:
        """Leave and destroy a group (waits for a receive in progress)."""
        with self._lock:
            group = self._groups.pop(group_name, None) if isinstance(group_name, str) else None
        if group is None:
            raise WeightUpdateError(f"destroy_weights_update_group: no group named {group_name!r}")
        with group.lock:
            _destroy(group)
        return "Succeeded to destroy custom process group."

    def get(self, group_name: Any) -> _Group:
        """The group or a WeightUpdateError naming it."""
        with self._lock:
            group = self._groups.get(group_name) if isinstance(group_name, str) else None
            known = sorted(self._groups)
        if group is None:
            raise WeightUpdateError(f"no weight-update group named {group_name!r} (known: {known}); "
                                    "POST /init_weights_update_group first")
        return group

    def receive(self, group_name: str, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                load_format: Optional[str]) -> list[tuple[str, torch.Tensor]]:
        """Receive one broadcast per entry from group rank 0 (or one flat uint8 buffer for flattened_bucket)."""
        group = self.get(group_name)
        with group.lock:
            try:
                return _receive(group.pg, group.backend, entries, load_format, self.device)
            except Exception as exc:
                with self._lock:
                    self._groups.pop(group_name, None)
                _destroy(group)
                raise WeightUpdateError(
                    f"update_weights_from_distributed: the broadcast of {len(entries)} tensors on {group_name!r} did not "
                    f"complete within {self.timeout_s:g} s ({type(exc).__name__}: {str(exc)[:300]}); the group is destroyed "
                    "and the served weights are unchanged") from None

    def close(self) -> None:
        """Destroy every group (server shutdown)."""
        for name in list(self._groups):
            try:
                self.destroy(name)
            except WeightUpdateError:
                pass


def _receive(pg, backend: str, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                 load_format: Optional[str], device: str) -> list[tuple[str, torch.Tensor]]:
    """A request's broadcasts, received into fresh buffers."""
    from megatron_rl.parallel.weight_group import broadcast_from_rank0

    staged = [(n, torch.empty(shape, dtype=dt, device=device)) for n, dt, shape in entries]
    if load_format == "flattened_bucket":
        flat = torch.empty(sum(t.numel() * t.element_size() for _, t in staged), dtype=torch.uint8, device=device)
        wire = [flat]
    else:
        wire = [t for _, t in staged]
    if backend == "gloo":  # gloo has no float8 kernels: the same bytes travel as uint8
        wire = [t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype != torch.uint8 else t for t in wire]
    broadcast_from_rank0(wire, pg)
    if load_format == "flattened_bucket":
        offset = 0
        for i, (n, t) in enumerate(staged):
            size = t.numel() * t.element_size()
            staged[i] = (n, flat[offset:offset + size].view(t.dtype).reshape(t.shape))
            offset += size
    return staged


def _destroy(group: _Group) -> None:
    """Tear down a group's process group (a broken one may fail to; it is dropped either way)."""
    from megatron_rl.parallel.weight_group import destroy_weight_update_group

    try:
        destroy_weight_update_group(group.pg)
    except Exception:  # noqa: BLE001
        pass
