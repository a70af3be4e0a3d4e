"""Object collectives, barrier, join and build queries, as ``horovod.tensorflow``.

``broadcast_object`` / ``allgather_object`` pickle Python objects and move
the bytes with the engine's broadcast / all-gather (``dp_plugin.api.objects``,
shared with the PyTorch adapter). ``*_built()`` answer
for dp_plugin's engines as the TensorFlow adapter uses them: tensors are
staged through host (numpy) memory, so no CUDA/ROCm/NCCL path exists here;
Gloo is the core's ``gloo`` engine (torch.distributed's), MPI the ``mpi``
engine (mpi4py) or Horovod's when the ``horovod`` engine runs.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from dp_plugin.agree import join as protocol
from dp_plugin.agree.check import agreed_root
from dp_plugin.agree.edge import public
from dp_plugin.api import objects as _objects
from dp_plugin.api.process_sets import engine_of, global_process_set
from dp_plugin.launch import runtime
from dp_plugin.tensorflow import graph_order
from dp_plugin.tensorflow.broadcast import broadcast_variables

__all__ = [
    "allgather_object", "barrier", "broadcast_global_variables", "broadcast_object", "cuda_built",
    "join", "nccl_built", "rocm_built",
]


@public("broadcast_object")
def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    """``root_rank``'s ``obj`` on every rank of the set (pickled). Collective."""
    engine = engine_of(process_set)
    root = agreed_root(engine, root_rank)
    return _objects.broadcast_object(engine, obj, root, name or type(obj).__name__)


@public("allgather_object")
def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: Any = global_process_set) -> list[Any]:
    """Every rank's ``obj``, in rank order of the set (pickled). Collective."""
    # Not type(obj).__name__: ranks may hold objects of different types (see torch's).
    return _objects.allgather_object(engine_of(process_set), obj, name or "allgather_object")


@public("barrier")
def barrier(process_set: Any = global_process_set) -> None:
    """Return once every rank of the set has called it."""
    engine_of(process_set).barrier()


def join() -> Any:
    """Wait until every rank has called ``join()``; return (an int32 tensor) the rank
    that joined last, by torch's rule (``dp_plugin.agree.join.last_joined``): of the ranks
    that answered the fewest of the others' collectives since joining, the highest.
    Unlike Horovod, a joined rank does not serve the other ranks' collectives
    meanwhile, so every rank joins at the same point and the highest rank is named;
    every rank must run the same collectives before joining (see docs/keras.md).
    No clock is read: hosts' clocks differ."""
    return tf.constant(protocol.last_joined(runtime.engine(), answered=0), dtype=tf.int32)


def broadcast_global_variables(root_rank: int) -> Any:
    """An op that sets the global variables of the current TF1 graph
    (``tf.compat.v1.global_variables()``) to ``root_rank``'s values, as Horovod's.

    For graphs (``tf.compat.v1.Session``, ``MonitoredTrainingSession`` with
    ``BroadcastGlobalVariablesHook``): run the returned op once after the
    variables are initialized. Its broadcast depends on no collective built
    before it (it only reads the variables; ``graph_order.new_chain``), so
    running it alone does not run the training step. Eagerly TensorFlow 2 has
    no collection of global variables, and this raises, as Horovod does.
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            f"broadcast_global_variables({root_rank}) is for TF1 graphs: eagerly TensorFlow 2 "
            "has no collection of global variables to broadcast. Use "
            "dp.broadcast_variables(model.variables, root_rank) and "
            "dp.broadcast_variables(optimizer.variables, root_rank), or add "
            "dp.callbacks.BroadcastGlobalVariablesCallback(root_rank) to model.fit"
        )
    variables = tf.compat.v1.global_variables()
    if not variables:
        return tf.no_op(name="broadcast_global_variables")
    with graph_order.new_chain():
        return broadcast_variables(variables, root_rank)


def nccl_built() -> int:
    """0: the TensorFlow adapter stages tensors through host memory, never NCCL."""
    return 0


def cuda_built() -> bool:
    """False: the TensorFlow adapter has no GPU data path (tensors go through host memory)."""
    return False


def rocm_built() -> bool:
    """False: no ROCm data path."""
    return False
