#!/usr/bin/env python3
"""Two hosts on one machine: run the BERT example across two network namespaces.

Makes two network namespaces joined by a veth pair, each with an address of
its own (``10.211.0.1`` = host A, ``10.211.0.2`` = host B by default, see
``--subnet``), and starts one launcher per "host" inside them, exactly as on
two real machines:

- ``torchrun`` (default): c10d rendezvous, ``--nnodes 2``, the rendezvous
  store on host A (``--rdzv-endpoint 10.211.0.1:PORT``, ``is_host`` set
  explicitly because the namespace's host name does not resolve to its
  address) and ``--local-addr`` on each host;
- ``mpirun``: MPICH's ``mpiexec -hosts A,B``; Hydra starts its proxy on each
  host through ``--launcher-exec``, which here is this script entering the
  host's namespace instead of ssh.

Everything is torn down in every case: success, failure, timeout, Ctrl-C or
SIGTERM: every process left in a namespace is killed (torchrun's workers
run in sessions of their own), then the namespace is deleted, which deletes
its end of the veth pair and the pair with it. Needs root (``ip netns
add``). No traffic leaves the two namespaces.

    sudo .venv/bin/python scripts/two_hosts.py                  # torchrun, 1 worker per host
    sudo .venv/bin/python scripts/two_hosts.py --launcher mpirun --nproc-per-host 2
    sudo .venv/bin/python scripts/two_hosts.py -- --steps 20    # arguments for the example

The documented multi-node recipe is docs/multinode.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
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
# A small model and a short run: the point is the two-host plumbing.
DEFAULT_EXAMPLE_ARGS = ["--layers", "2", "--hidden", "64", "--heads", "2", "--seq-len", "32",
                        "--vocab-size", "1000", "--global-batch", "16", "--steps", "6",
                        "--warmup-steps", "2", "--log-every", "1", "--no-progress"]
# Variables of an outer launcher: the inner launchers must not inherit them.
_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "HYDRA_", "HOROVOD_", "SLURM_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                   "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                   "MASTER_ADDR", "MASTER_PORT", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                   "GLOO_SOCKET_IFNAME"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Run examples/bert_pretrain.py across two network namespaces joined by a "
                    "veth pair, as on two hosts. Arguments after -- go to the example.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--launcher", choices=["torchrun", "mpirun"], default="torchrun",
                    help="multi-node launcher to start the job with")
    ap.add_argument("--nproc-per-host", type=int, default=1, help="workers per host")
    ap.add_argument("--subnet", default="10.211.0.0/24",
                    help="private subnet of the veth pair (host A .1, host B .2)")
    ap.add_argument("--port", type=int, default=29411, help="rendezvous port on host A")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds before the job is killed (and everything torn down)")
    ap.add_argument("--script", type=Path, default=EXAMPLE, help="training script to run")
    ap.add_argument("--enter", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    ap.add_argument("example_args", nargs=argparse.REMAINDER,
                    help="arguments for the training script (after --)")
    args = ap.parse_args(argv)
    if args.example_args and args.example_args[0] == "--":
        args.example_args = args.example_args[1:]
    if args.nproc_per_host <= 0:
        ap.error("--nproc-per-host must be > 0")
    return args


class Hosts:
    """Two namespaces, a veth pair between them; ``close()`` removes everything."""

    def __init__(self, subnet: str) -> None:
        net = ipaddress.ip_network(subnet)
        if net.num_addresses < 4:
            raise SystemExit(f"--subnet {subnet} is too small for two hosts")
        tag = f"{os.getpid() % 100000}"
        self.names = [f"dp2h-{tag}-a", f"dp2h-{tag}-b"]
        self.links = [f"dp2h{tag}a", f"dp2h{tag}b"]
        self.addrs = [str(net.network_address + 1), str(net.network_address + 2)]
        self.prefix = net.prefixlen
        self.created: list[str] = []
        self.workdir = Path(tempfile.mkdtemp(prefix="dp2h-"))

    def create(self) -> None:
        for ns in self.names:
            _ip("netns", "add", ns)
            self.created.append(ns)
        _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for ns, link, addr in zip(self.names, self.links, self.addrs, strict=True):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/{self.prefix}", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

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
        # If the pair was made but never moved into a namespace, it is still here.
        subprocess.run(["ip", "link", "del", self.links[0]], check=False, capture_output=True)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_NAMES and not k.startswith(_LAUNCHER_PREFIXES)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def commands(args: argparse.Namespace, hosts: Hosts) -> list[tuple[str, list[str]]]:
    """(namespace, command) per process to start."""
    bindir = Path(sys.executable).parent
    script = [sys.executable, str(args.script.resolve()),
              *(args.example_args or DEFAULT_EXAMPLE_ARGS)]
    if args.launcher == "torchrun":
        out = []
        for node, (ns, addr) in enumerate(zip(hosts.names, hosts.addrs, strict=True)):
            out.append((ns, [
                str(bindir / "torchrun"), "--nnodes", "2",
                "--nproc-per-node", str(args.nproc_per_host),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addrs[0]}:{args.port}",
                "--rdzv-id", f"two-hosts-{os.getpid()}",
                "--rdzv-conf", f"is_host={1 if node == 0 else 0}",
                "--local-addr", addr, "--max-restarts", "0", *script[1:],
            ]))
        return out
    # mpirun: started on host A; Hydra reaches host B through this script
    # (launcher-exec must be one executable: a two-line shell wrapper).
    enter = hosts.workdir / "enter-host"
    enter.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" '
                     '--enter "$@"\n')
    enter.chmod(0o755)
    hostlist = ",".join(f"{a}:{args.nproc_per_host}" for a in hosts.addrs)
    return [(hosts.names[0], [
        str(bindir / "mpiexec"), "-hosts", hostlist, "-launcher", "ssh",
        "-launcher-exec", str(enter), "-iface", hosts.links[0],
        "-n", str(2 * args.nproc_per_host), *script,
    ])]


def enter_host(argv: list[str]) -> int:
    """Hydra's remote start (``launcher-exec HOST COMMAND...``): run COMMAND in
    the namespace that owns HOST's address, via a shell like ssh would."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):  # ssh options Hydra passes (-x)
        i += 1
    if i >= len(argv):
        print("two_hosts --enter: no host given", file=sys.stderr)
        return 255
    host, command = argv[i], argv[i + 1:]
    for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                             check=True).stdout.split():
        addrs = subprocess.run(["ip", "-n", ns, "-o", "-4", "addr", "show"],
                               capture_output=True, text=True).stdout
        if f" {host}/" in addrs:
            return subprocess.call(["ip", "netns", "exec", ns, "sh", "-c", " ".join(command)])
    print(f"two_hosts: no namespace has address {host}", file=sys.stderr)
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
    if shutil.which("ip") is None:
        raise SystemExit("two_hosts: the `ip` command (iproute2) is not installed")
    hosts = Hosts(args.subnet)
    procs: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()
        raise KeyboardInterrupt(f"signal {signum}")

    # Also SIGINT: a shell starts background jobs with it ignored, and Ctrl-C
    # must tear down in every case.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    code = 1
    try:
        try:
            hosts.create()
        except RuntimeError as exc:
            print(f"two_hosts: cannot create the namespaces (root needed): {exc}",
                  file=sys.stderr)
            return 77
        print(f"two_hosts: host A {hosts.names[0]} {hosts.addrs[0]} <-> host B "
              f"{hosts.names[1]} {hosts.addrs[1]} ({args.launcher})", flush=True)
        env = clean_env()
        pumps = []
        for i, (ns, cmd) in enumerate(commands(args, hosts)):
            proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            procs.append(proc)
            pumps.append(threading.Thread(target=_pump, args=(proc.stdout, f"[host{'AB'[i]}] "),
                                          daemon=True))
            pumps[-1].start()
        deadline = time.monotonic() + args.timeout
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                print(f"two_hosts: timed out after {args.timeout:g}s", file=sys.stderr)
                return 124
        for pump in pumps:
            pump.join(timeout=5)
        code = max(codes, key=abs) if any(codes) else 0
        print(f"two_hosts: launchers exited with {codes}", flush=True)
        return code
    except KeyboardInterrupt:
        print("two_hosts: interrupted; tearing down", file=sys.stderr)
        return 130
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        hosts.close()


if __name__ == "__main__":
    sys.exit(main())
