"""A real SLURM cluster of namespace hosts, for the scheduler tests.

``ensure_installed()`` installs Debian's ``slurm-wlm`` and ``munge`` with
apt-get where they are missing (the CI machine is root with apt-get); it
returns why not where that cannot be done, and the tests skip saying so.

``SlurmCluster(hosts, workdir)`` starts, with a configuration of its own in
``workdir`` (nothing under /etc is read or written):

- ``munged`` (its own key, socket, pid and log files) and ``slurmctld`` in
  the root namespace, listening on the bridge address;
- one ``slurmd -N <host>`` inside each namespace host, ``NodeAddr=`` its
  address, ``CPUs=2``: ``srun -N 2 -n 4`` spans two "hosts".

``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none``: no
cgroups needed. ``InactiveLimit=20``: an allocation whose srun was killed
(a test's deadline) is released after 20 s; with 0 it held its node
forever and every later job waited behind it (seen here).
``MinJobAge=0``: finished jobs' records are never purged, and ``sbatch
--wait`` polls every 2 s (it first sleeps 2 s, then 4 times longer while
its sleep is under half of MinJobAge: 2 s, then 8 s each time with
``MinJobAge=10``; ``sbatch --wait`` of a 3 s job took 10.1 s with 10, 4.3 s
with 0). Every daemon
runs in the foreground as our child and is stopped by its pid; the
slurmds' namespaces are emptied by ``Hosts.close``.
``close()`` is idempotent and registered with ``atexit``.

Client commands (``srun``, ``sbatch``, ``sinfo``) find the cluster through
``SLURM_CONF``: ``env()`` gives the environment to run them with.
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
from pathlib import Path

from tests.schedulers.netns import Hosts

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch")
PACKAGES = ("slurm-wlm", "munge")


def ensure_installed() -> str | None:
    """Install SLURM and munge where missing; why not, or None when present."""
    if all(shutil.which(d) or shutil.which(d, path="/usr/sbin") for d in DAEMONS):
        return None
    if shutil.which("apt-get") is None:
        return "slurm-wlm/munge are not installed and there is no apt-get to install them"
    if os.geteuid() != 0:
        return "slurm-wlm/munge are not installed and apt-get needs root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update"], capture_output=True, env=env, timeout=900)
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        return f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-500:]}"
    return None


def _sbin(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
    if found is None:
        raise FileNotFoundError(name)
    return found


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class SlurmCluster:
    """munged + slurmctld (root namespace) and a slurmd in each host."""

    def __init__(self, hosts: Hosts, workdir: Path, cpus: int = 2) -> None:
        self.hosts = hosts
        self.dir = workdir
        self.cpus = cpus
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._closed = False
        atexit.register(self.close)
        try:
            self._write_config()
            self._start()
        except BaseException:
            self.close()
            raise

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def nodes(self) -> list[str]:
        return [h.name for h in self.hosts.hosts]

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a client command (srun, sbatch, sinfo)."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def _write_config(self) -> None:
        d = self.dir
        (d / "state").mkdir(parents=True, exist_ok=True)
        for h in self.hosts.hosts:
            (d / f"spool-{h.name}").mkdir(exist_ok=True)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = d / "munge.socket"
        ctl = self.hosts.bridge_address
        nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.address} CPUs={self.cpus} "
                          "State=UNKNOWN" for h in self.hosts.hosts)
        self.conf.write_text(f"""\
ClusterName=dpsched
SlurmctldHost={socket.gethostname().split('.')[0]}({ctl})
SlurmctldPort={_free_port(ctl)}
SlurmdPort={_free_port(ctl)}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
InactiveLimit=20
KillWait=5
MinJobAge=0
{nodes}
PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / f"{name}.out", "wb")  # noqa: SIM115 (the child keeps it)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self._procs.append((name, proc))

    def _start(self) -> None:
        d = self.dir
        self._spawn("munged", [
            _sbin("munged"), "-F", "--force", f"--socket={self.munge_socket}",
            f"--key-file={d / 'munge.key'}", f"--pid-file={d / 'munged.pid'}",
            f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}",
        ])
        self._wait_for(lambda: self.munge_socket.exists(), "munged's socket")
        self._spawn("slurmctld", [_sbin("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf)])
        self._wait_for(lambda: self._run("scontrol", "ping").returncode == 0,
                       "slurmctld to answer `scontrol ping`")
        for h in self.hosts.hosts:
            self._spawn(f"slurmd-{h.name}",
                        h.command(_sbin("slurmd"), "-D", "-N", h.name, "-f", str(self.conf)))
        self._wait_for(self._nodes_idle, "every node to be idle in `sinfo`", limit=60)

    def _run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, env=self.env(),
                              timeout=30)

    def _nodes_idle(self) -> bool:
        out = self._run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split()
        states = dict(zip(out[::2], out[1::2], strict=False))
        return all(states.get(n) == "idle" for n in self.nodes)

    def _wait_for(self, ready: object, what: str, limit: float = 30.0) -> None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            for name, proc in self._procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting "
                                       f"for {what}:\n{self.logs()}")
            if ready():  # type: ignore[operator]
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out after {limit:g} s waiting for {what}:\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for f in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            text = f.read_text(errors="replace")[-3000:]
            parts.append(f"--- {f.name}\n{text}")
        return "\n".join(parts)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for _name, proc in reversed(self._procs):  # slurmds first, munged last
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for _name, proc in reversed(self._procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for h in self.hosts.hosts:  # slurmstepd and tasks a killed slurmd left
            self.hosts.kill_all(h.namespace)
