"""A real Ray cluster of two namespace hosts, for the scheduler tests.

``ray start --head`` runs inside host 0's namespace and ``ray start
--address=<head>:<port>`` inside host 1's, each with ``--num-cpus 1`` (so
that two one-CPU workers land one on each host) and fixed ports picked
free up front: a raylet that must wait for its agents to write their port
files gives up after ~30 s, which a loaded 2-core machine can exceed
(seen here: "Timed out waiting for file .../metrics_agent_port_..."), and
the agents' registration timeout is raised for the same reason. Even
so, the raylet waits a fixed ~30 s for its agents' port files, which the
agents (importing Ray's dashboard modules) missed on this machine under a
load average of 20 (75 s; `import ray` alone took 17 s of wall time for
1.2 s of CPU). The kernel schedules by session (autogroup), so ``nice``
does not help; the daemons start in a session of their own whose
autogroup has nice -15 (``/proc/<pid>/autogroup``; the tests are root
anyway: `import ray` then takes 1.3 s), and are set back to nice 0 once
the cluster is up: the tests then compete for the CPUs like everything
else.

A driver joins the cluster by running inside host 0 (``driver()`` gives
its command line) with ``RAY_ADDRESS=<head>:<port>`` (``address``).
``close()`` stops everything by killing the processes in the two
namespaces (``Hosts.kill_all``: only ours live there), never ``ray stop``,
which would stop every Ray process on the machine; idempotent and
registered with ``atexit``.

Token authentication is disabled (``RAY_AUTH_MODE=disabled``): the
cluster's addresses exist only inside the test's namespaces.

Ray Train v2's controller, which the Train tests' fits run under, is told
to poll its workers every 0.2 s instead of 2 s (a fit's end, a dead worker
and a restarted group are each seen up to 1.8 s sooner, several times per
fit) and to start no preemption watcher (one more actor process per worker
group, polling for node drains that no test makes). Neither changes what
a fit computes or how a failure is handled.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.schedulers.netns import Hosts

ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_agent_register_timeout_ms": "180000",
    "RAY_worker_register_timeout_seconds": "180",
    "RAY_raylet_start_wait_time_s": "180",
    "RAY_DEDUP_LOGS": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}


def unavailable() -> str | None:
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        return f"ray is not installed ({exc}); `pip install 'dp_plugin[ray]'`"
    return None


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class RayCluster:
    """Head in host 0, one worker node in host 1."""

    def __init__(self, hosts: Hosts, workdir: Path) -> None:
        self.hosts = hosts
        self.dir = workdir
        self._closed = False
        atexit.register(self.close)
        head, other = hosts.hosts[0], hosts.hosts[1]
        self.port = _free_ports(1)[0]
        self.address = f"{head.address}:{self.port}"
        try:
            self._start(head, ["--head", f"--port={self.port}", "--include-dashboard=false",
                               f"--temp-dir={workdir / 'ray'}"])
            self._start(other, [f"--address={self.address}"])
            self._wait_for_nodes(2)
            for h in hosts.hosts:
                for pid in hosts.pids(h.namespace):
                    with contextlib.suppress(OSError):
                        Path(f"/proc/{pid}/autogroup").write_text("0")
        except BaseException:
            self.close()
            raise

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, **ENV, **extra}

    def _start(self, host: object, args: list[str]) -> None:
        agent, listen, export, runtime_env, manager = _free_ports(5)
        ray = str(Path(sys.executable).with_name("ray"))
        argv = host.command(  # type: ignore[attr-defined]
            "setsid", "sh", "-c", 'echo -15 > /proc/$$/autogroup && exec "$@"', "sh",
            ray, "start", *args, "--num-cpus=1", "--num-gpus=0",
            f"--node-ip-address={host.address}",  # type: ignore[attr-defined]
            f"--dashboard-agent-grpc-port={agent}", f"--dashboard-agent-listen-port={listen}",
            f"--metrics-export-port={export}", f"--runtime-env-agent-port={runtime_env}",
            f"--node-manager-port={manager}", "--disable-usage-stats",
        )
        name = host.name  # type: ignore[attr-defined]
        with open(self.dir / f"ray-start-{name}.log", "wb") as log:
            done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                  timeout=240)
        if done.returncode != 0:
            raise RuntimeError(f"`ray start` on {name} exited with {done.returncode}:\n"
                               + (self.dir / f"ray-start-{name}.log").read_text()[-3000:])

    def driver(self, *argv: str) -> list[str]:
        """``argv`` run as a driver inside the head's host."""
        return self.hosts.hosts[0].command(*argv)

    def _wait_for_nodes(self, count: int, limit: float = 120.0) -> None:
        probe = (f"import ray; ray.init(address='{self.address}', logging_level='ERROR'); "
                 "print(sum(1 for n in ray.nodes() if n['Alive']))")
        deadline = time.monotonic() + limit
        last = ""
        while time.monotonic() < deadline:
            done = subprocess.run(self.driver(sys.executable, "-c", probe), capture_output=True,
                                  text=True, env=self.env(), timeout=120)
            last = done.stdout + done.stderr
            if done.returncode == 0 and done.stdout.strip().splitlines()[-1:] == [str(count)]:
                return
            time.sleep(1)
        raise RuntimeError(f"the Ray cluster did not reach {count} alive nodes in "
                           f"{limit:g} s; last probe said:\n{last[-2000:]}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for h in self.hosts.hosts:
            self.hosts.kill_all(h.namespace)
