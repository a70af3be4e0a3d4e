"""``jit_compile=True`` with the cross-worker reduction: a train step split in three.

XLA cannot compile a ``tf.numpy_function``, and the reduction is one, so a
model compiled with ``jit_compile=True`` cannot run its usual train step
(one XLA-compiled function) with the reduction inside. Instead of turning
XLA off, ``install_split_train_function`` builds the train function from
three parts::

    forward(data)   XLA   the model's own ``train_step``: forward, loss,
                          gradients, loss tracker and metrics; the optimizer
                          hook *captures* the gradients instead of applying them
    reduce(grads)         the bridge's numpy ops (outside XLA)
    apply(reduced)  XLA   the optimizer's own ``apply`` (loss scaling, clipping,
                          the update)

The outer function (Keras's ``make_train_function``: ``steps_per_execution``,
the iterator, the strategy) is built with XLA off; the two parts are
``tf.function(jit_compile=True)``, which TensorFlow compiles as XLA clusters.
``model.jit_compile`` stays True, so ``evaluate`` and ``predict`` keep XLA.

What changes for the user: a custom ``train_step`` still runs (in the
forward part), but its call of ``optimizer.apply_gradients`` only hands the
gradients over: code after it in the same ``train_step`` sees the weights
before the update (Keras's own ``train_step`` only computes metrics there,
from the predictions). A ``train_step`` that applies the hooked optimizer
twice per step is refused with a message. With
``backward_passes_per_step > 1`` the accumulation and the apply run outside
XLA (they sit in a ``tf.cond``); the forward part stays compiled.

Not split (XLA is turned off with a warning instead, as before): a model
under a ``MirroredStrategy`` with several replicas, whose gradients are
summed in replica context between the parts.

What this relies on in Keras's trainer: see ``compat``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf
from dp_plugin.tensorflow.optimizer import DistributedApply

_MARK = "_dp_plugin_split_hook"
"""Attribute on a train function built here: the hook it was built for."""


def is_split(model: Any) -> bool:
    """True if ``model.train_function`` is a split step built here."""
    return getattr(model.train_function, _MARK, None) is not None


def is_split_for(model: Any, hook: DistributedApply) -> bool:
    """True if ``model.train_function`` is a split step built for ``hook``."""
    return getattr(model.train_function, _MARK, None) is hook


def install_split_train_function(model: Any, hook: DistributedApply) -> None:
    """Set ``model.train_function`` to the split step (see the module docstring);
    ``model.jit_compile`` is left as it is (True). One replica per worker only."""
    vars(model)["train_step"] = _split_step(model.train_step, hook)  # removed below
    model.jit_compile = False  # the outer function only
    try:
        model.make_train_function(force=True)
    finally:
        del vars(model)["train_step"]
        model.jit_compile = True
    setattr(model.train_function, _MARK, hook)


def _split_step(train_step: Any, hook: DistributedApply) -> Any:
    """The train step given to Keras's ``make_train_function``: it runs while the
    outer function is traced and adds the forward part, the reduction and the
    apply part to it (see the module docstring)."""

    @tf.autograph.experimental.do_not_convert
    def step(data: Any) -> Any:
        # New compiled parts per trace of the outer function, so that the capture
        # below happens during this trace.
        captured: list[tuple[list[Any], list[Any] | None]] = []

        def forward(batch: Any) -> Any:
            with hook.capturing() as calls:
                logs = train_step(batch)
            captured.extend(calls)
            grads = calls[0][0] if calls else []
            return logs, [g for g in grads if g is not None]

        logs, present = tf.function(forward, jit_compile=True, autograph=False)(data)
        if not captured:
            return logs  # no trainable weights: Keras warned, nothing to apply
        grads, variables = captured[0]
        full = _refill(grads, present)
        if hook.backward_passes_per_step > 1:
            hook(full, variables)  # accumulate, then reduce and apply: outside XLA
            return logs
        reduced = hook.reduce(full, variables)
        if not hook.optimizer.built and variables is not None:
            hook.optimizer.build(variables)  # no variables created inside XLA

        def apply(values: list[Any]) -> None:
            hook.apply_reduced(_refill(grads, values), variables)

        tf.function(apply, jit_compile=True, autograph=False)(
            [g for g in reduced if g is not None])
        return logs

    return step


def _refill(template: Sequence[Any], values: Sequence[Any]) -> list[Any]:
    """``values`` put back at the non-None positions of ``template``."""
    it = iter(values)
    return [None if t is None else next(it) for t in template]
