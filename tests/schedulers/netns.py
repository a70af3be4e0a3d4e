"""Network-namespace "hosts" for the scheduler tests: a bridge in the root
namespace and one namespace per host, each joined to the bridge by a veth pair.

    bridge  <prefix>.1        (root namespace: slurmctld, munged, the test)
    host 0  <prefix>.2        (namespace <tag>-h0)
    host 1  <prefix>.3        (namespace <tag>-h1) ...

Every host reaches every other and the root namespace through the bridge, as
machines on one switch. Each namespace has its own ``/etc/netns/<ns>/hosts``
(``Host.command`` mounts it over ``/etc/hosts`` for what runs there), so
the host names resolve to the namespace addresses inside the hosts, as a
cluster's DNS would, and nothing of the machine's own ``/etc/hosts``
changes.

Names carry the test process's pid, so that another test session (or
another helper) on the same machine never meets them. ``close()`` kills
every process left in a namespace (by the pids ``ip netns pids`` lists: only
ours), deletes the namespaces (and with them the veth pairs), the bridge and
the hosts files; it is idempotent and is registered with ``atexit`` as well
as called by the fixture's finalizer.

The rehearsal cluster of ``scripts/cluster.py`` (shaped links) had not
landed when this was written; this helper is the fixture's own.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`)"
    probe = f"dpsch-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create network namespaces (`ip netns add` says: {made.stderr.strip()})"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    """Host name (resolves to ``address`` inside every host)."""
    namespace: str
    address: str

    @property
    def hosts_file(self) -> Path:
        return Path("/etc/netns") / self.namespace / "hosts"

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside this host: its network namespace, and a mount
        namespace of its own where ``hosts_file`` is ``/etc/hosts``. Not
        ``ip netns exec``: that also mounts a fresh /sys, without the
        cgroup hierarchy that slurmd insists on finding."""
        return ["nsenter", f"--net=/run/netns/{self.namespace}", "--",
                "unshare", "--mount", "--propagation", "private", "--",
                "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(self.hosts_file),
                *argv]


@dataclass
class Hosts:
    """``count`` namespace hosts on one bridge; ``close()`` removes them all."""

    count: int = 2
    tag: str = field(default_factory=lambda: f"dps{os.getpid() % 100000}")
    hosts: list[Host] = field(default_factory=list)
    bridge_address: str = ""
    _made: list[str] = field(default_factory=list)
    _bridge: str = ""
    _closed: bool = False

    def __post_init__(self) -> None:
        atexit.register(self.close)
        # 10.230.X.0/24, X from the pid: two sessions on one machine differ.
        prefix = f"10.230.{os.getpid() % 250 + 1}"
        self.bridge_address = f"{prefix}.1"
        self._bridge = f"{self.tag}br"[:15]
        try:
            _ip("link", "add", self._bridge, "type", "bridge")
            self._made.append("bridge")
            _ip("addr", "add", f"{self.bridge_address}/24", "dev", self._bridge)
            _ip("link", "set", self._bridge, "up")
            for i in range(self.count):
                self.hosts.append(self._add_host(i, f"{prefix}.{i + 2}"))
            self._write_hosts_files()
        except BaseException:
            self.close()
            raise

    def _add_host(self, i: int, address: str) -> Host:
        ns = f"{self.tag}-h{i}"
        outside, inside = f"{self.tag}v{i}"[:15], f"{self.tag}p{i}"[:15]
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("link", "set", outside, "master", self._bridge)
        _ip("link", "set", outside, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inside)
        _ip("-n", ns, "link", "set", inside, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return Host(name=f"{self.tag}n{i}", namespace=ns, address=address)

    def _write_hosts_files(self) -> None:
        lines = ["127.0.0.1 localhost"] + [f"{h.address} {h.name}" for h in self.hosts]
        for h in self.hosts:
            h.hosts_file.parent.mkdir(parents=True, exist_ok=True)
            # The namespaces share the machine's host name; inside each host it
            # names that host, as a real host's name does (Gloo, when nobody
            # sets GLOO_SOCKET_IFNAME, as Ray Train's own init_process_group,
            # advertises the address its host name resolves to).
            own = f"{h.address} {socket.gethostname()}"
            h.hosts_file.write_text("\n".join([*lines, own]) + "\n")

    def pids(self, namespace: str) -> list[int]:
        """The processes in ``namespace``."""
        out = _ip("netns", "pids", namespace, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def kill_all(self, namespace: str) -> None:
        """SIGKILL every process in ``namespace`` (only ours live there)."""
        for _ in range(5):
            pids = self.pids(namespace)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for ns in [n for n in self._made if n != "bridge"]:
            self.kill_all(ns)
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        if "bridge" in self._made:
            _ip("link", "del", self._bridge, check=False)


def namespaces_left(tag: str) -> list[str]:
    """The namespaces named with ``tag`` that still exist."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{tag}-")]
