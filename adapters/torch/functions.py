"""Broadcast model and optimizer state, and pickled objects, as in ``horovod.torch``.

``broadcast_parameters`` and ``broadcast_optimizer_state`` send tensors as
raw bytes packed into a few fusion buffers (``objects.broadcast_bytes``: one
collective per buffer of at most the fusion threshold), so a model of
hundreds of tensors costs a handful of collectives and every dtype (bool,
complex, ...) travels exactly. The ranks' tensor lists (and root ranks) are
compared first: a rank with another model gets an error naming the first
differing tensor, on every rank.

``root_rank`` is a job-wide rank everywhere, as in Horovod: with a process
set it must be one of the set's members.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from dp_plugin.agree.check import agreed_root
from dp_plugin.agree.edge import calling, public
from dp_plugin.api import objects as _objects
from dp_plugin.api.process_sets import ProcessSet, engine_of, global_process_set
from dp_plugin.engines.base import Engine
from dp_plugin.reduce.fusion import TensorSpec

__all__ = [
    "allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
]


@public("broadcast_parameters")
def broadcast_parameters(params: Any, root_rank: int,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite ``params`` on every rank with ``root_rank``'s values, in place.

    ``params``: a ``state_dict()`` (or any mapping name -> tensor; its items
    are sorted by name, as in Horovod), or an iterable of tensors or of
    ``(name, tensor)`` pairs such as ``model.named_parameters()``.
    Collective: every rank passes the same tensors (names, shapes, dtypes),
    in the same order.
    """
    with calling("hvd.broadcast_parameters()"):
        eng = engine_of(process_set)
    named = _named_tensors(params)
    root = agreed_root(eng, root_rank)
    _broadcast_tensors(eng, named, root, "broadcast_parameters")


@public("broadcast_optimizer_state")
def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Any = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state (``state`` and ``param_groups``) ``root_rank``'s.

    Tensors (momentum buffers, Adam moments, step counters) travel fused as
    raw bytes; everything else (``lr``, ``momentum``, ``betas`` tuples,
    integer steps, nested lists such as LBFGS's history) is pickled from the
    root. The other ranks then ``load_state_dict`` the root's state, so they
    need not have created theirs yet: an optimizer whose state is created
    lazily at its first step is handled without running any step. If the
    root has no state yet, the others' state is cleared, and only the
    hyper-parameters travel; unlike Horovod's zero-gradient dummy step, this
    never changes parameters or step counters. What that step leaves behind
    is kept, as scripts ported from Horovod read it: on a rank whose
    optimizer had no state yet, each parameter that requires a gradient and
    has none gets a zero ``.grad`` (sparse for ``SparseAdam``, and for
    ``SGD`` over a sparse ``Embedding`` of ``model``); a frozen parameter's
    stays None.

    ``model`` is accepted for compatibility and not needed. Collective: every
    rank passes an optimizer over the same parameter groups.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"broadcast_optimizer_state expects a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"broadcast_optimizer_state(model=...) expects a torch.nn.Module or None, got "
            f"{type(model).__name__}"
        )
    with calling("hvd.broadcast_optimizer_state()"):
        eng = engine_of(process_set)
    root = agreed_root(eng, root_rank)
    is_root = eng.rank == root
    if not optimizer.state:
        _zero_missing_grads(optimizer, model)
    dp = getattr(optimizer, "_dp", None)
    if dp is not None and dp.shard is not None:
        # Sharded state (DistributedOptimizer(shard_optimizer_state=True)):
        # state_dict() is collective and whole on every rank; the root's
        # (its hyper-parameters) is then loaded by the others, each keeping
        # its pieces.
        whole = optimizer.state_dict()
        whole = _objects.broadcast_object(eng, whole if is_root else None, root,
                                          "broadcast_optimizer_state.sharded")
        if not is_root:
            optimizer.load_state_dict(whole)
        return
    tensors: list[torch.Tensor] = []
    skeleton = _strip(optimizer.state_dict(), tensors) if is_root else None
    skeleton = _objects.broadcast_object(eng, skeleton, root, "broadcast_optimizer_state.skeleton")
    if not is_root:
        skeleton = _allocate(skeleton, tensors)
    named = [(f"optimizer_state.{i}", t) for i, t in enumerate(tensors)]
    _broadcast_tensors(eng, named, root, "broadcast_optimizer_state")
    if not is_root:
        optimizer.load_state_dict(skeleton)


@public("broadcast_object")
def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (pickled; the root gets ``obj`` itself).

    Pickled with cloudpickle when installed (lambdas, local classes), else
    pickle. Collective: two broadcasts (length, then bytes).
    """
    with calling("hvd.broadcast_object()"):
        eng = engine_of(process_set)
    root = agreed_root(eng, root_rank)
    return _objects.broadcast_object(eng, obj, root, type(obj).__name__ if name is None else name)


@public("hvd.allgather_object()")
def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's ``obj``, as a list in rank order (each entry unpickled, own one too).

    Collective: two all-gathers (lengths, then bytes).
    """
    eng = engine_of(process_set)
    # Not Horovod's type(obj).__name__: the check compares names across ranks,
    # and ranks legitimately hold objects of different types (None on some).
    return _objects.allgather_object(eng, obj, "allgather_object" if name is None else name)


# -- tensors as bytes ----------------------------------------------------------------


def _broadcast_tensors(eng: Engine, named: list[tuple[str, torch.Tensor]], root: int,
                       what: str) -> None:
    """Broadcast ``named`` tensors' bytes from ``root`` (a rank of ``eng``),
    fused: one ``fused_collective`` with the broadcast hook."""
    device = eng.buffer_device
    layout = [_layout_spec(name, t, device) for name, t in named]
    if not named:
        return
    # Flat uint8 views of each tensor's memory (of a copy if not contiguous).
    wires = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in named]
    with torch.no_grad():
        _objects.broadcast_bytes(eng, [name for name, _ in named], wires, root, layout=layout,
                                 name=what, what=f"tensors of {what}", device=device)
        for (_, t), w in zip(named, wires, strict=True):
            if not t.is_contiguous():  # the bytes went into a staged copy
                t.copy_(w.view(t.dtype).view(t.shape))


def _layout_spec(name: str, t: Any, device: str) -> TensorSpec:
    """What the ranks compare for one tensor: name, shape and dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
    if t.is_sparse:
        raise ValueError(f"tensor {name!r} is sparse; broadcast its dense form instead")
    dtype = str(t.dtype).removeprefix("torch.")
    return _objects.byte_layout(name, tuple(t.shape), dtype, t.element_size(),
                                f"{name} ({dtype})", device)


def _named_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, torch.Tensor):
        raise ValueError(
            "broadcast_parameters expects a state_dict, a list of tensors or of (name, tensor) "
            "pairs, not a single tensor; use hvd.broadcast_(tensor, root_rank) for one tensor"
        )
    if isinstance(params, Mapping):
        items: Iterable[Any] = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, Iterable) and not isinstance(params, str | bytes):
        items = list(params)
    else:
        raise ValueError(f"invalid params of type: {type(params)}; pass model.state_dict() or "
                         "model.named_parameters()")
    named: list[tuple[str, torch.Tensor]] = []
    for i, item in enumerate(items):
        name, tensor = item if isinstance(item, tuple) else (f"param.{i}", item)
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"broadcast_parameters: entry {i} ({name!r}) is a {type(tensor).__name__}, not "
                "a torch.Tensor; pass model.state_dict() or model.named_parameters()"
            )
        named.append((str(name), tensor))
    return named


# -- optimizer state skeletons ---------------------------------------------------------


@dataclass(frozen=True)
class _TensorSlot:
    """A tensor of the root's state dict, sent separately (in the order of
    ``_walk``, which the pickled skeleton keeps): what it is."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str


def _walk(obj: Any, leaf: Any) -> Any:
    """``obj`` rebuilt with ``leaf(x)`` for every ``x`` that is not a dict, a list
    or a plain tuple (named tuples are leaves)."""
    if isinstance(obj, dict):
        return {k: _walk(v, leaf) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_walk(v, leaf) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_walk(v, leaf) for v in obj)
    return leaf(obj)


def _zero_missing_grads(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """Give each parameter that requires a gradient and has none a zero one, as
    Horovod's state-initialising step leaves them (its ``test_broadcast_state_no_grad``
    broadcasts such a ``.grad`` next). Sparse where that step makes it sparse."""
    sparse = set()
    if model is not None:
        sparse = {id(p) for m in model.modules()
                  if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad or p.grad is not None:
                continue
            grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            if isinstance(optimizer, torch.optim.SparseAdam) or (
                    isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                grad = grad.to_sparse()
            p.grad = grad


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a ``_TensorSlot`` (the tensor goes to ``tensors``)."""

    def slot(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        tensors.append(t)
        return _TensorSlot(tuple(t.shape), t.dtype, t.device.type)

    return _walk(obj, slot)


def _allocate(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """``skeleton`` with an empty local tensor in each slot (also appended to
    ``tensors``, in the root's order), for the broadcast to fill."""

    def empty(x: Any) -> Any:
        if not isinstance(x, _TensorSlot):
            return x
        cuda = x.device_type == "cuda" and torch.cuda.is_available()  # this rank's own GPU
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        tensors.append(torch.empty(x.shape, dtype=x.dtype, device=device))
        return tensors[-1]

    return _walk(skeleton, empty)
