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
  entering the host's namespace instead of ssh.

A command whose first word ends in ``.py`` is run with this Python. Every
rank sees ``DP_CLUSTER_HOSTS``, ``DP_CLUSTER_RANKS_PER_HOST`` and
``DP_CLUSTER_LINK_BPS`` (the shaped rate in bits/s, 0 when unshaped), so a
benchmark can report the share of the link it reached.

Teardown on every exit path (success, failure, ``--timeout``, an exception,
Ctrl-C, SIGTERM, SIGHUP): every process left in a namespace is killed, then
the namespaces are deleted, which deletes the veth pairs, the bridge and the
qdiscs with them. Every name carries the prefix ``dpc-<pid>-``; a run killed
with SIGKILL (which no handler sees) leaves them, and the next run deletes
the namespaces whose pid is gone, with what is left inside. Needs root
(``ip netns add``) and ``tc`` with the ``tbf`` qdisc; where either is
missing it refuses with exit status 77 and says what is missing.

    sudo .venv/bin/python scripts/cluster.py --hosts 2 --ranks-per-host 2 --link 1gbit \\
        -- examples/bert_pretrain.py --steps 20 --no-progress
    sudo .venv/bin/python scripts/cluster.py --launcher mpirun --hosts 3 --link 500mbit

The documented recipe is docs/multinode.md ("Rehearse it on one machine").
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

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
    ap.add_argument("--launcher", choices=["torchrun", "mpirun"], default="torchrun",
                    help="multi-node launcher to start the job with")
    ap.add_argument("--subnet", default="10.212.0.0/24",
                    help="private subnet of the hosts (host i gets address i)")
    ap.add_argument("--port", type=int, default=29412, help="rendezvous port on host 1")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds before the job is killed (and everything torn down)")
    ap.add_argument("command", nargs=argparse.REMAINDER,
                    help="command for every rank, after -- (default: a short BERT run)")
    args = ap.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    args.command = args.command or list(DEFAULT_COMMAND)
    if args.command[0].endswith(".py"):
        args.command = [sys.executable, *args.command]
    if args.hosts < 1 or args.ranks_per_host < 1:
        ap.error(f"--hosts {args.hosts} and --ranks-per-host {args.ranks_per_host} must be >= 1")
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

    def create(self, rate_bps: int) -> None:
        for ns in [self.switch, *self.names]:
            _run("ip", "netns", "add", ns)
            self.created.append(ns)
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
    # mpirun: started on host 1; Hydra reaches the others through this script
    # (launcher-exec must be one executable: a two-line shell wrapper).
    enter = cluster.workdir / "enter-host"
    enter.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" '
                     '--enter "$@"\n')
    enter.chmod(0o755)
    hostlist = ",".join(f"{a}:{args.ranks_per_host}" for a in cluster.addrs)
    return [(cluster.names[0], [
        str(bindir / "mpiexec"), "-hosts", hostlist, "-launcher", "ssh",
        "-launcher-exec", str(enter), "-iface", HOST_IFACE,
        "-n", str(args.hosts * args.ranks_per_host), *args.command,
    ])]


def enter_host(argv: list[str]) -> int:
    """Hydra's remote start (``launcher-exec HOST COMMAND...``): run COMMAND in
    the namespace that owns HOST's address, via a shell like ssh would."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):  # ssh options Hydra passes (-x)
        i += 1
    if i >= len(argv):
        print("cluster --enter: no host given", file=sys.stderr)
        return 255
    host, command = argv[i], argv[i + 1:]
    for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                             check=True).stdout.split():
        if not ns.startswith("dpc-"):
            continue
        addrs = subprocess.run(["ip", "-n", ns, "-o", "-4", "addr", "show"],
                               capture_output=True, text=True).stdout
        if f" {host}/" in addrs:
            return subprocess.call(["ip", "netns", "exec", ns, "sh", "-c", " ".join(command)])
    print(f"cluster: no namespace has address {host}", file=sys.stderr)
    return 255


def _pump(stream: object, prefix: str) -> None:
    for line in iter(stream.readline, b""):  # type: ignore[attr-defined]
        sys.stdout.write(f"{prefix}{line.decode(errors='replace')}")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--enter":
        return enter_host(argv[1:])
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
            cluster.create(args.link)
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
        pumps = []
        for i, (ns, cmd) in enumerate(commands(args, cluster)):
            proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            procs.append(proc)
            pumps.append(threading.Thread(target=_pump, args=(proc.stdout, f"[host{i + 1}] "),
                                          daemon=True))
            pumps[-1].start()
        deadline = time.monotonic() + args.timeout
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                print(f"cluster: timed out after {args.timeout:g}s", file=sys.stderr)
                return 124
        for pump in pumps:
            pump.join(timeout=5)
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
