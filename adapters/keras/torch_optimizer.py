"""Keras 3 on the torch backend: the cross-process gradient reduction of ``fit``.

Keras's torch trainer runs ``loss.backward()`` and then
``optimizer.apply(gradients, trainable_variables)``, where each gradient is
the ``.grad`` of the variable's torch tensor (``variable.value``). The
reduction is the torch adapter's, not a second gradient path:
``dp_plugin.torch.DistributedOptimizer`` wraps ``KerasGradients``, a torch
optimizer over those tensors that updates nothing. Its hooks start each
fusion bucket's all-reduce while backward still runs, on the optimizer's
own channel; ``apply``, replaced on the Keras optimizer instance by
``DistributedApply``, waits for them (``synchronize``) and hands the
averaged ``.grad`` tensors to Keras's own ``apply``, which updates the
variables. Fusion, compression, comm hooks, autotuning, the layout agreement
and ``DP_PLUGIN_CHECK_FINITE`` are therefore the torch adapter's
(docs/torch.md).

The torch optimizer is made, and the layout agreed across ranks, when the
model's trainable variables are first known: at ``on_train_begin`` of
``DistributedCallback`` / ``BroadcastGlobalVariablesCallback`` (so the first
step overlaps too), else at the first ``apply``; again if the list of
variables changes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

import dp_plugin.torch as _torch_dp
import keras
from dp_plugin.agree.edge import calling
from dp_plugin.api.horovod_names import Average, Compression, parse_op, require_sum_or_average
from dp_plugin.api.process_sets import global_process_set
from dp_plugin.reduce.compression import get_compressor
from dp_plugin.validate import check_groups, check_int, check_positive_float


class KerasGradients(torch.optim.Optimizer):
    """The torch tensors of a Keras model's trainable variables, as a torch
    optimizer that updates nothing: what ``dp_plugin.torch.DistributedOptimizer``
    wraps to reduce their ``.grad``; the Keras optimizer does the update."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        super().__init__(list(tensors), {})
        self.stepped = False
        """Set by ``step``: the wrapper calls it after the reduction unless
        ``DP_PLUGIN_CHECK_FINITE=skip`` dropped the step (on every rank alike)."""

    def step(self, closure: Any = None) -> Any:  # the Keras optimizer updates
        self.stepped = True
        return None


class DistributedApply:
    """Replaces ``apply`` on one Keras optimizer instance: wait for the
    all-reduce of the gradients, then Keras's own ``apply`` on the result.

    ``owner`` is the public name that installed it (``DistributedOptimizer``
    or ``DistributedCallback``); ``settings`` the torch ``DistributedOptimizer``
    arguments, validated (``checked_settings``).
    """

    def __init__(self, optimizer: Any, *, owner: str, settings: dict[str, Any],
                 groups: Any = None) -> None:
        self.apply = type(optimizer).apply.__get__(optimizer)
        """Keras's ``apply`` of this instance (the class's, never another hook)."""
        self.owner = owner
        self.settings = settings
        self.groups = groups
        """Horovod's ``groups``: a count, lists of Keras variables, or None."""
        self.variables: list[Any] = []
        self.gradients: Any = None
        """The wrapped ``KerasGradients``; None until the variables are known."""

    def same_settings(self, other: DistributedApply) -> bool:
        return self.settings == other.settings and self.groups == other.groups

    def attach(self, variables: Sequence[Any]) -> None:
        """Reduce the gradients of ``variables`` from now on (collective the first
        time and whenever the list changes: the layout is agreed across ranks)."""
        variables = list(variables)
        if self.gradients is not None and list(map(id, variables)) == list(map(id, self.variables)):
            return
        self.detach()
        tensors = [v.value for v in variables]
        names = _names(variables)
        groups = self.groups
        if isinstance(groups, list):
            by_id = {id(v): t for v, t in zip(variables, tensors, strict=True)}
            groups = [[by_id[id(v)] for v in group if id(v) in by_id] for group in groups]
        with calling(self.owner):
            self.gradients = _torch_dp.DistributedOptimizer(
                KerasGradients(tensors), named_parameters=list(zip(names, tensors, strict=True)),
                groups=groups, **self.settings)
        self.variables = variables

    def detach(self) -> None:
        """Remove the gradient hooks (the hook is replaced, or the variables
        changed): dropping the wrapper is not enough, since until it is
        collected its hooks would still start all-reduces on its channel."""
        if self.gradients is not None:
            for handle in self.gradients._dp.hooks:  # as the torch adapter's re-wrap does
                handle.remove()
        self.gradients, self.variables = None, []

    def __call__(self, grads: Any, trainable_variables: Any = None) -> Any:
        if trainable_variables is None:  # Keras's own rule: the built variables
            return self.apply(grads, trainable_variables)
        variables = list(trainable_variables)
        self.attach(variables)
        gradients = self.gradients
        gradients.stepped = False
        gradients.step()  # waits for the reduction, then KerasGradients.step
        if not gradients.stepped:  # DP_PLUGIN_CHECK_FINITE=skip: every rank skips alike
            return None
        # The reduced gradients are the tensors' .grad now (the fusion buffer's
        # slices, or written into the old tensors): read them back.
        return self.apply([v.value.grad for v in variables], variables)


def checked_settings(owner: str, *, compression: Any, op: Any, backward_passes_per_step: Any,
                     gradient_predivide_factor: Any, sparse_as_dense: Any,
                     average_aggregated_gradients: Any) -> dict[str, Any]:
    """The reduction's arguments, validated where the user wrote them (errors
    name ``owner``); the torch ``DistributedOptimizer``'s keyword arguments."""
    with calling(owner):
        parsed = parse_op(op, prefix="dp.", instead="op=dp.Average (the default) or op=dp.Sum")
        require_sum_or_average(parsed, "is not a gradient reduction (Average is the default)",
                               prefix="dp.")
    check_positive_float("gradient_predivide_factor", gradient_predivide_factor, where=owner)
    passes = check_int("backward_passes_per_step", backward_passes_per_step, minimum=1,
                       where=owner)
    if passes != 1 or average_aggregated_gradients:
        raise ValueError(
            f"{owner}: backward_passes_per_step={passes!r} (average_aggregated_gradients="
            f"{average_aggregated_gradients!r}) is not supported on the torch backend: Keras's "
            "torch train step clears every gradient before each backward pass, so nothing "
            "accumulates between steps. Leave backward_passes_per_step=1 and pass "
            "gradient_accumulation_steps=N to the Keras optimizer instead (its accumulated "
            "gradient is the same average)")
    try:
        get_compressor(compression)
    except ValueError:
        raise ValueError(
            f"{owner}: compression={compression!r} is not supported; use dp.Compression.none, "
            "dp.Compression.fp16 or dp.Compression.bf16") from None
    return dict(compression=compression, op=parsed,
                gradient_predivide_factor=float(gradient_predivide_factor),
                sparse_as_dense=bool(sparse_as_dense), process_set=global_process_set)


def hook_of(optimizer: Any) -> DistributedApply | None:
    """The hook installed on this very optimizer instance, if any."""
    hook = vars(optimizer).get("apply")
    return hook if isinstance(hook, DistributedApply) else None


def find_hook(optimizer: Any) -> tuple[Any, DistributedApply | None]:
    """The first optimizer of ``optimizer``'s wrapping chain (``inner_optimizer``)
    with a hook, and the hook; ``(optimizer, None)`` if none has one."""
    current = optimizer
    while current is not None:
        if (hook := hook_of(current)) is not None:
            return current, hook
        current = getattr(current, "inner_optimizer", None)
    return optimizer, None


def install(optimizer: Any, hook: DistributedApply, replacing: Any = None) -> None:
    """Put ``hook`` on this optimizer instance (an instance attribute: never
    saved, the class untouched), after removing ``replacing``'s, if given."""
    if replacing is not None:
        old = vars(replacing).pop("apply")
        old.detach()
    vars(optimizer)["apply"] = hook


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
) -> Any:
    """Make a Keras 3 optimizer average its gradients across processes; return it.

    ``opt = dp.DistributedOptimizer(keras.optimizers.SGD(0.01)); model.compile(opt, ...)``,
    then ``model.fit(..., callbacks=[dp.BroadcastGlobalVariablesCallback(0)])``
    (or use ``DistributedCallback`` instead of both). The same object is
    returned with the reduction installed in its ``apply`` (module docstring).
    Arguments as on the TensorFlow backend, except ``backward_passes_per_step``
    (1 only: use the Keras optimizer's ``gradient_accumulation_steps``);
    ``name`` is accepted and unused (collectives are matched by creation order).

    Distributed contract: every rank wraps the same optimizer at the same
    point and runs the same train steps; the first step (or the callback's
    ``on_train_begin``) agrees on the layout, raising on every rank if the
    models differ.
    """
    owner = "DistributedOptimizer"
    if hook_of(optimizer) is not None or getattr(optimizer, "apply", None) is None:
        raise ValueError(
            f"{owner} expects a plain Keras optimizer, got {type(optimizer).__name__}"
            + (" that is already distributed; wrap it once" if hook_of(optimizer) else ""))
    settings = checked_settings(
        owner, compression=compression, op=op, backward_passes_per_step=backward_passes_per_step,
        gradient_predivide_factor=gradient_predivide_factor, sparse_as_dense=sparse_as_dense,
        average_aggregated_gradients=average_aggregated_gradients)
    groups = check_groups(groups, num_groups, keras.Variable, "Keras variables", stacklevel=3)
    install(optimizer, DistributedApply(optimizer, owner=owner, settings=settings, groups=groups))
    return optimizer


def _names(variables: list[Any]) -> list[str]:
    """Each variable's path, numbered where paths repeat (names must be unique)."""
    paths = [str(getattr(v, "path", None) or getattr(v, "name", "variable")) for v in variables]
    counts = Counter(paths)
    return [p if counts[p] == 1 else f"{p}.{i}" for i, p in enumerate(paths)]
