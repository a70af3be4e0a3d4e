"""dp_plugin.lightning: ``Trainer(strategy="horovod")`` for Lightning 2.x.

Importing this package registers ``HorovodStrategy`` in Lightning's strategy
registry as ``"horovod"`` (the name Lightning 1.x used) and ``"dp_plugin"``,
for ``lightning.pytorch`` and for ``pytorch_lightning``, whichever are
installed; import it before building the ``Trainer``::

    import dp_plugin.lightning  # noqa: F401 - registers strategy="horovod"
    trainer = lightning.Trainer(strategy="horovod", ...)

It also registers ``HorovodFabricStrategy`` (``fabric.py``) in Fabric's
registry under the same names: ``Fabric(strategy="horovod")``.

``HorovodStrategy`` is ``lightning.pytorch``'s class (``pytorch_lightning``'s
when only that package is installed); ``PLHorovodStrategy`` is
``pytorch_lightning``'s. Both are ``strategy.HorovodStrategyBody`` in front of
that package's ``ParallelStrategy``. See docs/lightning.md.
"""

from __future__ import annotations

import importlib.util

from dp_plugin.lightning.strategy import OPTIMIZER_OPTIONS, HorovodStrategyBody

__all__ = ["OPTIMIZER_OPTIONS", "HorovodStrategy", "HorovodStrategyBody", "PLHorovodStrategy"]

if importlib.util.find_spec("pytorch_lightning") is not None:
    from pytorch_lightning.strategies import ParallelStrategy as _PLParallel
    from pytorch_lightning.strategies import StrategyRegistry as _PLRegistry

    class PLHorovodStrategy(HorovodStrategyBody, _PLParallel):
        __doc__ = HorovodStrategyBody.__doc__

    PLHorovodStrategy.register_strategies(_PLRegistry)
    HorovodStrategy = PLHorovodStrategy

if importlib.util.find_spec("lightning") is not None:
    from lightning.pytorch.strategies import ParallelStrategy as _Parallel
    from lightning.pytorch.strategies import StrategyRegistry as _Registry

    class HorovodStrategy(HorovodStrategyBody, _Parallel):  # type: ignore[no-redef]
        __doc__ = HorovodStrategyBody.__doc__

    # lightning.pytorch's registry is typed as lightning.fabric's, which the
    # lightning package vendors under another module name than lightning_fabric.
    HorovodStrategy.register_strategies(_Registry)  # type: ignore[arg-type]

    from lightning.fabric.strategies import STRATEGY_REGISTRY as _FabricRegistry

    from dp_plugin.lightning.fabric import HorovodFabricStrategy

    HorovodFabricStrategy.register_strategies(_FabricRegistry)
    __all__ += ["HorovodFabricStrategy"]

if "HorovodStrategy" not in globals():
    raise ImportError(
        "dp_plugin.lightning needs Lightning 2.x: pip install 'dp_plugin[lightning]' "
        "(or pip install lightning)")
