"""``RayExecutor``: Horovod's Ray API (``horovod.ray.RayExecutor``) on dp_plugin.

Semantics follow Horovod 0.28's non-elastic executor:

- ``RayExecutor.create_settings(timeout_s=30, ...)`` -> settings;
- ``RayExecutor(settings, num_workers=N, cpus_per_worker=1, use_gpu=False,
  gpus_per_worker=None)`` places N workers in one placement group packed
  onto as few nodes as fit (``PACK``), or with ``num_hosts=H,
  num_workers_per_host=W`` exactly W workers on each of H distinct nodes
  (``STRICT_SPREAD``);
- ``start``, ``run``/``run_remote``, ``execute``/``execute_single`` and
  ``shutdown`` with Horovod's signatures (their docstrings say what each does).

What differs from Horovod, and why: the workers meet through dp_plugin's
own rendezvous, not Horovod's HTTP rendezvous server on the driver. The
executor gives each actor the variables a torchrun launch would (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, and
MASTER_ADDR/MASTER_PORT: rank 0's node address and a port free there), so
``hvd.init()`` inside ``fn`` is an ordinary torchrun-style init: rank 0
serves the TCPStore, the others connect, and every wait is bounded by
``DP_PLUGIN_TIMEOUT`` (``settings.timeout_s`` unless ``extra_env_vars``
sets it). Ranks are contiguous on each node (block placement, which
dp_plugin's topology assumes); Horovod numbers them in actor order. The
ssh settings exist for signature compatibility only: Ray starts the
actors, nothing is reached by ssh (Horovod uses them only to probe
interfaces). Elastic jobs (``min_workers``...) are not offered.

Failures: when a worker fails, ``run``/``execute`` wait up to
``timeout_s`` + 10 s for the others to report (dp_plugin bounds their
collectives by DP_PLUGIN_TIMEOUT, so the survivors raise dp_plugin's error
about the lost rank), then raise. The error raised is the lowest rank's
dp_plugin error when there is one (the survivors' explanation), else the
first failure; a note lists what every failed rank reported, including
"the actor died" for a worker whose process was killed. Nothing waits
forever on a dead actor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dp_plugin.errors import DPPluginError
from dp_plugin.launch.netif import free_port
from dp_plugin.ray.worker import Worker

_GRACE_S = 10.0
"""Beyond ``timeout_s``: how long the others may take to report after a failure."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RaySettings:
    """What ``RayExecutor.create_settings`` returns (Horovod's ``MiniSettings``)."""

    timeout_s: float = 30
    """Bound of every wait of the workers' rendezvous and collectives
    (exported as DP_PLUGIN_TIMEOUT); also how long survivors may take to
    report after a worker fails."""
    placement_group_timeout_s: float = 100
    """How long to wait for Ray to grant the workers' resources."""
    nics: frozenset[str] | None = None
    """Interfaces the workers may use (GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME);
    None: dp_plugin finds the one that routes to rank 0."""
    ssh_identity_file: str | None = None
    """Accepted for Horovod compatibility; unused (Ray starts the workers)."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "placement_group_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"RaySettings {name}={value!r}: expected a number of seconds "
                                 "> 0, e.g. RayExecutor.create_settings(timeout_s=30)")


class RayExecutor:
    """Runs functions on a group of Ray actors that form one dp_plugin job.

    Distributed contract: ``run``/``execute`` call ``fn`` on every worker at
    once; ``fn`` must itself be collective-safe (every rank calls
    ``hvd.init()`` and the same collectives). ``execute_single`` runs on rank
    0 alone, so it must not call collectives. Not thread-safe; one call at a
    time.
    """

    @classmethod
    def create_settings(cls, timeout_s: float = 30, ssh_identity_file: str | None = None,
                        ssh_str: str | None = None, placement_group_timeout_s: float = 100,
                        nics: set[str] | None = None) -> RaySettings:
        """Horovod's signature; ``ssh_str`` is ignored like ``ssh_identity_file``
        (no ssh here) and is never written to disk."""
        del ssh_str
        return RaySettings(timeout_s=timeout_s, ssh_identity_file=ssh_identity_file,
                           placement_group_timeout_s=placement_group_timeout_s,
                           nics=frozenset(nics) if nics else None)

    def __init__(self, settings: RaySettings, num_workers: int | None = None,
                 num_hosts: int | None = None, num_workers_per_host: int = 1,
                 cpus_per_worker: int = 1, use_gpu: bool = False,
                 gpus_per_worker: int | None = None, use_current_placement_group: bool = True,
                 **elastic: Any) -> None:
        given = sorted(k for k, v in elastic.items() if v is not None)  # min_workers, ...
        if given:
            raise ValueError(
                f"dp_plugin.ray.RayExecutor runs static jobs only; elastic arguments {given} "
                "are not supported: pass num_workers (or num_hosts and num_workers_per_host)"
            )
        if (num_workers is None) == (num_hosts is None):
            raise ValueError(
                f"RayExecutor got num_workers={num_workers!r} and num_hosts={num_hosts!r}: pass "
                "exactly one (num_workers=N packs N workers; num_hosts=H with "
                "num_workers_per_host=W puts W workers on each of H nodes)"
            )
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host),
                            ("cpus_per_worker", cpus_per_worker),
                            ("gpus_per_worker", gpus_per_worker)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < (0 if name == "cpus_per_worker" else 1)):
                raise ValueError(f"RayExecutor {name}={value!r}: expected a positive integer")
        if gpus_per_worker is not None and not use_gpu:
            raise ValueError(f"RayExecutor gpus_per_worker={gpus_per_worker} needs use_gpu=True")
        self.settings = settings
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.num_workers = num_workers if num_workers is not None else (
            int(num_hosts or 0) * num_workers_per_host)
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.workers: list[Any] = []
        """The actors, in rank order (after ``start``)."""
        self.nodes: list[str] = []
        """Each rank's node address, in rank order."""
        self._placement_group: Any = None
        self._owns_placement_group = False

    # -- lifetime ------------------------------------------------------------------
    def start(self, executable_cls: type | None = None,
              executable_args: Sequence[Any] | None = None,
              executable_kwargs: Mapping[str, Any] | None = None,
              extra_env_vars: Mapping[str, str] | None = None) -> None:
        """Start the workers (collective over none: only the driver calls it).

        Each worker gets the launcher variables of its rank, then
        ``extra_env_vars``, then builds ``executable_cls(*args, **kwargs)``.
        """
        import ray

        if self.workers:
            raise RuntimeError("RayExecutor.start() was already called; call shutdown() first")
        if not ray.is_initialized():
            ray.init()
        try:
            actors = self._create_actors(ray)
            placed = ray.get([a.node.remote() for a in actors],
                             timeout=self.settings.placement_group_timeout_s)
            order, env = self._launch_env(ray, actors, placed)
            self.workers = [actors[i] for i in order]
            self.nodes = [placed[i][1] for i in order]
            common = {"DP_PLUGIN_TIMEOUT": f"{self.settings.timeout_s:g}"}
            if self.settings.nics:
                names = ",".join(sorted(self.settings.nics))
                common.update(GLOO_SOCKET_IFNAME=names, NCCL_SOCKET_IFNAME=names)
            ray.get([w.set_env.remote({**common, **env[r], **(extra_env_vars or {})})
                     for r, w in enumerate(self.workers)])
            ray.get([w.start_executable.remote(executable_cls, list(executable_args or []),
                                               dict(executable_kwargs or {}))
                     for w in self.workers])
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """End the workers and free their placement group (if this executor made it)."""
        import ray

        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers, self.nodes = [], []
        if self._placement_group is not None and self._owns_placement_group:
            ray.util.remove_placement_group(self._placement_group)
        self._placement_group = None

    def _create_actors(self, ray: Any) -> list[Any]:
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resources = {"CPU": self.cpus_per_worker, "GPU": self.gpus_per_worker}
        resources = {k: v for k, v in resources.items() if v}
        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:  # inside Tune or another placement group: use its bundles
            self._placement_group, self._owns_placement_group = current, False
            bundle_of = [-1] * self.num_workers
        else:
            if self.num_hosts is not None:
                per_host = {k: v * self.num_workers_per_host for k, v in resources.items()}
                bundles, strategy = [per_host] * self.num_hosts, "STRICT_SPREAD"
                bundle_of = [i // self.num_workers_per_host for i in range(self.num_workers)]
            else:
                bundles, strategy = [resources] * self.num_workers, "PACK"
                bundle_of = list(range(self.num_workers))
            self._placement_group = placement_group(bundles, strategy=strategy)
            self._owns_placement_group = True
            try:
                ray.get(self._placement_group.ready(),
                        timeout=self.settings.placement_group_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise DPPluginError(
                    f"Ray did not grant {len(bundles)} bundle(s) of {bundles[0]} ({strategy}) "
                    f"within placement_group_timeout_s={self.settings.placement_group_timeout_s:g}"
                    f" s; the cluster has {ray.cluster_resources()}. Ask for fewer workers or "
                    "resources, or add nodes"
                ) from None
        remote = ray.remote(Worker)
        return [
            remote.options(
                num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._placement_group,
                    placement_group_bundle_index=bundle_of[i],
                    placement_group_capture_child_tasks=False),
            ).remote()
            for i in range(self.num_workers)
        ]

    def _launch_env(self, ray: Any, actors: list[Any], placed: list[tuple[str, str]]
                    ) -> tuple[list[int], list[dict[str, str]]]:
        """Rank order of the actors (grouped by node, nodes in order of first
        actor) and each rank's launcher variables."""
        node_order = list(dict.fromkeys(node for node, _ip in placed))
        order = sorted(range(len(actors)), key=lambda i: (node_order.index(placed[i][0]), i))
        port = ray.get(actors[order[0]].call.remote(free_port, [], {}))
        master = placed[order[0]][1]
        env: list[dict[str, str]] = []
        cuda = self._visible_devices(ray, actors, placed) if self.use_gpu else {}
        for rank, i in enumerate(order):
            node = placed[i][0]
            on_node = [j for j in order if placed[j][0] == node]
            e = {
                "RANK": rank, "WORLD_SIZE": len(actors), "LOCAL_RANK": on_node.index(i),
                "LOCAL_WORLD_SIZE": len(on_node), "GROUP_RANK": node_order.index(node),
                "GROUP_WORLD_SIZE": len(node_order), "MASTER_ADDR": master, "MASTER_PORT": port,
            }
            if node in cuda:
                e["CUDA_VISIBLE_DEVICES"] = cuda[node]
            env.append({k: str(v) for k, v in e.items()})
        return order, env

    def _visible_devices(self, ray: Any, actors: list[Any], placed: list[tuple[str, str]]
                         ) -> dict[str, str]:
        """Per node, every GPU its workers were given, in rank order: Ray shows
        each actor its own GPUs only, and the engine picks ``cuda:local_rank``
        (what Horovod's executor does too)."""
        ids = ray.get([a.execute.remote(lambda _: ray.get_gpu_ids()) for a in actors])
        per_node: dict[str, list[str]] = {}
        for (node, _ip), gpus in zip(placed, ids, strict=True):
            per_node.setdefault(node, []).extend(str(g) for g in gpus)
        return {node: ",".join(gpus) for node, gpus in per_node.items()}

    # -- calls ---------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
            kwargs: Mapping[str, Any] | None = None,
            callbacks: Sequence[Callable[..., Any]] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker; the results in rank order.
        ``callbacks`` (Horovod's rank-0 log hooks) are not supported."""
        self._no_callbacks(callbacks)
        return self._gather(self.run_remote(fn, args, kwargs), "run")

    def run_remote(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                   kwargs: Mapping[str, Any] | None = None) -> list[Any]:
        """``run`` without waiting: one ObjectRef per worker, in rank order."""
        return [w.call.remote(fn, list(args or []), dict(kwargs or {})) for w in self._started()]

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Sequence[Callable[..., Any]] | None = None) -> list[Any]:
        """``fn(executable)`` on every worker; the results in rank order."""
        self._no_callbacks(callbacks)
        return self._gather([w.execute.remote(fn) for w in self._started()], "execute")

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only."""
        return self._gather([self._started()[0].execute.remote(fn)], "execute_single")[0]

    def _started(self) -> list[Any]:
        if not self.workers:
            raise RuntimeError("RayExecutor has no workers: call start() first "
                               "(or again after shutdown())")
        return self.workers

    @staticmethod
    def _no_callbacks(callbacks: Sequence[Callable[..., Any]] | None) -> None:
        if callbacks:
            raise ValueError("RayExecutor callbacks (Horovod's rank-0 log queue) are not "
                             "supported by dp_plugin.ray; return values from fn instead")

    def _gather(self, refs: list[Any], what: str) -> list[Any]:
        """Every result, or the most telling failure once every worker has
        reported or the grace period after the first failure has passed."""
        import ray

        pending = dict(zip(refs, range(len(refs)), strict=True))
        results: list[Any] = [None] * len(refs)
        failures: dict[int, BaseException] = {}
        deadline: float | None = None
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                break  # the grace period is over
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
                    failures[rank] = exc
                    if deadline is None:
                        deadline = time.monotonic() + self.settings.timeout_s + _GRACE_S
        if not failures:
            return results
        for rank in pending.values():  # still running after the grace period: stop them
            ray.kill(self.workers[rank], no_restart=True)
        raise self._failure(failures, sorted(pending.values()), what, len(refs))

    def _failure(self, failures: dict[int, BaseException], stuck: list[int], what: str,
                 count: int) -> BaseException:
        import ray

        # What each rank raised: the exception in its function, else Ray's own.
        causes = {rank: getattr(failures[rank], "cause", None) or failures[rank]
                  for rank in sorted(failures)}
        lines = []
        for rank, cause in causes.items():
            node = self.nodes[rank] if rank < len(self.nodes) else "?"
            if isinstance(failures[rank], ray.exceptions.RayActorError):
                lines.append(f"rank {rank} (node {node}): its actor died (the process was "
                             "killed, ran out of memory, or its node was lost)")
            else:
                first_line = (str(cause).strip().splitlines() or [""])[0]
                lines.append(f"rank {rank} (node {node}): {type(cause).__name__}: {first_line}")
        lines += [f"rank {r}: still running {self.settings.timeout_s + _GRACE_S:g} s after the "
                  "first failure; its actor was killed" for r in stuck]
        chosen = next((c for c in causes.values() if isinstance(c, DPPluginError)),
                      causes[min(causes)])
        chosen.add_note(
            f"dp_plugin.ray: RayExecutor.{what} on {count} worker(s) failed on rank(s) "
            f"{sorted(failures)}:\n  " + "\n  ".join(lines)
        )
        return chosen
