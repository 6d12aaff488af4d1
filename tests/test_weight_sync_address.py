"""Where a `distributed` weight-sync sender advertises its update group.

Each pipeline stage's sender resolves its own address on its own host (rollout/sync/distributed.py:
sender_address): rollout.weight_sync.master_address only where it is an address of that host, else the address
of the interface routing to the engines; a loopback address while an engine is on another host is an error
naming the field, before any sync. The host facts are injected (`HostNetwork`), so two hosts of one cluster
are simulated here; the last tests use this machine's real network.

Run: pytest -q tests/test_weight_sync_address.py
"""
from __future__ import annotations

import socket

import pytest

from megatron_rl.config import load_config
from megatron_rl.config.run import ConfigError
from megatron_rl.rollout.sync.distributed import DistributedWeightSync, HostNetwork, sender_address

ENGINES = ["http://engine-a:30000", "http://engine-b:30001"]  # two engines on a third node
NAMES = {"engine-a": "10.0.2.7", "engine-b": "10.0.2.7", "node-a": "10.0.1.5", "node-b": "10.0.1.6",
         "localhost": "127.0.0.1", "127.0.0.1": "127.0.0.1", "0.0.0.0": "0.0.0.0"}


class FakeHost(HostNetwork):
    """A host with the given interfaces, whose name resolves to `hostname_ip`, with or without a route."""

    def __init__(self, interfaces, hostname_ip, routes=True):
        self.interfaces, self.hostname_ip, self.routes = set(interfaces), hostname_ip, routes
        self.routed_to = []

    def resolve(self, host):
        if host in NAMES:
            return NAMES[host]
        try:
            socket.inet_aton(host)
            return host
        except OSError:
            raise socket.gaierror(f"unknown host {host}") from None

    def is_local(self, address):
        return address in self.interfaces or address.startswith("127.")

    def route_source(self, address, port):
        self.routed_to.append((address, port))
        if not self.routes:
            return None
        return next(a for a in sorted(self.interfaces) if not a.startswith("127."))

    def hostname_address(self):
        return self.hostname_ip


# node-a: the trainer's first node (Debian-style hosts file: its name resolves to 127.0.1.1); node-b: the second
NODE_A = FakeHost({"127.0.0.1", "10.0.1.5"}, "127.0.1.1")
NODE_B = FakeHost({"127.0.0.1", "10.0.1.6"}, "10.0.1.6")


def test_remote_engines_get_the_routed_address_not_the_loopback_hostname():
    host = FakeHost({"127.0.0.1", "10.0.1.5"}, "127.0.1.1")
    assert sender_address(ENGINES, net=host) == "10.0.1.5"
    assert host.routed_to == [("10.0.2.7", 30000)], "the route to the first remote engine decides"


def test_local_engines_get_loopback():
    assert sender_address(["http://127.0.0.1:30000", "http://localhost:30001"], net=NODE_A) == "127.0.0.1"
    # an engine reached through one of this host's own addresses is local too
    assert sender_address(["http://10.0.1.5:30000"], net=NODE_A) == "127.0.0.1"


def test_loopback_hostname_without_a_route_is_an_error_naming_the_field():
    host = FakeHost({"127.0.0.1", "10.0.1.5"}, "127.0.1.1", routes=False)
    with pytest.raises(ConfigError, match=r"rollout.weight_sync.master_address: .*loopback address 127.0.1.1 .*"
                                          r"engine http://engine-a:30000 on another host cannot reach"):
        sender_address(ENGINES, net=host)


def test_explicit_loopback_with_remote_engines_is_an_error():
    for address in ("127.0.0.1", "localhost"):
        with pytest.raises(ConfigError, match=f"rollout.weight_sync.master_address={address}"):
            sender_address(ENGINES, address, net=NODE_B)
    assert sender_address(["http://127.0.0.1:30000"], "127.0.0.1", net=NODE_B) == "127.0.0.1"


def test_two_stages_on_two_hosts_advertise_their_own_addresses():
    """PP = 2 across nodes with master_address set to node-a: stage 0 (node-a) uses it, stage 1 (node-b) its own."""
    for master in ("10.0.1.5", "node-a"):
        stage0 = sender_address(ENGINES, master, net=NODE_A)
        stage1 = sender_address(ENGINES, master, net=NODE_B)
        assert (stage0, stage1) == (master, "10.0.1.6")
    assert (sender_address(ENGINES, net=NODE_A), sender_address(ENGINES, net=NODE_B)) == ("10.0.1.5", "10.0.1.6")


def test_an_address_that_does_not_resolve_is_named():
    with pytest.raises(ConfigError, match="rollout.weight_sync.master_address='nosuchhost' does not resolve"):
        sender_address(ENGINES, "nosuchhost", net=NODE_A)


def test_the_transport_checks_before_any_sync():
    """Built on each sender's host (runtime.attach_weight_senders) with this machine's real network: an engine at a
    documentation address (192.0.2.0/24, never assigned) is remote, so loopback is refused at construction."""
    with pytest.raises(ConfigError, match=r"master_address=127.0.0.1\), which engine http://192.0.2.1:30000"):
        DistributedWeightSync(["http://192.0.2.1:30000"], master_address="127.0.0.1")
    assert DistributedWeightSync(["http://127.0.0.1:30000"]).master_address == "127.0.0.1"
    routed = DistributedWeightSync(["http://192.0.2.1:30000"]).master_address
    real = HostNetwork()
    if real.route_source("192.0.2.1", 30000) is not None:  # a box without any route has nothing to advertise
        assert real.is_local(routed) and not routed.startswith("127."), routed


def test_loopback_master_address_with_remote_external_engines_is_refused_at_load_time():
    base = ["rollout.engine=external", "rollout.weight_sync.transport=distributed"]
    with pytest.raises(ConfigError, match="rollout.weight_sync.master_address=127.0.0.1 is a loopback address"):
        load_config(None, [*base, "rollout.urls=[http://192.0.2.1:30000]", "rollout.weight_sync.master_address=127.0.0.1"])
    load_config(None, [*base, "rollout.urls=[http://127.0.0.1:30000]", "rollout.weight_sync.master_address=127.0.0.1"])
    load_config(None, [*base, "rollout.urls=[http://192.0.2.1:30000]", "rollout.weight_sync.master_address=10.0.1.5"])
