"""Python objects through an engine's collectives (the adapters' ``broadcast_object``,
``allgather_object``, ``from_rank0``; ``first_unloadable`` names what would not
load back), and the adapters' fused broadcast of many tensors (``broadcast_bytes``).

Objects are pickled (with cloudpickle when installed: lambdas, local
classes; else pickle) and travel as uint8 buffers on the engine's buffer
device, after their lengths. A rank that cannot pickle its object sends the
length -1, so that every rank raises, the failing one with the pickling
error, instead of leaving the others waiting for bytes that never come.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from dp_plugin.agree import checked
from dp_plugin.agree.check import agreed_root, check
from dp_plugin.agree.request import Request
from dp_plugin.launch import runtime
from dp_plugin.reduce.arrays import to_device, to_host
from dp_plugin.reduce.collective import fused_collective
from dp_plugin.reduce.dtypes import SUPPORTED_DTYPES
from dp_plugin.reduce.fusion import TensorSpec
from dp_plugin.reduce.hooks import broadcast_hook

T = TypeVar("T")


def broadcast_object(engine: Any, obj: Any, root: int, name: str) -> Any:
    """``root``'s ``obj`` (``root`` is a rank of ``engine``) on every rank; the root
    gets ``obj`` itself. Collective: two broadcasts (length, then bytes)."""
    if engine.size == 1:
        return obj
    is_root = engine.rank == root
    payload, problem = _pickled(obj) if is_root else (None, None)
    count = -1 if problem else 0 if payload is None else payload.size
    length = to_device(np.array([count], np.int64), engine.buffer_device)
    engine.broadcast(length, root, name=f"{name}.sz")
    count = int(to_host(length)[0])
    sizes = [-1 if r == root and count < 0 else 0 for r in range(engine.size)]
    _raise_if_unpickled(engine, sizes, problem, f"broadcast_object {name!r}")
    data = to_device(np.empty(count, np.uint8) if payload is None else payload,
                     engine.buffer_device)
    engine.broadcast(data, root, name=f"{name}.t")
    return obj if is_root else pickle.loads(to_host(data).tobytes())


def allgather_object(engine: Any, obj: Any, name: str) -> list[Any]:
    """Every rank's ``obj``, as a list in rank order (each entry unpickled, this
    rank's too). Collective: the check and two all-gathers (lengths, then bytes)."""
    payload, problem = _pickled(obj)
    count = np.array([-1 if problem else payload.size], np.int64)
    sizes = to_host(checked.allgather(engine, to_device(count, engine.buffer_device),
                                      f"{name}.sz")).tolist()
    _raise_if_unpickled(engine, sizes, problem, f"allgather_object {name!r}")
    # Every rank's byte count is known now: the rows need no second check.
    data = to_host(engine.allgather(to_device(payload, engine.buffer_device), sizes, f"{name}.t"))
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return [pickle.loads(data[offsets[r]:offsets[r + 1]].tobytes()) for r in range(engine.size)]


def from_rank0(run: Callable[[], T], error: type[Exception], name: str,
               explain: Callable[[Exception], str] = str) -> T:
    """``run()`` on rank 0 of the job, its value on every rank (broadcast under
    ``name``). If it raised, every rank raises ``error``, with the failure's
    message when it is an ``error`` already, else ``explain(failure)``: no rank
    goes on believing that rank 0's write succeeded, and none waits for a rank
    0 that has already raised. Collective when the job has several
    ranks; otherwise ``run()`` here."""
    engine = runtime.engine() if runtime.is_initialized() else None
    value: Any = None
    problem: str | None = None
    failure: Exception | None = None
    if engine is None or engine.rank == 0:
        try:
            value = run()
        except Exception as exc:  # every rank must hear of it, whatever it is
            failure = exc
            problem = str(exc) if isinstance(exc, error) else explain(exc)
    if engine is not None and engine.size > 1:
        value, problem = broadcast_object(engine, (value, problem), agreed_root(engine, 0), name)
    if problem is not None:
        raise error(problem) from failure
    return value


def first_unloadable(state: Any, refusal: Callable[[Any], str | None], reason: str,
                     where: str = "") -> tuple[str, str]:
    """Name, for an error message, the innermost entry of ``state`` (through nested
    dicts, lists and tuples) that would not load back: ``("['commit']['note'] =
    <repr> (a module.Class)", why)``. ``refusal(value)`` says why ``value`` alone
    would not load back (None: it would); ``reason`` is why ``state`` did not. The
    torch checkpoints and the TensorFlow commits refuse to write such a state."""
    items: Any = (state.items() if isinstance(state, dict) else
                  enumerate(state) if isinstance(state, list | tuple) else ())
    for key, item in items:
        inner = refusal(item)
        if inner is not None:
            return first_unloadable(item, refusal, inner, f"{where}[{key!r}]")
    text = repr(state)
    text = text if len(text) <= 80 else text[:77] + "..."
    return (f"{where or 'the state'} = {text} (a {type(state).__module__}."
            f"{type(state).__qualname__})", reason)


def _pickled(obj: Any) -> tuple[np.ndarray, Exception | None]:
    """``obj``'s pickle as a uint8 array, or the pickling error (told to the
    other ranks by a length of -1, so that they raise too). cloudpickle's
    output is read by the standard unpickler."""
    buf = io.BytesIO()
    try:
        try:
            import cloudpickle
        except ImportError:
            pickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
        else:
            cloudpickle.dump(obj, buf)
    except Exception as exc:
        return np.empty(0, np.uint8), exc
    return np.frombuffer(buf.getvalue(), dtype=np.uint8).copy(), None


def _raise_if_unpickled(engine: Any, sizes: list[int], problem: Exception | None,
                        what: str) -> None:
    """Raise on every rank if some rank (length -1) could not pickle its object."""
    failed = [engine.global_ranks[r] for r, n in enumerate(sizes) if n < 0]
    if not failed:
        return
    text = (f"rank {engine.global_ranks[engine.rank]}: {what}: rank(s) {failed} could not "
            "pickle the object")
    if problem is not None:
        raise TypeError(f"{text}: {type(problem).__name__}: {problem}; make it picklable "
                        "(cloudpickle handles lambdas and local classes)") from problem
    raise TypeError(f"{text}; see the error on that rank")


def byte_layout(name: str, shape: tuple[int, ...], dtype: str, itemsize: int, odd_name: str,
                device: str = "cpu") -> TensorSpec:
    """What the ranks compare for one tensor of ``broadcast_bytes``: name, shape and
    dtype. Dtypes the core does not reduce (bool, uint32, ...) only need to agree:
    they are compared as bytes, named ``odd_name`` (which names the dtype)."""
    if dtype in SUPPORTED_DTYPES:
        return TensorSpec(name, shape, dtype, device)
    return TensorSpec(odd_name, (math.prod(shape) * itemsize,), "uint8", device)


def broadcast_bytes(engine: Any, names: Sequence[str], wires: Sequence[Any], root: int, *,
                    layout: Sequence[TensorSpec], name: str, what: str,
                    device: str = "cpu") -> None:
    """Broadcast the flat uint8 ``wires`` (torch tensors or numpy arrays, written in
    place) from ``root`` (a rank of ``engine``), fused: one check that every
    rank has the same ``layout`` (see ``byte_layout``) and root, then one
    ``fused_collective`` with the broadcast hook, its buffers on ``device``."""
    check(engine, Request.fused(layout, what, {"root": root}))
    fused_collective(wires, engine=engine, name=name, hook=broadcast_hook, root=root,
                     names=names, device=device).finish()
