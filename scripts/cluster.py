#!/usr/bin/env python3
"""A rehearsal cluster on one machine: H hosts, P ranks each, a shaped link.

Makes H network namespaces ("hosts", addresses ``10.212.0.1`` .. ``.H`` by
default, see ``--subnet``) and one more holding a bridge (the "switch");
each host reaches the switch through a veth pair, and both ends of that
pair are shaped with ``tc qdisc ... tbf rate RATE`` (``--link``): what a
host sends and what it receives each go at most RATE, like a full-duplex
NIC of that speed (``--link none``: not shaped). Ranks on one host talk
through its loopback and ``/dev/shm``, unshaped, as on a real host.

One launcher per host runs the command given after ``--`` on every rank:

- ``torchrun`` (default): c10d rendezvous, ``--nnodes H``, the rendezvous
  store on host 1 (``--rdzv-endpoint 10.212.0.1:PORT``, ``is_host`` set
  explicitly because a namespace's host name does not resolve to its
  address), ``--local-addr`` on each host, ``--no-python``;
- ``mpirun``: MPICH's ``mpiexec -hosts 1,..,H`` on host 1; Hydra starts its
  proxy on every host through ``-launcher-exec``, which here is this script
  entering the host's namespace instead of ssh;
- ``horovodrun``: ``horovodrun --gloo -np H*P -H h1:P,..`` on host 1, by the
  hosts' names; it reaches the other hosts with ``ssh``, which here is a
  command first on every host's PATH that parses ssh's own options and runs
  the remote command with ``sh -c`` inside the named host's namespace, in a
  fresh login environment as sshd would.

Each host namespace has its own hosts file (``/etc/netns/<ns>/hosts``, which
``ip netns exec`` mounts over ``/etc/hosts``): every host's name (its
namespace's name) resolves to its address, and the machine's host name,
which all namespaces share, resolves inside each host to that host's own
address, as a real host's name does (``--loopback-hostname``: to 127.0.0.1,
as in many hosts' ``/etc/hosts``, which is what breaks Horovod 0.28.1's
unpatched Gloo process sets; see docs/horovod-build.md).

A command whose first word ends in ``.py`` is run with this Python. Every
rank sees ``DP_CLUSTER_HOSTS``, ``DP_CLUSTER_RANKS_PER_HOST`` and
``DP_CLUSTER_LINK_BPS`` (the shaped rate in bits/s, 0 when unshaped), so a
benchmark can report the share of the link it reached.

Teardown on every exit path (success, failure, ``--timeout``, an exception,
Ctrl-C, SIGTERM, SIGHUP): every process left in a namespace is killed, then
the namespaces are deleted, which deletes the veth pairs, the bridge and the
qdiscs with them, and the hosts files. Every name carries the prefix
``dpc-<pid>-``; a run killed with SIGKILL (which no handler sees) leaves them,
and the next run deletes the namespaces whose pid is gone, with what is left
inside and their hosts files. At the end of a shaped run it prints the bytes
each host's link carried (``tc -s``'s ``Sent``, both ends). Needs root
(``ip netns add``) and ``tc`` with the ``tbf`` qdisc; where either is
missing it refuses with exit status 77 and says what is missing.

    sudo .venv/bin/python scripts/cluster.py --hosts 2 --ranks-per-host 2 --link 1gbit \\
        -- examples/bert_pretrain.py --steps 20 --no-progress
    sudo .venv/bin/python scripts/cluster.py --launcher mpirun --hosts 3 --link 500mbit
    sudo .venv/bin/python scripts/cluster.py --launcher horovodrun --ranks-per-host 2

The documented rehearsal is docs/testing.md ("Multi-node rehearsals on one
machine"); the real-cluster recipes are docs/multinode.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pods  # scripts/pods.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "bert_pretrain.py"
# A small model and a short run: the point is the plumbing.
DEFAULT_COMMAND = [str(EXAMPLE), "--layers", "2", "--hidden", "64", "--heads", "2",
                   "--seq-len", "32", "--vocab-size", "1000", "--global-batch", "16",
                   "--steps", "6", "--warmup-steps", "2", "--log-every", "1", "--no-progress"]
REFUSED = 77
"""Exit status when the machine cannot make the cluster (as automake's "skip")."""
# Variables of an outer launcher: the inner launchers must not inherit them.
_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "HYDRA_", "HOROVOD_", "SLURM_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                   "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                   "MASTER_ADDR", "MASTER_PORT", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                   "GLOO_SOCKET_IFNAME"}
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)bit$")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
HOST_IFACE = "eth0"
"""Every host's interface to the switch (the same name in each namespace)."""
NETNS_ETC = Path("/etc/netns")
"""``ip netns exec NS`` bind-mounts the files of ``NETNS_ETC/NS`` over ``/etc``."""
LOGIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""PATH of a fresh ssh login (what sshd gives a remote command)."""
# ssh's options (OpenSSH's ssh(1) synopsis): flags, and options taking a value.
_SSH_FLAGS = frozenset("46AaCfGgKkMNnqsTtVvXxYy")
_SSH_VALUED = frozenset("BbcDEeFIiJLlmOoPpQRSWw")


class Refused(Exception):
    """The machine cannot make the cluster (not root, no iproute2, no tbf)."""


def link_bps(text: str) -> int:
    """``--link`` in bits per second (``1gbit`` -> 10**9; ``none`` -> 0)."""
    if text == "none":
        return 0
    m = _RATE.match(text.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"--link {text!r}: expected a rate such as 1gbit, 10gbit, 500mbit or 100kbit "
            "(tc's units), or none for an unshaped link")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Run a command on H network namespaces joined by a bridge, every host's "
                    "link shaped with tc tbf, one launcher per host. The command to run on "
                    "every rank goes after --.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--hosts", type=int, default=2, help="hosts (network namespaces)")
    ap.add_argument("--ranks-per-host", type=int, default=1, help="ranks on each host")
    ap.add_argument("--link", default="1gbit",
                    help="each host's link rate, both directions (tc units; none: unshaped)")
    ap.add_argument("--launcher", choices=["torchrun", "mpirun", "horovodrun", "k8s"],
                    default="torchrun", help="multi-node launcher to start the job with "
                                             "(k8s: the pods of --manifest)")
    ap.add_argument("--manifest", type=Path, default=None,
                    help="with --launcher k8s: a manifest of `dp-plugin k8s render`; one host "
                         "per pod runs the pod's own command and environment (--hosts, "
                         "--ranks-per-host and the command come from it)")
    ap.add_argument("--loopback-hostname", action="store_true",
                    help="the machine's host name resolves to 127.0.0.1 inside every host "
                         "(default: to the host's own address)")
    ap.add_argument("--subnet", default="10.212.0.0/24",
                    help="private subnet of the hosts (host i gets address i)")
    ap.add_argument("--port", type=int, default=29412, help="rendezvous port on host 1")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds before the job is killed (and everything torn down)")
    ap.add_argument("--kill", choices=["workers", "pod"], default=None,
                    help="a failure to inject once, when a line of output matches --kill-when: "
                         "workers: SIGKILL the processes the launcher of host --kill-host "
                         "started (its torchrun lives on and restarts them); pod: SIGKILL "
                         "every process of that host, then start its command again in the "
                         "same namespace (a deleted pod that its controller recreates)")
    ap.add_argument("--kill-host", type=int, default=2,
                    help="with --kill: the host (1-based; a manifest's pods in its order)")
    ap.add_argument("--kill-when", type=re.compile, default=None,
                    help="with --kill: a regular expression searched in every output line")
    ap.add_argument("command", nargs=argparse.REMAINDER,
                    help="command for every rank, after -- (default: a short BERT run)")
    args = ap.parse_args(argv)
    args.pods = None
    if (args.launcher == "k8s") != (args.manifest is not None):
        ap.error("--launcher k8s and --manifest FILE go together")
    if args.manifest is not None:
        try:
            args.pods = pods.plan(pods.load(args.manifest))
        except (OSError, ValueError, KeyError) as exc:
            ap.error(f"--manifest {args.manifest}: {exc!r}")
        args.hosts, args.ranks_per_host = len(args.pods.pods), args.pods.procs_per_node
        if args.kill and args.pods.kind == "MPIJob":
            ap.error("--kill: an MPIJob's mpirun has no restarts; kill a TrainJob's or a "
                     "PyTorchJob's pod")
    if (args.kill is None) != (args.kill_when is None):
        ap.error("--kill and --kill-when go together")
    if args.kill and args.launcher in ("mpirun", "horovodrun"):
        ap.error(f"--kill: {args.launcher} starts every rank from host 1; kill a host's "
                 "processes under --launcher torchrun or k8s")
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    args.command = args.command or list(DEFAULT_COMMAND)
    if args.command[0].endswith(".py"):
        args.command = [sys.executable, *args.command]
    if args.hosts < 1 or args.ranks_per_host < 1:
        ap.error(f"--hosts {args.hosts} and --ranks-per-host {args.ranks_per_host} must be >= 1")
    if args.kill and not 1 <= args.kill_host <= args.hosts:
        ap.error(f"--kill-host {args.kill_host}: expected a host of 1..{args.hosts}")
    args.link_text = args.link
    try:
        args.link = link_bps(args.link)
    except argparse.ArgumentTypeError as exc:
        ap.error(str(exc))
    return args


def tbf(rate_bps: int) -> list[str]:
    """A ``tbf`` qdisc of ``rate_bps``: a bucket of 4 ms of traffic (at least
    64 KiB, a GSO segment, else large segments would never pass) and up to
    50 ms of queue."""
    burst = max(64 * 1024, rate_bps // 8 * 4 // 1000)
    return ["root", "tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", "50ms"]


def shape(namespace: str | None, dev: str, rate_bps: int) -> None:
    """Limit what ``dev`` sends to ``rate_bps`` (a ``tbf`` root qdisc); ``dev``
    lives in network namespace ``namespace`` (None: this process's). Shaping
    both ends of a veth pair shapes the link both ways. Raises ``Refused``
    where tc or its tbf qdisc is missing. The tests' namespace hosts
    (tests/schedulers/netns.py) shape their links with this too."""
    try:
        _run(*_inside(namespace, "tc", "qdisc", "add", "dev", dev, *tbf(rate_bps)))
    except RuntimeError as exc:
        raise Refused(f"cannot shape the link with tc's tbf qdisc ({exc}); load the sch_tbf "
                      "kernel module, or run with --link none for an unshaped link") from None


def qdisc(namespace: str | None, dev: str, stats: bool = False) -> str:
    """``tc qdisc show dev DEV`` (``-s``: with the bytes sent) in ``namespace``."""
    cmd = ["tc", *(["-s"] if stats else []), "qdisc", "show", "dev", dev]
    return subprocess.run(_inside(namespace, *cmd), capture_output=True, text=True).stdout.strip()


def _inside(namespace: str | None, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, *cmd] if namespace else list(cmd)


class Cluster:
    """H host namespaces and a switch namespace with a bridge; ``close()``
    removes everything, whatever was made."""

    def __init__(self, hosts: int, subnet: str) -> None:
        net = ipaddress.ip_network(subnet)
        if net.num_addresses < hosts + 2:
            raise SystemExit(f"cluster: --subnet {subnet} is too small for {hosts} hosts")
        self.prefix = f"dpc-{os.getpid()}-"
        self.switch = f"{self.prefix}sw"
        self.names = [f"{self.prefix}h{i + 1}" for i in range(hosts)]
        self.addrs = [str(net.network_address + i + 1) for i in range(hosts)]
        self.prefixlen = net.prefixlen
        self.created: list[str] = []
        self.workdir = Path(tempfile.mkdtemp(prefix=self.prefix))

    def create(self, rate_bps: int, loopback_hostname: bool = False,
               aliases: list[list[str]] | None = None) -> None:
        for ns in [self.switch, *self.names]:
            _run("ip", "netns", "add", ns)
            self.created.append(ns)
        self._write_hosts_files(loopback_hostname, aliases or [[] for _ in self.names])
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addrs, strict=True)):
            port = f"port{i + 1}"
            # Both ends made inside their namespaces: nothing ever lies in the
            # root namespace, so deleting the namespaces removes everything.
            _run("ip", "-n", ns, "link", "add", HOST_IFACE, "type", "veth",
                 "peer", "name", port, "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/{self.prefixlen}", "dev", HOST_IFACE)
            _run("ip", "-n", ns, "link", "set", HOST_IFACE, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if rate_bps:
                # The host's egress, and the switch port's egress (the host's ingress).
                shape(ns, HOST_IFACE, rate_bps)
                shape(self.switch, port, rate_bps)

    def _write_hosts_files(self, loopback_hostname: bool, aliases: list[list[str]]) -> None:
        """Each host's ``/etc/hosts``: every host by name (and its ``aliases``,
        a pod's DNS names), and the machine's host name as this host (or as
        loopback)."""
        names = [" ".join([a, n, *more])
                 for n, a, more in zip(self.names, self.addrs, aliases, strict=True)]
        for ns, addr in zip(self.names, self.addrs, strict=True):
            own = "127.0.0.1" if loopback_hostname else addr
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(
                "\n".join(["127.0.0.1 localhost", *names, f"{own} {socket.gethostname()}"]) + "\n")

    def ssh(self) -> Path:
        """A directory holding ``ssh``: this script entering a host of this
        cluster (for PATH, and as Hydra's launcher-exec)."""
        bindir = self.workdir / "bin"
        bindir.mkdir(exist_ok=True)
        enter = bindir / "ssh"
        enter.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" '
                         f'--enter {self.prefix} "{self.workdir}" "$@"\n')
        enter.chmod(0o755)
        return bindir

    def link_bytes(self) -> str:
        """Bytes each host's link carried so far (both ends' qdiscs), one line."""
        parts = []
        for i, ns in enumerate(self.names):
            sent = _sent_bytes(qdisc(ns, HOST_IFACE, stats=True))
            received = _sent_bytes(qdisc(self.switch, f"port{i + 1}", stats=True))
            parts.append(f"{ns} sent {sent} received {received}")
        return "; ".join(parts)

    def qdiscs(self) -> list[str]:
        """Every host's egress qdisc, as tc shows it (for the start-up line)."""
        return [qdisc(ns, HOST_IFACE) for ns in self.names]

    def close(self) -> None:
        for ns in reversed(self.created):
            # Every process still inside (torchrun puts its workers in sessions
            # of their own, out of reach of a process-group kill), then the
            # namespace: a process left inside would keep it alive, unnamed.
            for _ in range(50):
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                      text=True).stdout.split()
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.1)
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        self.created.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)


def reap_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose ``cluster.py`` is gone (it
    was killed with SIGKILL, the one exit no handler sees), with every
    process still inside; returns their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    stale = []
    for line in listed.splitlines():
        m = re.match(r"(dpc-(\d+)-\S+)", line)
        if not m:
            continue
        try:
            os.kill(int(m.group(2)), 0)
        except ProcessLookupError:
            stale.append(m.group(1))
        except PermissionError:
            pass  # alive, someone else's
    if stale:
        leftover = Cluster.__new__(Cluster)
        leftover.created = list(stale)
        leftover.workdir = Path(tempfile.gettempdir()) / "dpc-none"
        leftover.close()
    return stale


def _command_line(pid: int) -> str:
    """The first words of process ``pid``'s command line (its name when the
    kernel shows none, as for a process being torn down)."""
    words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:3]
    text = b" ".join(words).decode(errors="replace").strip()
    return text or Path(f"/proc/{pid}/comm").read_text().strip()


def _netns_pids(ns: str) -> list[int]:
    """The processes of network namespace ``ns``, in pid order."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return sorted(int(p) for p in out.split())


def _sent_bytes(stats: str) -> int:
    """``Sent N bytes`` of ``tc -s qdisc show`` (-1 when absent)."""
    m = re.search(r"Sent (\d+) bytes", stats)
    return int(m.group(1)) if m else -1


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")


def check_tools(rate_bps: int) -> None:
    """Raise ``Refused`` naming what is missing: root, ``ip``, ``tc``."""
    if shutil.which("ip") is None:
        raise Refused("the `ip` command (iproute2) is not installed; install iproute2")
    if rate_bps and shutil.which("tc") is None:
        raise Refused("the `tc` command (iproute2) is not installed, so the link cannot be "
                      "shaped; install iproute2, or run with --link none")
    if os.geteuid() != 0:
        raise Refused("network namespaces need root (`ip netns add`); run it with sudo")


def clean_env(args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_NAMES and not k.startswith(_LAUNCHER_PREFIXES)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["DP_CLUSTER_HOSTS"] = str(args.hosts)
    env["DP_CLUSTER_RANKS_PER_HOST"] = str(args.ranks_per_host)
    env["DP_CLUSTER_LINK_BPS"] = str(args.link)
    return env


def k8s_size(quantity: str) -> str:
    """A Kubernetes quantity (``2Gi``, ``512Mi``, ``1G``) as tmpfs's ``size=``."""
    m = re.match(r"^(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?$", quantity)
    if not m:
        raise ValueError(f"sizeLimit {quantity!r}: expected a whole number and a unit like 2Gi")
    scale = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[m.group(2)]
    return str(int(m.group(1)) * scale)


def pod_wrapper(pod: pods.Pod) -> list[str]:
    """What makes a host namespace look like ``pod`` from inside: its own
    host name (a UTS namespace) and a ``/dev/shm`` of its ``sizeLimit`` (a
    tmpfs in a mount namespace of its own)."""
    setup = 'hostname "$1" && '
    if pod.shm_size:
        setup += f'mount -t tmpfs -o size={k8s_size(pod.shm_size)} tmpfs /dev/shm && '
    return ["unshare", "--uts", "--ipc", "--mount", "sh", "-c", setup + 'shift && exec "$@"',
            "pod", pod.name]


def pod_commands(args: argparse.Namespace,
                 cluster: Cluster) -> list[tuple[str, list[str], dict[str, str]]]:
    """(namespace, command, environment) of each pod that runs a command; the
    others (an MPIJob's workers) wait for the launcher's ssh, which enters
    them as their pods (``<workdir>/<ns>/pod.json``)."""
    out = []
    for ns, pod in zip(cluster.names, args.pods.pods, strict=True):
        env = dict(pod.env)
        for path, text in pod.files.items():  # the operator's mounts, here in workdir
            local = cluster.workdir / ns / Path(path).name
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(text)
            env = {k: str(local) if v == path else v for k, v in env.items()}
        # A pod's own /tmp (torchrun's log directory, the default elastic
        # commit): the hosts share this machine's, so each pod gets a folder.
        tmp = cluster.workdir / ns / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        env.setdefault("TMPDIR", str(tmp))
        (cluster.workdir / ns / "pod.json").write_text(json.dumps(
            {"name": pod.name, "shm_size": pod.shm_size, "env": pod.env}))
        if pod.command is not None:
            command = list(pod.command)
            if command[0].endswith(".py"):
                command = [sys.executable, *command]
            out.append((ns, [*pod_wrapper(pod), *command], env))
    return out


def commands(args: argparse.Namespace, cluster: Cluster) -> list[tuple[str, list[str]]]:
    """(namespace, command) per launcher to start."""
    bindir = Path(sys.executable).parent
    if args.launcher == "torchrun":
        return [(ns, [
            str(bindir / "torchrun"), "--nnodes", str(args.hosts),
            "--nproc-per-node", str(args.ranks_per_host),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.addrs[0]}:{args.port}",
            "--rdzv-id", f"cluster-{os.getpid()}",
            "--rdzv-conf", f"is_host={1 if node == 0 else 0}",
            "--local-addr", addr, "--max-restarts", "0", "--no-python", *args.command,
        ]) for node, (ns, addr) in enumerate(zip(cluster.names, cluster.addrs, strict=True))]
    ranks = str(args.hosts * args.ranks_per_host)
    if args.launcher == "horovodrun":
        # Started on host 1, by host names; the ssh first on PATH reaches the
        # others. --disable-cache: nothing left in ~/.horovod between runs.
        hostlist = ",".join(f"{n}:{args.ranks_per_host}" for n in cluster.names)
        return [(cluster.names[0], [
            str(bindir / "horovodrun"), "--gloo", "-np", ranks, "-H", hostlist,
            "--disable-cache", *args.command,
        ])]
    # mpirun: started on host 1; Hydra reaches the others through the ssh
    # wrapper (launcher-exec must be one executable).
    hostlist = ",".join(f"{a}:{args.ranks_per_host}" for a in cluster.addrs)
    return [(cluster.names[0], [
        str(bindir / "mpiexec"), "-hosts", hostlist, "-launcher", "ssh",
        "-launcher-exec", str(cluster.ssh() / "ssh"), "-iface", HOST_IFACE,
        "-n", ranks, *args.command,
    ])]


def parse_ssh(argv: list[str]) -> tuple[str, list[str]]:
    """``ssh [options] [user@]host [options] [command...]`` -> (host, command).

    ssh's grammar: single-letter options, clustered (``-xT``), a value
    attached or in the next word (``-p22``, ``-o Foo=bar``); options may also
    follow the host (horovodrun puts ``-p``/``-i`` there); the first other
    word after the host starts the command. Raises ``ValueError`` naming a
    word it cannot parse."""
    host: str | None = None
    i = 0
    while i < len(argv):
        word = argv[i]
        i += 1
        if word == "--" and host is None:
            if i >= len(argv):
                break
            host, i = argv[i], i + 1
            break
        if word.startswith("-") and len(word) > 1:
            for j, letter in enumerate(word[1:], start=1):
                if letter in _SSH_VALUED:
                    if j == len(word) - 1:  # the value is the next word
                        if i >= len(argv):
                            raise ValueError(f"ssh option -{letter} needs a value")
                        i += 1
                    break
                if letter not in _SSH_FLAGS:
                    raise ValueError(f"unknown ssh option -{letter} in {word!r}")
            continue
        if host is not None:
            i -= 1  # the command's first word
            break
        host = word
    if host is None:
        raise ValueError(f"no host in ssh arguments {argv!r}")
    return host.rpartition("@")[2], argv[i:]


def enter_host(prefix: str, workdir: Path, argv: list[str]) -> int:
    """``ssh`` for the hosts whose namespaces start with ``prefix``: run the
    command in the host named (by namespace name, a name its hosts file
    resolves, or an address) with ``sh -c``, in a fresh login environment;
    a pod's (``workdir/<ns>/pod.json``) with its host name, IPC namespace,
    ``/dev/shm`` and variables, as its sshd would."""
    try:
        host, command = parse_ssh(argv)
    except ValueError as exc:
        print(f"cluster ssh: {exc}", file=sys.stderr)
        return 255
    if not command:
        print(f"cluster ssh: {host}: no command given (no interactive logins here)",
              file=sys.stderr)
        return 255
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except OSError:
        address = host
    for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                             check=True).stdout.split():
        if not ns.startswith(prefix) or ns.endswith("-sw"):
            continue
        addrs = subprocess.run(["ip", "-n", ns, "-o", "-4", "addr", "show"],
                               capture_output=True, text=True).stdout
        if ns == host or f" {address}/" in addrs:
            login = {"PATH": LOGIN_PATH, "HOME": os.environ.get("HOME", "/"),
                     "USER": os.environ.get("USER", "root"), "SHELL": "/bin/sh",
                     "LANG": os.environ.get("LANG", "C.UTF-8")}
            # Found from the cluster's own folder, not the temporary directory:
            # the caller's TMPDIR may be a pod's own (an MPIJob launcher's).
            pod_file = workdir / ns / "pod.json"
            wrapper: list[str] = []
            if pod_file.exists():  # a pod's sshd: its host name, /dev/shm and variables
                pod = json.loads(pod_file.read_text())
                wrapper = pod_wrapper(pods.Pod(pod["name"], [], {}, None, pod["shm_size"]))
                login.update(pod["env"])
            return subprocess.call(["ip", "netns", "exec", ns, *wrapper,
                                    "sh", "-c", " ".join(command)], env=login)
    print(f"cluster ssh: {host}: no host of this cluster ({prefix}*) has that name or "
          "address", file=sys.stderr)
    return 255


def _pump(stream: object, prefix: str, fault: Fault | None) -> None:
    for line in iter(stream.readline, b""):  # type: ignore[attr-defined]
        text = line.decode(errors="replace")
        sys.stdout.write(f"{prefix}{text}")
        sys.stdout.flush()
        if fault is not None:
            fault.see(text)


class Launchers:
    """One launcher process per host, each started (and restarted) in its
    namespace with its output copied to ours, prefixed ``[host<i>]``."""

    def __init__(self, started: list[tuple[str, list[str], dict[str, str]]],
                 env: dict[str, str], procs: list[subprocess.Popen[bytes]]) -> None:
        self.started = started
        self.env = env
        self.procs = procs
        """What is running now, host by host (``main`` kills what is left)."""
        self.pumps: list[threading.Thread] = []
        self.fault: Fault | None = None

    def start(self, i: int) -> None:
        ns, cmd, pod_env = self.started[i]
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env={**self.env, **pod_env},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        if i < len(self.procs):
            self.procs[i] = proc
        else:
            self.procs.append(proc)
        pump = threading.Thread(target=_pump, args=(proc.stdout, f"[host{i + 1}] ", self.fault),
                                daemon=True)
        pump.start()
        self.pumps.append(pump)

    def wait(self, i: int, timeout: float) -> int:
        """Host ``i``'s exit status: its last launcher's, after a ``pod`` fault
        has replaced the one it killed."""
        deadline = time.monotonic() + timeout
        while True:
            proc = self.procs[i]
            code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            fault = self.fault
            if fault is None or fault.host != i or not fault.fired.is_set():
                return code
            if not fault.done.wait(timeout=max(0.0, deadline - time.monotonic())):
                raise subprocess.TimeoutExpired(proc.args, timeout)
            if self.procs[i] is proc:
                return code


class Fault:
    """One failure injected into a host when a line of output matches
    ``when`` (``--kill``): its launcher's worker processes SIGKILLed
    (``workers``), or every process of the host SIGKILLed and its command
    started again in the same namespace (``pod``: the pod deleted and
    recreated by its controller, with its name and address)."""

    def __init__(self, what: str, host: int, when: re.Pattern[str],
                 launchers: Launchers) -> None:
        self.what, self.host, self.when, self.launchers = what, host, when, launchers
        self.fired = threading.Event()
        self.done = threading.Event()
        self._lock = threading.Lock()

    def see(self, line: str) -> None:
        with self._lock:
            if self.fired.is_set() or not self.when.search(line):
                return
            self.fired.set()
        try:
            self._inject()
        finally:
            self.done.set()

    def _inject(self) -> None:
        ns = self.launchers.started[self.host][0]
        launcher = self.launchers.procs[self.host]
        killed: dict[int, str] = {}
        # "workers": the processes there now, once (the launcher's restarts live).
        first = set(_netns_pids(ns)) - {launcher.pid} if self.what == "workers" else None
        for _ in range(50):
            pids = [p for p in _netns_pids(ns) if first is None or p in first]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, FileNotFoundError):
                    name = _command_line(pid)
                    os.kill(pid, signal.SIGKILL)
                    killed.setdefault(pid, f"{pid} ({name})")
            time.sleep(0.1)
        what = "the worker processes" if self.what == "workers" else "every process"
        print(f"cluster: fault: SIGKILLed {what} of host{self.host + 1}: "
              f"{'; '.join(killed.values())}", flush=True)
        if self.what == "pod":
            launcher.wait()
            print(f"cluster: fault: host{self.host + 1}'s pod recreated: its command starts "
                  "again", flush=True)
            self.launchers.start(self.host)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--enter":
        return enter_host(argv[1], Path(argv[2]), argv[3:])
    args = parse_args(argv)
    try:
        check_tools(args.link)
    except Refused as exc:
        print(f"cluster: refused: {exc}", file=sys.stderr)
        return REFUSED
    for ns in reap_stale():
        print(f"cluster: deleted {ns}, left behind by a run that was killed", file=sys.stderr)
    cluster = Cluster(args.hosts, args.subnet)
    procs: list[subprocess.Popen[bytes]] = []

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # Also SIGINT: a shell starts background jobs with it ignored, and Ctrl-C
    # must tear down in every case.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    try:
        try:
            cluster.create(args.link, args.loopback_hostname,
                           [p.dns_names for p in args.pods.pods] if args.pods else None)
        except Refused as exc:
            print(f"cluster: refused: {exc}", file=sys.stderr)
            return REFUSED
        except RuntimeError as exc:
            print(f"cluster: refused: cannot make the network namespaces: {exc}",
                  file=sys.stderr)
            return REFUSED
        hosts = ", ".join(f"{n} {a}" for n, a in zip(cluster.names, cluster.addrs, strict=True))
        shaped = f"tbf {args.link_text} each way" if args.link else "unshaped"
        print(f"cluster: {args.hosts} hosts x {args.ranks_per_host} ranks ({args.launcher}), "
              f"link {shaped}: {hosts}", flush=True)
        env = clean_env(args)
        env["PATH"] = f"{cluster.ssh()}{os.pathsep}{env['PATH']}"  # ssh reaches the hosts
        started = (pod_commands(args, cluster) if args.pods else
                   [(ns, cmd, {}) for ns, cmd in commands(args, cluster)])
        launchers = Launchers(started, env, procs)
        if args.kill:
            launchers.fault = Fault(args.kill, args.kill_host - 1, args.kill_when, launchers)
        for i in range(len(started)):
            launchers.start(i)
        deadline = time.monotonic() + args.timeout
        codes = []
        for i in range(len(started)):
            try:
                codes.append(launchers.wait(i, max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                print(f"cluster: timed out after {args.timeout:g}s", file=sys.stderr)
                return 124
        pumps = launchers.pumps
        for pump in pumps:
            pump.join(timeout=5)
        if args.link:
            print(f"cluster: link bytes: {cluster.link_bytes()}", flush=True)
        print(f"cluster: launchers exited with {codes}", flush=True)
        return max(codes, key=abs) if any(codes) else 0
    except KeyboardInterrupt:
        print("cluster: interrupted; tearing down", file=sys.stderr)
        return 130
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        cluster.close()


if __name__ == "__main__":
    sys.exit(main())
