"""``load_model`` and ``BestModelCheckpoint``, as ``horovod.tensorflow.keras``.

A model saved while its optimizer reduced across workers is saved with the
plain optimizer (the reduction is an instance hook kept out of checkpoints,
see ``optimizer``). ``load_model`` restores it and installs the reduction
again, so the optimizer comes back distributed, as Horovod's ``load_model``
returns it wrapped in its ``DistributedOptimizer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from dp_plugin.api.horovod_names import Compression
from dp_plugin.tensorflow.optimizer import DistributedOptimizer, find_hook


def load_model(filepath: Any, custom_optimizers: Sequence[type] | None = None,
               custom_objects: dict[str, Any] | None = None,
               compression: Any = Compression.none, legacy_opts: bool = False) -> Any:
    """``keras.models.load_model(filepath)`` with the optimizer made distributed.

    ``custom_optimizers``: optimizer classes the file refers to by class name;
    ``custom_objects``: as Keras's; ``compression``: the restored optimizer's
    wire compression. A model saved without an optimizer comes back without one.
    """
    if legacy_opts:
        raise ValueError(
            "load_model(legacy_opts=True): Keras 3 has no legacy optimizers; drop the argument")
    objects = {**{cls.__name__: cls for cls in custom_optimizers or ()}, **(custom_objects or {})}
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer) and find_hook(optimizer)[1] is None:
        DistributedOptimizer(optimizer, compression=compression)
    return model


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keep the best model seen so far (Horovod's: ``ModelCheckpoint`` with
    ``save_best_only=True``). Horovod leaves ``filepath`` to its Spark estimator;
    here pass ``filepath=`` (a ``.keras`` file, or ``.weights.h5`` with
    ``save_weights_only=True``) or set ``callback.filepath`` before ``fit``."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto",
                 save_freq: Any = "epoch", filepath: Any = None) -> None:
        unset = "unset.weights.h5" if save_weights_only else "unset.keras"
        super().__init__(filepath=unset if filepath is None else filepath, monitor=monitor,
                         verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self._unset = unset if filepath is None else None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self._unset is not None and self.filepath == self._unset:
            raise ValueError(
                "BestModelCheckpoint has no filepath: pass filepath='best.keras' (or set "
                "callback.filepath) before model.fit")
        super().on_train_begin(logs)
