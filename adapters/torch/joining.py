"""``hvd.join()``: a rank that ran out of data keeps answering the others' steps.

Horovod's semantics are in ``join``'s docstring. Design (no extra collective
per step): a joined rank marks its own element of each optimizer's "join"
flags (``control_slot.py``: reduced with the last fusion bucket, so every
rank reads the same values and all agree on when everyone has joined) and
loops over "zero steps" (``synchronize()`` with no gradient marked ready, so
every gradient contributes zeros, finished as the training ranks finish
theirs, raising what they raise) until they say so.

The others' all-reduces and barriers are answered through
``dp_plugin.agree.join`` (``Listener`` and ``replay``: the wire protocol, what is
answered, what is refused, the deadline); ``join`` polls both without blocking, so
the others may step and call collectives in any order.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from dp_plugin.agree import join as protocol
from dp_plugin.agree.edge import public
from dp_plugin.agree.join import Deadline, Listener, joined_view
from dp_plugin.api.process_sets import member_engines
from dp_plugin.torch.basics import engine
from dp_plugin.torch.optimizer_state import OptimizerState, SynchronizationError

_states: list[weakref.ref[OptimizerState]] = []


def register(state: OptimizerState) -> None:
    """Let ``join`` drive a ``DistributedOptimizer``'s reduction (held weakly,
    in creation order: it lives as long as its optimizer)."""
    _states[:] = [r for r in _states if r() is not None]
    _states.append(weakref.ref(state))


def retire(optimizer: Any) -> None:
    """Stop ``join`` driving ``optimizer`` (a ``DistributedOptimizer``) once
    its owner is done with it: a Lightning ``Trainer``'s at teardown. Call it
    on every rank alike: ``join`` steps the same live optimizers everywhere,
    and one kept alive on one rank only (by the garbage collector's timing)
    would leave the others waiting."""
    state = getattr(optimizer, "_dp", None)
    _states[:] = [r for r in _states if r() is not None and r() is not state]


@public("hvd.join()")
def join(device: int = -1) -> int:
    """Wait, answering the other ranks' all-reduces, until every rank has joined.

    Call it on a rank that has run out of data. Until every rank has called
    ``join()``, this rank takes part, contributing nothing, in what the
    others run (Horovod 0.28.1's semantics, ``dp_plugin.agree.join``):

    - every ``DistributedOptimizer`` step, with zero gradients (averages
      still divide by the full size, as in Horovod);
    - ``allreduce`` (zeros; for Min/Max/Product the op's identity),
      ``barrier``, and their grouped and in-place forms, on the global
      process set and on every process set this rank belongs to.

    ``allgather``, ``broadcast``, ``reducescatter``, ``alltoall`` and what is
    built on them (``broadcast_parameters``, ``broadcast_object``,
    ``SyncBatchNorm`` in training mode, ...) raise ``JoinedRankError`` on the
    ranks that call them meanwhile (Horovod: "Allgather is not supported
    with Join at this time."); this rank keeps waiting, and those ranks
    call ``join()`` next. This rank's own parameters are not updated while
    it waits, so broadcast parameters from a rank that trained to the end if
    you keep training afterwards. Returns, on every rank, the rank that
    joined last (of ranks that joined at the same point, the highest).

    Collective. Bounded by ``DP_PLUGIN_TIMEOUT`` after the last progress
    (``CollectiveTimeoutError`` when the others run nothing for that long).
    ``device`` is accepted for compatibility: zeros are made on each
    tensor's own device.
    """
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"join(device=...) must be an int device index (-1 for CPU), got "
                        f"{device!r}")
    eng = engine()
    if eng.size == 1:
        return 0
    # One left over from before hvd.shutdown() has nothing to answer.
    live = [st for st in (r() for r in _states) if st is not None and not st.closed]
    if any(st.pending for st in live):
        raise SynchronizationError(
            "hvd.join() was called after loss.backward() but before optimizer.step() or "
            "optimizer.synchronize(); finish the step first, then join"
        )
    return _Joined(eng, member_engines(), [st for st in live if st.reducer is not None]).run()


class _Joined:
    """One ``join()`` call: listeners on this rank's engines (the global one
    first), zero steps of its optimizers, polled until every rank has joined."""

    def __init__(self, eng: Any, engines: list[Any], states: list[OptimizerState]) -> None:
        self.eng = eng
        self.answered = 0
        """Rounds of the others answered on the global engine (``last_joined``)."""
        self.listening: dict[int, Listener] = {i: Listener(e) for i, e in enumerate(engines)}
        self.stepping = list(states)
        for st in self.stepping:
            _start_zero_step(st)

    def run(self) -> int:
        deadline = Deadline(self.eng.config.timeout_s, self.eng.rank)
        pause = 0.0
        while self.listening or self.stepping:
            if self._poll():
                deadline.progressed()
                pause = 0.0
                continue
            deadline.check()
            time.sleep(pause)
            pause = min(pause * 2 + 1e-4, 2e-3)
        return protocol.last_joined(self.eng, self.answered)

    def _poll(self) -> bool:
        progressed = False
        # The zero steps first: one that finished raises what the training
        # ranks raise, before a listener finds those ranks gone.
        for st in list(self.stepping):
            assert st.reducer is not None and st.engine is not None  # join() kept built ones
            if not st.reducer.all_done():
                continue
            progressed = True
            if _finish_zero_step(st):
                self.stepping.remove(st)
            else:
                if st.engine.size == self.eng.size:  # a step of the whole job: counts
                    self.answered += 1
                _start_zero_step(st)
        for index, listener in list(self.listening.items()):
            if not listener.done():
                continue
            progressed = True
            e = listener.engine
            heard = listener.heard()
            if protocol.everyone_joined(heard, e.size):
                del self.listening[index]
                continue
            described, _ = joined_view(heard)
            if described is not None and protocol.answerable(heard, described[0]["kind"]):
                protocol.replay(e, described)
            if index == 0:
                self.answered += 1
            self.listening[index] = Listener(e)
        return progressed


def _start_zero_step(st: OptimizerState) -> None:
    assert st.reducer is not None and st.marks is not None  # join() kept built ones
    st.marks.join.fill(joined=True)
    st.reducer.launch_all()


def _finish_zero_step(st: OptimizerState) -> bool:
    """Has every rank of the optimizer's set joined?"""
    assert st.reducer is not None and st.marks is not None  # join() kept built ones
    results = st.reducer.synchronize()  # every gradient: zeros; results dropped
    st.sparse.reduce(st.names, st.op, st.engine, contribute=False)
    st.check_unfrozen([], joined=True)  # raise where the training ranks raise
    st.check_sparse(joined=True)
    skip = False
    if st.marks.finite is not None:  # raise where the training ranks raise
        skip = st.marks.finite.decide([(st.names[p], g) for p, g in zip(st.params, results,
                                                                         strict=True)])
    everyone = st.marks.join.decide()[0]
    optimizer = st.optimizer()
    if st.shard is not None and optimizer is not None:
        if not everyone and not skip:
            # The training ranks step their pieces and all-gather: this rank's
            # pieces are stepped here, with the gradients they reduced.
            st.shard.step(optimizer, results)
        else:
            st.shard.follow(optimizer)
    return everyone
