"""Network-namespace "hosts" for the scheduler tests: a bridge in the root
namespace and one namespace per host, each joined to the bridge by a veth pair.

    bridge  <prefix>.1        (root namespace: slurmctld, munged, the test)
    host 0  <prefix>.2        (namespace <tag>-h0)
    host 1  <prefix>.3        (namespace <tag>-h1) ...

Every host reaches every other and the root namespace through the bridge, as
machines on one switch. Each host's link is shaped like the rehearsal
cluster's (scripts/cluster.py, whose ``shape`` and ``tbf`` this uses): a
``tc ... tbf`` qdisc of ``link`` (1gbit by default) on both ends of its veth
pair, the host's end (what it sends) and the bridge's (what it receives).

Each namespace has its own ``/etc/netns/<ns>/hosts`` (``Host.command``
mounts it over ``/etc/hosts`` for what runs there), so the host names
resolve to the namespace addresses inside the hosts, as a cluster's DNS
would, and nothing of the machine's own ``/etc/hosts`` changes.

Names carry the test process's pid, so that another test session (or
another helper) on the same machine never meets them. ``close()`` kills
every process left in a namespace (by the pids ``ip netns pids`` lists: only
ours), deletes the namespaces (and with them the veth pairs), the bridge and
the hosts files; it is idempotent and is registered with ``atexit`` as well
as called by the fixture's finalizer.

The namespaces and the bridge are made here, not by scripts/cluster.py's
``Cluster``: that one keeps its bridge in a namespace of its own ("the
switch") so that nothing lies in the root namespace, while here slurmctld,
munged and the test itself run in the root namespace and must reach every
host, so the bridge (with its address) is in the root namespace. Only the
shaping is the same, and is shared.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

LINK = "1gbit"
"""Every host's link rate, each way (tc's units)."""


def _load_cluster() -> ModuleType:
    """scripts/cluster.py as a module (a script, not in a package)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "cluster.py"
    spec = importlib.util.spec_from_file_location("dp_plugin_scripts_cluster", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


cluster = _load_cluster()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the `ip` or `tc` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`)"
    probe = f"dpsch-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create network namespaces (`ip netns add` says: {made.stderr.strip()})"
    try:  # the tbf qdisc, on a veth of the probe's (no dummy module everywhere)
        _ip("-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
        cluster.shape(probe, "probe0", cluster.link_bps(LINK))
    except (subprocess.CalledProcessError, cluster.Refused) as exc:
        return f"cannot shape a link with tc's tbf qdisc: {exc}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    """Host name (resolves to ``address`` inside every host)."""
    namespace: str
    address: str
    device: str
    """The host's end of its veth pair (inside ``namespace``)."""
    port: str
    """The bridge's end (root namespace)."""

    def qdiscs(self, stats: bool = False) -> dict[str, str]:
        """``tc qdisc show`` (``stats``: ``-s``) of both ends of the host's
        link: ``"sends"`` (its own end) and ``"receives"`` (the bridge's)."""
        return {"sends": cluster.qdisc(self.namespace, self.device, stats),
                "receives": cluster.qdisc(None, self.port, stats)}

    def bytes_sent(self) -> dict[str, int]:
        """Bytes through each end's qdisc so far (``Sent N bytes``)."""
        sent = {}
        for end, text in self.qdiscs(stats=True).items():
            m = re.search(r"Sent (\d+) bytes", text)
            sent[end] = int(m.group(1)) if m else -1
        return sent

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
    link: str = LINK
    """Each host's link rate, both ways (``tc`` units, as ``cluster.py --link``)."""
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
        rate = cluster.link_bps(self.link)
        cluster.shape(ns, inside, rate)  # what the host sends
        cluster.shape(None, outside, rate)  # what the bridge sends it
        return Host(name=f"{self.tag}n{i}", namespace=ns, address=address, device=inside,
                    port=outside)

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


def _tc_rate(link: str) -> str:
    """``link`` as tc shows a rate (``1gbit`` -> ``1Gbit``)."""
    bps = cluster.link_bps(link)
    for unit, scale in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if bps % scale == 0:
            return f"{bps // scale}{unit}bit"
    return f"{bps}bit"


def traffic(hosts: Hosts) -> dict[str, dict[str, int]]:
    """``Host.bytes_sent()`` of every host, by name."""
    return {h.name: h.bytes_sent() for h in hosts.hosts}


def assert_links_shaped(hosts: Hosts, before: dict[str, dict[str, int]]) -> None:
    """Both ends of every host's link hold a tbf qdisc of ``hosts.link``, and
    traffic went through each since ``before`` (``traffic(hosts)``): the
    job between them ran over the shaped links."""
    rate = _tc_rate(hosts.link)
    after = traffic(hosts)
    for h in hosts.hosts:
        for end, text in h.qdiscs().items():
            assert re.search(rf"^qdisc tbf \S+ root .*\brate {rate}\b", text, flags=re.M), (
                f"{h.name}'s link ({end}): expected a tbf root qdisc at {rate}, tc shows "
                f"{text!r}")
            assert after[h.name][end] > before[h.name][end] >= 0, (
                f"{h.name}'s link ({end}): no bytes went through its qdisc during the job "
                f"(before {before[h.name][end]}, after {after[h.name][end]})")
