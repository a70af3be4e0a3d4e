"""Horovod's Ray API on dp_plugin: ``from dp_plugin.ray import RayExecutor``.

A Horovod-on-Ray script runs with its import changed::

    from dp_plugin.ray import RayExecutor          # was: from horovod.ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, num_workers=4, cpus_per_worker=1, use_gpu=False)
    executor.start()
    results = executor.run(train, kwargs={"epochs": 2})   # train calls hvd.init() itself
    executor.shutdown()

Ray Train v2's trainer with dp_plugin as its backend is ``dp_plugin.ray.train``
(``HorovodTrainer``, ``BackendConfig``).

Needs Ray (``pip install 'dp_plugin[ray]'``). Importing this package imports
ray; the core (``import dp_plugin``) never does.
"""

from dp_plugin.ray.executor import RayExecutor, RaySettings

__all__ = ["RayExecutor", "RaySettings"]
