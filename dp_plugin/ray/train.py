"""dp_plugin as a Ray Train v2 backend: what ``HorovodTrainer`` was.

Ray Train v2 (the default from Ray 2.50) refuses ``HorovodTrainer``. Its
extension point is a ``BackendConfig``/``Backend`` pair that
``DataParallelTrainer`` calls around the worker group; this module is that
pair for dp_plugin, and ``HorovodTrainer`` is ``DataParallelTrainer`` with it
as the default::

    from dp_plugin.ray.train import HorovodTrainer     # was: from ray.train.horovod import ...

    trainer = HorovodTrainer(train_loop, train_loop_config={"lr": 0.1},
                             scaling_config=ScalingConfig(num_workers=4),
                             run_config=RunConfig(failure_config=FailureConfig(max_failures=2)))
    result = trainer.fit()

or, with Ray's own trainer class::

    DataParallelTrainer(train_loop, backend_config=dp_plugin.ray.train.BackendConfig(),
                        scaling_config=ScalingConfig(num_workers=4))

What the backend does, each time Ray (re)starts the worker group:

- ``on_start``: gives every worker the variables a torchrun launch would
  (``RANK``/``WORLD_SIZE`` = Ray Train's world rank and size; ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``/``GROUP_WORLD_SIZE`` from the
  workers' Ray node ids, so the ranks of one node share memory and the
  hierarchical all-reduce sees the nodes; ``MASTER_ADDR``/``MASTER_PORT`` =
  rank 0's node and a port free there), then runs ``dp_plugin.torch.init()``
  on every worker at once. The training function may call ``hvd.init()``
  again, as a Horovod script does: it returns at once.
- ``on_shutdown``: ``hvd.shutdown()`` on every worker still alive.

Checkpoints and metrics are Ray Train's (``ray.train.report``,
``ray.train.get_checkpoint``); a worker that dies fails the attempt, and
Ray's ``FailureConfig`` decides whether the group is restarted, in which case
``on_start`` runs again on the new workers and the loop resumes from its
last reported checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray.train.backend import Backend as _RayBackend
from ray.train.backend import BackendConfig as _RayBackendConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from dp_plugin.launch.netif import free_port


@dataclass
class BackendConfig(_RayBackendConfig):
    """dp_plugin on every worker of a Ray Train v2 ``DataParallelTrainer``.

    ``env``: extra variables for every worker before ``init()`` (e.g.
    ``{"DP_PLUGIN_ENGINE": "gloo"}``); dp_plugin's own settings come from the
    workers' environment as under any launcher (docs/configuration.md).
    """

    env: Mapping[str, str] | None = None

    @property
    def backend_cls(self) -> type[_RayBackend]:
        return _Backend

    @property
    def framework(self) -> str:
        return "dp_plugin"

    def to_dict(self) -> dict[str, Any]:
        return {"env": dict(self.env or {})}


def launch_env(workers: list[Any], port: int) -> list[dict[str, str]]:
    """Each worker's launcher variables, in the worker group's order (Ray
    Train's world ranks), from the workers' ``distributed_context`` and the
    node address of rank 0."""
    contexts = [w.distributed_context for w in workers]
    nodes = len({c.node_rank for c in contexts})
    master = next(w for w in workers if w.distributed_context.world_rank == 0).metadata.node_ip
    return [{
        "RANK": str(c.world_rank), "WORLD_SIZE": str(c.world_size),
        "LOCAL_RANK": str(c.local_rank), "LOCAL_WORLD_SIZE": str(c.local_world_size),
        "GROUP_RANK": str(c.node_rank), "GROUP_WORLD_SIZE": str(nodes),
        "MASTER_ADDR": master, "MASTER_PORT": str(port),
    } for c in contexts]


def _start(env: Mapping[str, str]) -> None:
    os.environ.update(env)
    import dp_plugin.torch as hvd

    hvd.init()


def _stop() -> None:
    import dp_plugin.torch as hvd

    if hvd.is_initialized():
        hvd.shutdown()


class _Backend(_RayBackend):
    """What Ray Train calls around the worker group (module docstring)."""

    # Every worker of a node sees every GPU given to the node's workers, so the
    # engine's cuda:LOCAL_RANK is the worker's own (what Ray's torch backend does).
    share_cuda_visible_devices = True

    def on_start(self, worker_group: Any, backend_config: _RayBackendConfig) -> None:
        workers = worker_group.get_workers()
        rank0 = next(i for i, w in enumerate(workers) if w.distributed_context.world_rank == 0)
        port = worker_group.execute_single(rank0, free_port)
        extra = dict(backend_config.env or {}) if isinstance(backend_config, BackendConfig) else {}
        refs = [worker_group.execute_single_async(i, _start, {**extra, **env})
                for i, env in enumerate(launch_env(workers, port))]
        import ray

        ray.get(refs)  # init() is collective: all at once, each raising its own error

    def on_shutdown(self, worker_group: Any, backend_config: _RayBackendConfig) -> None:
        worker_group.execute(_stop)


class HorovodTrainer(DataParallelTrainer):
    """Ray Train v2's ``DataParallelTrainer`` with dp_plugin as its backend:
    the drop-in for ``ray.train.horovod.HorovodTrainer``, which Ray Train v2
    refuses. Every argument is ``DataParallelTrainer``'s; ``backend_config``
    defaults to ``BackendConfig()`` and must be one (Horovod's own
    ``HorovodConfig`` has no meaning here)."""

    def __init__(self, train_loop_per_worker: Any, *,
                 backend_config: BackendConfig | None = None, **kwargs: Any) -> None:
        if backend_config is not None and not isinstance(backend_config, BackendConfig):
            raise TypeError(
                f"backend_config={type(backend_config).__name__}(...): dp_plugin's trainer "
                "takes dp_plugin.ray.train.BackendConfig (or none); settings such as "
                "Horovod's timeout go to the workers' DP_PLUGIN_* variables, e.g. "
                "BackendConfig(env={'DP_PLUGIN_TIMEOUT': '600'})")
        super().__init__(train_loop_per_worker, backend_config=backend_config or BackendConfig(),
                         **kwargs)
