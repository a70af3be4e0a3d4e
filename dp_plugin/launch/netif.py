"""Which network interface leads to a given address (for Gloo on multi-host runs).

Gloo binds and advertises the address of the interface named by
``GLOO_SOCKET_IFNAME``; unset, it uses the address the host name resolves
to, which is often a loopback address (``127.0.1.1`` in /etc/hosts) or an
address of an interface the other hosts cannot reach. Remote ranks then try
to connect to themselves and the job fails or hangs at start-up.

``interface_for(address)`` asks the kernel which source address it would use
to reach ``address`` (connecting a UDP socket sends nothing) and returns the
interface that holds that source address. ``gloo_interface(environ)`` applies
it to the rendezvous address. Linux only (``SIOCGIFADDR``); elsewhere, or for
IPv6, the answer is None and nothing changes. ``free_port()`` picks the port
of a rendezvous this process sets up (Ray, ``dp-plugin bench``). No framework
imports: this is core code.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
import sys
from collections.abc import MutableMapping

SIOCGIFADDR = 0x8915
"""Linux ioctl: the IPv4 address of an interface."""

RENDEZVOUS_ADDRESS_VARIABLES = ("MASTER_ADDR", "HOROVOD_GLOO_RENDEZVOUS_ADDR")
"""Where the rendezvous host is found: torchrun/srun scripts, then horovodrun."""


def source_address(address: str, port: int = 9) -> str | None:
    """The local IPv4 address the kernel would use to send to ``address``
    (None if it cannot be resolved or has no route). No packet is sent."""
    try:
        infos = socket.getaddrinfo(address, port, socket.AF_INET, socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return None
    for _family, _type, _proto, _canon, sockaddr in infos:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)
            except OSError:
                continue
            return str(s.getsockname()[0])
    return None


def interface_addresses() -> dict[str, str]:
    """IPv4 address of each interface that has one (Linux), by interface name."""
    if not sys.platform.startswith("linux"):
        return {}
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                import fcntl

                reply = fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def interface_for(address: str) -> str | None:
    """Name of the interface whose IPv4 address the kernel uses as source to
    reach ``address``, or None when that cannot be told."""
    source = source_address(address)
    if source is None:
        return None
    return next((name for name, addr in interface_addresses().items() if addr == source), None)


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous store (the OS picks
    it; the store binds it again moments later, as Ray Train does)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def is_loopback(address: str) -> bool:
    """True for ``localhost`` and addresses in 127.0.0.0/8 or ::1."""
    if address.strip().lower() == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(address.strip()).is_loopback
    return False


def gloo_interface(environ: MutableMapping[str, str] = os.environ, *,
                   single_host: bool = False, address: str | None = None) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` in ``environ`` to the interface that routes to
    the rendezvous address, unless it is set already or the rendezvous is on
    loopback (one host). ``single_host`` (every rank on this host): the
    loopback interface, so that Gloo's sockets listen on 127.0.0.1 only.
    ``address``: the rendezvous address when the launcher's topology knows it
    (under srun it may be derived, not exported); else it is read from
    ``RENDEZVOUS_ADDRESS_VARIABLES``.
    Returns the interface set, or None if nothing was set."""
    if environ.get("GLOO_SOCKET_IFNAME"):
        return None
    if single_host:
        name = next((n for n, a in interface_addresses().items() if a == "127.0.0.1"), None)
    else:
        if not address:
            addresses = (environ.get(v, "").strip() for v in RENDEZVOUS_ADDRESS_VARIABLES)
            address = next((a for a in addresses if a), None)
        if address is None or is_loopback(address):
            return None
        name = interface_for(address)
    if name is not None:
        environ["GLOO_SOCKET_IFNAME"] = name
    return name
