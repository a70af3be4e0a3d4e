"""dp_plugin.launch.netif: the interface that routes to an address (no packet is sent)."""

from __future__ import annotations

import sys

import pytest

from dp_plugin.launch import netif

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIOCGIFADDR is Linux's")


@linux
def test_loopback_routes_through_lo() -> None:
    addrs = netif.interface_addresses()
    loopback = next(name for name, addr in addrs.items() if addr.startswith("127."))
    assert netif.interface_for("127.0.0.1") == loopback


@linux
def test_an_address_of_this_host_maps_to_its_interface() -> None:
    others = {n: a for n, a in netif.interface_addresses().items() if not a.startswith("127.")}
    if not others:
        pytest.skip("this host has no non-loopback IPv4 interface")
    name, addr = sorted(others.items())[0]
    assert netif.source_address(addr) == addr
    assert netif.interface_for(addr) == name


def test_unresolvable_address_gives_none() -> None:
    assert netif.interface_for("no-such-host.invalid") is None


@pytest.mark.parametrize("addr", ["127.0.0.1", "localhost", "::1", "127.0.1.1"])
def test_loopback_rendezvous_leaves_gloo_alone(addr: str) -> None:
    env = {"MASTER_ADDR": addr}
    assert netif.gloo_interface(env) is None and "GLOO_SOCKET_IFNAME" not in env


def test_a_users_choice_is_kept() -> None:
    env = {"MASTER_ADDR": "10.0.0.1", "GLOO_SOCKET_IFNAME": "ib0"}
    assert netif.gloo_interface(env) is None and env["GLOO_SOCKET_IFNAME"] == "ib0"


@linux
def test_remote_rendezvous_sets_the_routing_interface() -> None:
    others = {n: a for n, a in netif.interface_addresses().items() if not a.startswith("127.")}
    if not others:
        pytest.skip("this host has no non-loopback IPv4 interface")
    name, addr = sorted(others.items())[0]
    env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": addr}
    assert netif.gloo_interface(env) == name and env["GLOO_SOCKET_IFNAME"] == name


def test_no_rendezvous_address_sets_nothing() -> None:
    env: dict[str, str] = {}
    assert netif.gloo_interface(env) is None and env == {}
