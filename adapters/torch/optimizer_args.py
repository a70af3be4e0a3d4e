"""Validation of ``DistributedOptimizer``'s arguments, with Horovod's rules and messages."""

from __future__ import annotations

import collections
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from dp_plugin.compression import Compressor, get_compressor
from dp_plugin.engines.base import ReduceOp
from dp_plugin.process_sets import ProcessSet
from dp_plugin.torch.ops import parse_op
from dp_plugin.validate import check_int


def compressor_of(compression: Any) -> Compressor:
    try:
        return get_compressor(compression)
    except ValueError:
        raise ValueError(
            f"compression={compression!r} is not supported; use hvd.Compression.none, "
            "hvd.Compression.fp16, hvd.Compression.bf16 or a compressor class with static "
            "compress(tensor) -> (tensor, ctx) and decompress(tensor, ctx)"
        ) from None


def parameter_names(
    param_groups: list[dict[str, Any]], named_parameters: Iterable[tuple[str, torch.Tensor]] | None
) -> dict[torch.Tensor, str]:
    """Name of each parameter: from ``named_parameters`` (validated), else Horovod's default."""
    if named_parameters is None:
        return {p: default_name(group, i, j)
                for i, group in enumerate(param_groups) for j, p in enumerate(group["params"])}
    named = list(named_parameters)
    bad = [item for item in named if not isinstance(item, tuple) or len(item) != 2]
    if bad:
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually "
            f"produced by model.named_parameters(); got {type(bad[0]).__name__} {bad[0]!r:.80}"
        )
    counts = collections.Counter(name for name, _ in named)
    duplicates = sorted(name for name, count in counts.items() if count > 1)
    if duplicates:
        raise ValueError(
            "Parameter names in named_parameters must be unique. Found duplicates: "
            + ", ".join(duplicates)
        )
    names: dict[torch.Tensor, str] = {}
    for name, p in sorted(named, key=lambda item: item[0]):
        names.setdefault(p, name)
    missing = [
        f"param_groups[{i}]['params'][{j}] (shape {tuple(p.shape)})"
        for i, group in enumerate(param_groups) for j, p in enumerate(group["params"])
        if p not in names
    ]
    if missing:
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were not "
            f"named: {', '.join(missing)}. Pass every parameter of the optimizer, e.g. "
            "named_parameters=model.named_parameters()"
        )
    return names


def default_name(group: dict[str, Any], i: int, j: int) -> str:
    """Horovod's name for parameter ``j`` of param group ``i`` when no
    ``named_parameters`` were given: ``allreduce.noname.<i>.<j>``. Horovod's
    rule is kept even when torch >= 2.6 has the group's ``param_names``
    (Horovod predates them), so names (and a horovod engine's collective
    names) are the same as under Horovod."""
    del group
    return f"allreduce.noname.{i}.{j}"


def check_groups(groups: Any) -> None:
    """Horovod's validation of ``groups``: an int > 0 or a list of lists of tensors."""
    if groups is None:
        return
    if isinstance(groups, list):
        seen: set[int] = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError(
                        f"groups must consist of torch.Tensor, got {type(p).__name__}"
                    )
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
        return
    if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
        raise ValueError(
            "groups should be a non-negative integer or a list of list of torch.Tensor, "
            f"got {groups!r}"
        )

def checked_arguments(op: Any, gradient_predivide_factor: float, num_groups: int, groups: Any,
                      backward_passes_per_step: Any, compression: Any,
                      process_set: Any) -> tuple[ReduceOp, Any, int, Any]:
    """``DistributedOptimizer``'s arguments, validated: (op, groups, passes,
    compressor). Every mistake raises naming the argument and the fix."""
    reduce_op = parse_op(op, "DistributedOptimizer")
    if gradient_predivide_factor != 1.0 and reduce_op is not ReduceOp.AVERAGE:
        raise ValueError(
            f"gradient_predivide_factor={gradient_predivide_factor!r} is only supported with "
            f"op=hvd.Average, got op={op!r}; leave it at 1.0"
        )
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups`.",
                      DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    check_groups(groups)
    passes = check_int("backward_passes_per_step", backward_passes_per_step, minimum=1)
    compressor = compressor_of(compression)
    if not isinstance(process_set, ProcessSet):
        raise TypeError(
            f"DistributedOptimizer(process_set=...) expects an hvd.ProcessSet, got "
            f"{type(process_set).__name__}; pass hvd.global_process_set (the default) or a set "
            "registered with hvd.add_process_set(ranks)"
        )
    return reduce_op, groups, passes, compressor
