"""Weight-update process groups between a trainer and rollout engines, as SGLang builds them.

SGLang's `/init_weights_update_group` joins a group created by `init_custom_process_group`: a
TCPStore at `master_address:master_port` (the trainer, rank 0, hosts it; `tcp://` rendezvous),
a `PrefixStore(group_name)` over it, then torch's `_new_process_group_helper` with that group
name. The store keys therefore depend on the exact construction, so both sides here build the
group the same way: a trainer script written for SGLang (or SGLang's own helper) rendezvous with
an embedded engine and vice versa. torch has no public API for a second, independent "world"
(`new_group` needs every rank of the default group), which is why this module uses the same
private torch entry points SGLang, slime, verl and OpenRLHF use; `check_private_api` fails loudly
if a torch upgrade removes them.

Used by the trainer's `distributed` weight-sync transport and by the embedded engine's receiver
(this module is the one place outside the learner that creates process groups).
"""
from __future__ import annotations

import inspect
import socket
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

DEFAULT_GROUP_NAME = "weight_update_group"
"""SGLang's default `group_name` of a weight-update group."""


def check_private_api() -> None:
    """Raise RuntimeError naming what is missing when torch no longer has the entry points used here."""
    from torch.distributed import distributed_c10d as c10d

    missing = [n for n in ("PrefixStore", "_new_process_group_helper", "_world", "Backend") if not hasattr(c10d, n)]
    if missing:
        raise RuntimeError(f"torch {torch.__version__} lacks torch.distributed.distributed_c10d.{missing}: "
                           "weight-update groups cannot be created as SGLang creates them")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port unused on `host` a moment ago (another process may take it before it is bound: for tests that
    hand a port to a trainer script; a sender hosts its group on `listening_socket` instead)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listening_socket() -> socket.socket:
    """A TCP socket listening on every interface (IPv4, and IPv6 where the host has both) at a port the OS picked
    as it bound it: rank 0 hands it to its rendezvous store (`init_weight_update_group(listen_sock=...)`), so the
    port it tells the other ranks is held from the start and no other process can take it in between."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", 0))


def init_weight_update_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str = DEFAULT_GROUP_NAME, timeout_s: float = 300.0,
                             listen_sock: Optional[socket.socket] = None) -> dist.ProcessGroup:
    """Join (rank 0: host) the group `group_name` of `world_size` ranks; blocks until every rank joined.

    `timeout_s` bounds the rendezvous and every later collective of the group (a broadcast that
    never comes raises after it instead of hanging). Rank 0 given `listen_sock` (`listening_socket()`, bound to
    `master_port`) serves the store on that socket, which this call takes over (TCPStore's `master_listen_fd`);
    without it the store binds `master_port` itself.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    check_private_api()
    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a weight-update group of world_size {world_size} (needs >= 2)")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r} must be 'gloo' or 'nccl'")
    if group_name in _world.pg_names.values():
        raise ValueError(f"a process group named {group_name!r} already exists in this process")
    if listen_sock is not None and (rank != 0 or listen_sock.getsockname()[1] != int(master_port)):
        raise ValueError(f"listen_sock is rank 0's socket bound to master_port {master_port} "
                         f"(got rank {rank}, port {listen_sock.getsockname()[1]})")
    timeout = timedelta(seconds=float(timeout_s))
    # What rendezvous("tcp://...") builds outside torchrun, stated directly: under torchrun (the
    # learner) rendezvous would only connect to the elastic agent's store instead of hosting ours. The
    # store (server and rank 0's own client) owns the handed-over descriptor from here on.
    listen_fd = listen_sock.detach() if listen_sock is not None else None
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout,
                          multi_tenant=True, master_listen_fd=listen_fd)
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters else "pg_options"
    try:
        pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                          timeout=timeout, **{options: None})
    except BaseException:
        _forget_group_name(group_name)
        raise
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_weight_update_group(pg: Optional[dist.ProcessGroup]) -> None:
    """Tear down a group made by `init_weight_update_group` (no-op for None)."""
    if pg is not None:
        dist.destroy_process_group(pg)


def broadcast_from_rank0(tensors: list[torch.Tensor], pg: dist.ProcessGroup) -> None:
    """Broadcast each tensor in order from group rank 0 (SGLang's receiver posts one broadcast per name)."""
    works = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors]
    for w in works:
        w.wait()


def _forget_group_name(group_name: str) -> None:
    """Drop a half-built group registered under `group_name`, so the name can be used again."""
    from torch.distributed.distributed_c10d import _world

    for pg, name in list(_world.pg_names.items()):
        if name == group_name:
            try:
                dist.destroy_process_group(pg)
            except Exception:  # it never finished building; removing the name is what matters
                _world.pg_names.pop(pg, None)


