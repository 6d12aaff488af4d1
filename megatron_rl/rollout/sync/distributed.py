"""Distributed weight sync: SGLang's /init_weights_update_group + /update_weights_from_distributed protocol.

Each pipeline stage's sender (TP/DP/CP rank 0 of the stage) owns one weight-update group with
every engine and is rank 0 of it, so it is the broadcast source SGLang's receiver expects:

    group "<group_name>" (PP = 1) or "<group_name>_pp<k>" (stage k of PP > 1), world = 1 + sum(engine TP sizes)
        rank 0                       the stage-k sender (hosts the rendezvous store at master_address:port)
        rank 1 + o_i + t             TP rank t of engine i, o_i = sum of the TP sizes of engines before i
    port: rollout.weight_sync.master_port + k, or (master_port 0) a port the sender's own listening socket was
          bound to by the OS, handed to the rendezvous store (no probe, so no other process can take it first)

Engines therefore join one group per stage (as slime does) and rank offsets never collide: a group
holds exactly one sender. Per bucket the sender POSTs {names, dtypes, shapes, group_name,
flush_cache, weight_version} to every engine and, while those requests are in flight, broadcasts
each tensor in `names` order from rank 0 (NCCL for a GPU learner and GPU engines; gloo when either
side is on CPU, host copies of the bucket then, and float8 travels as its uint8 bytes). Stages send one after another, so no engine waits on one stage while another
stage's broadcast waits on it. Groups are joined on the first sync and kept; `close()` sends
/destroy_weights_update_group.

The address a sender advertises (`sender_address`, resolved on the sender's own host when its transport
is built, so before any sync): each stage's sender may run on another node (PP = 2 across nodes), so each
one picks its own. `rollout.weight_sync.master_address` is used only by a sender on the host that owns
that address (it resolves to one of this host's interfaces); a sender elsewhere advertises its own
default: 127.0.0.1 when every engine is on this host, else the address of the interface that routes to
the first remote engine (a UDP socket `connect()` selects it, no packet is sent; SGLang's
`get_local_ip_by_remote`, python/sglang/srt/utils/network.py, finds its own address the same way), or the
host name's address when there is no route. A loopback address (127.0.1.1 is what Debian-style hosts files
give a host's own name) while an engine is on another host is refused with an error naming the field:
that engine could never reach it and the sync would only wait out its timeout.
"""
from __future__ import annotations

import ipaddress
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Optional, Sequence
from urllib.parse import urlparse

import torch

from megatron_rl.parallel import weight_group
from megatron_rl.rollout.client import RolloutClient, RolloutServerError, run_sync
from megatron_rl.rollout.sync.base import Bucket, WeightTransport, dtype_str


MASTER_ADDRESS_FIELD = "rollout.weight_sync.master_address"


class HostNetwork:
    """What this host can tell about addresses (the facts `sender_address` decides on; tests inject another host's)."""

    def resolve(self, host: str) -> str:
        """The IP address `host` names here (OSError when it does not resolve)."""
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]

    def is_local(self, address: str) -> bool:
        """Whether `address` belongs to an interface of this host (a socket can bind to it)."""
        try:
            with socket.socket(_family(address), socket.SOCK_STREAM) as s:
                s.bind((address, 0))
            return True
        except OSError:
            return False

    def route_source(self, address: str, port: int) -> Optional[str]:
        """This host's address on the route to `address` (None without a route); connecting a UDP socket sends nothing."""
        try:
            with socket.socket(_family(address), socket.SOCK_DGRAM) as s:
                s.connect((address, port))
                return s.getsockname()[0]
        except OSError:
            return None

    def hostname_address(self) -> str:
        """This host's name as it resolves here (127.0.1.1 with a Debian-style hosts file)."""
        return socket.gethostbyname(socket.gethostname())


def _family(address: str) -> int:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def is_loopback(address: str) -> bool:
    """Whether an IP address only reaches this host (127.0.0.0/8, ::1; 0.0.0.0 and :: connect locally too)."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def sender_address(receiver_urls: Sequence[str], master_address: Optional[str] = None,
                   net: Optional[HostNetwork] = None) -> str:
    """The address this host's stage sender advertises to the engines `receiver_urls` (see the module docstring).

    ConfigError naming rollout.weight_sync.master_address when it would be a loopback address while an
    engine is on another host, or when master_address does not resolve here.
    """
    from megatron_rl.config.run import ConfigError

    net = net or HostNetwork()
    remote: list[tuple[str, str, int]] = []  # (url, ip, port) of the engines on other hosts
    for url in receiver_urls:
        parsed = urlparse(url)
        try:
            ip = net.resolve(parsed.hostname or "")
        except OSError as exc:
            raise ValueError(f"weight sync: engine {url}: its host does not resolve here ({exc})") from None
        if not (is_loopback(ip) or net.is_local(ip)):
            remote.append((url, ip, parsed.port or (443 if parsed.scheme == "https" else 80)))
    chosen = None
    if master_address:
        try:
            ip = net.resolve(master_address)
        except OSError as exc:
            raise ConfigError(f"{MASTER_ADDRESS_FIELD}={master_address!r} does not resolve on this host ({exc})") from None
        if is_loopback(ip) or net.is_local(ip):
            chosen = (master_address, ip)
        # else it is another stage's host: this sender advertises its own address below
    if chosen is None:
        if not remote:
            chosen = ("127.0.0.1", "127.0.0.1")
        else:
            address = net.route_source(remote[0][1], remote[0][2])
            if address is None:
                try:
                    address = net.hostname_address()
                except OSError:
                    address = "127.0.0.1"
            chosen = (address, address)
    if remote and is_loopback(chosen[1]):
        how = (f"{MASTER_ADDRESS_FIELD}={master_address}" if chosen[0] == master_address
               else f"there is no route to that engine here and this host's name gives {chosen[1]}")
        raise ConfigError(f"{MASTER_ADDRESS_FIELD}: the weight-update group would be advertised at the loopback "
                          f"address {chosen[1]} ({how}), which engine {remote[0][0]} on another host cannot reach; "
                          f"set {MASTER_ADDRESS_FIELD} to this host's address on the engines' network")
    return chosen[0]


def init_group_body(master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
                    backend: str) -> dict:
    """The /init_weights_update_group body (InitWeightsUpdateGroupReqInput) of one engine."""
    return {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}


def update_distributed_body(bucket: Bucket, group_name: str, final: bool, weight_version: Any) -> dict:
    """The /update_weights_from_distributed body (UpdateWeightsFromDistributedReqInput) of one bucket; only the
    model's last bucket (`final`) flushes the cache and names the version."""
    body = {"names": [n for n, _ in bucket], "dtypes": [dtype_str(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket], "group_name": group_name,
            "flush_cache": final, "abort_all_requests": False}
    if final:
        body["weight_version"] = str(weight_version)
    return body


def destroy_group_body(group_name: str) -> dict:
    """The /destroy_weights_update_group body (DestroyWeightsUpdateGroupReqInput)."""
    return {"group_name": group_name}


class DistributedWeightSync(WeightTransport):
    """Transport 'distributed' (see module docstring)."""

    name = "distributed"
    needs_session = True

    def __init__(self, receiver_urls: Sequence[str], bucket_mb: float = 512.0, timeout_s: float = 300.0,
                 master_address: Optional[str] = None, master_port: int = 0,
                 group_name: str = weight_group.DEFAULT_GROUP_NAME, pause_mode: str = "abort",
                 client: Optional[RolloutClient] = None, api_key: Optional[str] = None) -> None:
        """`receiver_urls` are the engines (never a router)."""
        super().__init__(receiver_urls, bucket_mb, timeout_s, pause_mode, client, api_key)
        self.configured_address = master_address
        self.master_address = sender_address(self.urls, master_address)
        self.master_port = master_port
        self.base_group_name = group_name
        self.group = None
        self.group_name = ""
        self.backend = ""
        self._http = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-http")
        self._first_bucket = True

    def _post(self, path: str, body: dict) -> Future:
        """POST to every engine from a helper thread (the caller broadcasts meanwhile)."""
        return self._http.submit(run_sync, self.client.call_all(path, body, self.timeout_s))

    def connect(self, stage: int, num_stages: int, backend: str) -> None:
        """Join this stage's group with every engine (they POST-join while this rank hosts the rendezvous)."""
        if self.group is not None:
            return
        tp_sizes = self.engine_tp_sizes()
        world_size = 1 + sum(tp_sizes)
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
        if self.master_port and self.master_port + stage > 65535:
            raise ValueError(f"rollout.weight_sync.master_port={self.master_port} + pipeline stage {stage} is not a TCP port")
        # master_port 0: the store is served on a socket bound before any engine hears of its port, so no other
        # process can take the port between a probe and the store's bind (the race a probed free port had)
        sock = None if self.master_port else weight_group.listening_socket()
        port = self.master_port + stage if sock is None else sock.getsockname()[1]
        name = self.base_group_name if num_stages == 1 else f"{self.base_group_name}_pp{stage}"
        futures = [self._init_all(port, offsets, world_size, name, backend)]
        try:
            group = weight_group.init_weight_update_group(backend, self.master_address, port, 0, world_size, name,
                                                          self.timeout_s, listen_sock=sock)
        except Exception as exc:
            detail = _first_error(futures)
            hint = (f" (port {port} is taken on this host: rollout.weight_sync.master_port={self.master_port} + stage "
                    f"{stage}; choose other ports or 0)" if sock is None and "EADDRINUSE" in str(exc) else "")
            raise RolloutServerError(f"weight sync: could not form group {name!r} at {self.master_address}:{port} with "
                                     f"{len(self.urls)} engine(s) within {self.timeout_s:g} s: {exc}{hint}"
                                     + (f"; engine said: {detail}" if detail else "")) from None
        finally:
            if sock is not None and sock.fileno() != -1:
                sock.close()  # not handed over (the call failed before the store took it)
        try:
            for f in futures:
                f.result()
        except Exception:
            weight_group.destroy_weight_update_group(group)
            raise
        self.group, self.group_name, self.backend = group, name, backend

    def _init_all(self, port: int, offsets: list[int], world_size: int, name: str, backend: str) -> Future:
        """One request per engine (each has its own rank_offset), all concurrently."""
        import asyncio

        async def all_engines() -> None:
            await asyncio.gather(*(self.engine_client(url).call_all(
                "/init_weights_update_group", init_group_body(self.master_address, port, offset, world_size, name, backend),
                self.timeout_s) for url, offset in zip(self.urls, offsets)))

        return self._http.submit(run_sync, all_engines())

    def begin_stage(self, stage: int, num_stages: int, weight_version: Any) -> None:
        """As the base class; the stage's first bucket also watches for an engine that refuses at once."""
        super().begin_stage(stage, num_stages, weight_version)
        self._first_bucket = True

    def send_bucket(self, bucket: Bucket, final: bool) -> None:
        """POST the bucket's metadata to every engine and broadcast its tensors in the same order."""
        if bucket[0][1].device.type == "cuda" and self.any_cpu_engine():
            bucket = [(n, t.cpu()) for n, t in bucket]  # CPU engines only speak gloo
        self.connect(self.stage, self.num_stages, "nccl" if bucket[0][1].device.type == "cuda" else "gloo")
        body = update_distributed_body(bucket, self.group_name, final, self.weight_version)
        pending = self._post("/update_weights_from_distributed", body)
        if self._first_bucket:
            # an engine that accepts the update waits in the broadcast; one that refuses (no session, a version
            # mismatch) answers at once and never joins it, so the broadcast would block until timeout_s. The first
            # bucket of a stage pays a short wait to turn that into an immediate error.
            self._first_bucket = False
            refused = _first_error([pending], wait_s=REFUSAL_WAIT_S)
            if refused is not None:
                self._leave()
                raise RolloutServerError(f"weight sync: an engine refused the update on {self.group_name!r} before "
                                         f"the broadcast: {refused}")
        wire = [t.contiguous() for _, t in bucket]
        if self.backend == "gloo":
            wire = [t.view(torch.uint8) if t.element_size() == 1 and t.dtype.is_floating_point else t for t in wire]
        try:
            weight_group.broadcast_from_rank0(wire, self.group)
        except Exception as exc:
            detail = _first_error([pending])
            self._leave()  # engines drop their side too, or the next sync could not form a group of that name
            raise RolloutServerError(f"weight sync: broadcast on {self.group_name!r} failed: {type(exc).__name__}: "
                                     f"{str(exc)[:300]}" + (f"; engine said: {detail}" if detail else "")) from None
        pending.result()

    def set_worker_urls(self, urls: Sequence[str]) -> None:
        """New targets: leave the current group (its members changed), join a new one at the next bucket."""
        self._leave()
        super().set_worker_urls(urls)
        self.master_address = sender_address(self.urls, self.configured_address)

    def _leave(self) -> None:
        """Live engines leave the group, then this rank destroys it."""
        if self.group is not None:
            try:
                run_sync(self.client.call_all("/destroy_weights_update_group", destroy_group_body(self.group_name),
                                              self.timeout_s))
            except RolloutServerError:
                pass  # an engine that is gone left with it
            self._drop_group()

    def _drop_group(self) -> None:
        try:
            weight_group.destroy_weight_update_group(self.group)
        except Exception:  # a broken group may fail to tear down; the next sync joins a fresh one
            pass
        self.group = None

    def close(self) -> None:
        """Engines leave the group, then this rank destroys it."""
        self._leave()
        self._http.shutdown(wait=False)


REFUSAL_WAIT_S = 0.2
"""How long the first bucket of a stage waits for an engine's immediate refusal before broadcasting."""


def _first_error(futures: list[Future], wait_s: float = 5.0) -> Optional[str]:
    """The first exception message among `futures` that finished (waiting briefly for them)."""
    for f in futures:
        try:
            f.result(timeout=wait_s)
        except FutureTimeout:
            continue  # still waiting (an engine in the broadcast): not an error
        except Exception as exc:  # noqa: BLE001 - reported as text
            return str(exc) or type(exc).__name__
    return None
