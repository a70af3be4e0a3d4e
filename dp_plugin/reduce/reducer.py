"""The ``Reducer``: one per stream of tensors to reduce (DDP's ``Reducer``).

    ready events (mark_ready)                         here, one StepState per step
      -> plan (tensors -> buckets)                    dp_plugin.reduce.fusion
      -> pack into the Bucket's buffer                dp_plugin.reduce.bucket
         (its own, or one of two slabs it borrows)
      -> agree once across ranks                      dp_plugin.agree.check
      -> hook(state, bucket) -> handle                dp_plugin.reduce.hooks
      -> engine transport                             dp_plugin.engines
      -> unpack (synchronize)

A gradient stream drives it bucket by bucket as gradients become ready
(``mark_ready`` ... ``synchronize``). A one-shot fused collective, every
tensor given at once, is ``dp_plugin.reduce.collective.fused_collective``.
``GradientScheduler`` is the Reducer built from the user's keyword
arguments (the core's public edge).

The distributed contract is ``GradientScheduler``'s docstring. After any
failed collective the Reducer refuses further work (the ranks are out of step).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from dp_plugin.agree.check import check
from dp_plugin.agree.request import Request
from dp_plugin.api.timeline import NullTimeline, StatsHistory, open_timeline
from dp_plugin.engines.base import ReduceOp
from dp_plugin.errors import DPPluginError
from dp_plugin.launch import runtime
from dp_plugin.reduce.arrays import (
    ArrayOps,
    NumpyOps,
    TorchOps,
    is_torch,
    ops_for,
    spec_of,
    to_device,
    to_host,
)
from dp_plugin.reduce.autotune import Autotuner, mib
from dp_plugin.reduce.bucket import SLABS_PER_KIND, Bucket, Slab
from dp_plugin.reduce.compression import Compressor, get_compressor
from dp_plugin.reduce.dtypes import itemsize
from dp_plugin.reduce.fusion import (
    PlanEntry,
    TensorSpec,
    checked_specs,
    default_order,
    plan_buckets,
)
from dp_plugin.reduce.hooks import NO_SCALING, CommHook, HookState, ReducePolicy, hook_for
from dp_plugin.reduce.step_state import StepState
from dp_plugin.validate import check_int

log = logging.getLogger("dp_plugin")


class Reducer:
    """One stream's reduction: ready tracking, fused buckets launched in
    order, the step's state, the agreement and the per-rank flags that ride
    on the last bucket (see the module docstring).

    ``policy`` is the one ``ReducePolicy`` (scaling; none by default), built where
    the arguments were validated (``GradientScheduler``,
    ``hvd.DistributedOptimizer``, TensorFlow's ``parse_reduction``); ``passes`` is
    ``backward_passes_per_step``; ``hook`` moves a packed bucket (default:
    all-reduce, compressed per ``compression``); ``fusion_threshold`` caps a
    bucket's bytes (default: ``Config.bucket_caps``); buckets follow the expected
    ready order, reverse registration, until the first step's order rebuilds them.
    ``flags`` names groups of per-rank flags (one element per rank each) in the
    control slot: ``flags_of(name)`` is a group's elements, reduced (unscaled)
    with the last bucket, so they cost no collective of their own. ``settings``
    are compared across ranks with ``specs`` (``what`` names them in the
    messages). ``groups`` (lists of spec indices) are reduced as one bucket each,
    launched when the whole group is ready (Horovod's ``groups=``;
    ``plan_buckets``). ``timeline`` records spans (none by default); ``array_ops``
    is the array backend (default: from the first tensor seen).
    """

    def __init__(self, specs: Sequence[TensorSpec], *, engine: Any,
                 policy: ReducePolicy = NO_SCALING, passes: int = 1,
                 compression: str | Compressor = "none", fusion_threshold: int | None = None,
                 timeline: Any = None, name: str = "grads", array_ops: ArrayOps | None = None,
                 hook: CommHook | None = None, flags: Sequence[str] = (),
                 settings: Mapping[str, Any] | None = None, autotune: bool = False,
                 what: str | None = None, groups: Sequence[Sequence[int]] = ()) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        self.engine, self.name, config = engine, name, engine.config
        self.specs: tuple[TensorSpec, ...] = checked_specs(specs)
        self.backward_passes_per_step = check_int("backward_passes_per_step", passes, minimum=1)
        self.policy = policy
        self.flag_names = tuple(flags)
        self.control_numel = len(self.flag_names) * engine.size
        self.fusion_threshold, self.first_threshold = config.bucket_caps(
            fusion_threshold, sum(s.nbytes for s in self.specs))
        self.rebuild_buckets = bool(config.rebuild_buckets)
        self.timeline = NullTimeline() if timeline is None else timeline
        self.compressor = get_compressor(compression)
        self.hook: CommHook = hook_for(self.compressor) if hook is None else hook
        self.state = HookState(engine, policy.engine_op)
        self.what = what or f"tensors of scheduler {name!r}"
        self.autotuner = Autotuner(
            config.autotune_candidates, self.fusion_threshold,
            warmup_steps=config.autotune_warmup_steps, steps=config.autotune_steps,
        ) if autotune else None
        """Measures bucket sizes in the first steps (``autotune=True``), else None."""
        self.settings = {
            "fusion threshold": self.fusion_threshold,
            "first bucket threshold": self.first_threshold,
            "compression": self.compressor.name, "op": policy.op.value,
            **dict(policy.settings),
            "backward_passes_per_step": self.backward_passes_per_step,
            "rebuild_buckets": self.rebuild_buckets, **(settings or {}),
            "DP_PLUGIN_AUTOTUNE": "off" if self.autotuner is None else self.autotuner.setting,
        }
        self.groups = tuple(tuple(g) for g in groups)
        if self.groups:
            self.settings["groups"] = self.groups
        self.ops = array_ops
        self.agreed = False
        """True once the ranks agreed."""
        self.broken: BaseException | None = None
        self._order = default_order(len(self.specs))
        self.rebuilt = False
        """True once the plan was rebuilt from the ready order of the first step."""
        self._rebuild_pending = self.rebuild_buckets
        self.postpone_rebuild: Callable[[], bool] | None = None
        """Asked at the end of a step while the plan waits for its rebuild,
        after the step's buckets (and so its flags) are reduced: True puts
        the rebuild off to the next step. It must answer alike on every rank
        (read reduced flags): the rebuild broadcasts rank 0's ready order. The
        torch adapter puts it off while any rank has joined, so ``hvd.join()``
        finishes its optimizers' zero steps in any order with no collective
        of their own, and the order comes from a step rank 0 trained."""
        self.stats = StatsHistory()
        """``StepStats`` of the recent completed ``synchronize()`` calls (step 0 first)."""
        self._lock = threading.RLock()
        self.plan_version = -1
        """Changes whenever the bucket plan (and so every fusion buffer) is replaced."""
        self._install(self._plan(self._order))
        self._state = StepState(0, len(self.specs), len(self.plan))

    # -- the plan ----------------------------------------------------------------
    def _plan(self, order: Iterable[int], threshold: int | None = None) -> list[PlanEntry]:
        """Buckets of ``threshold`` bytes (default: the fusion threshold)."""
        return plan_buckets(self.specs, self.fusion_threshold if threshold is None else threshold,
                            order=order, first_threshold=self.first_threshold, groups=self.groups)

    def _install(self, plan: list[PlanEntry]) -> None:
        """Adopt ``plan``: new buckets (their buffers allocated on first use);
        the unpinned ones take turns on two slabs per (dtype, device) in plan
        order, the same slab every step."""
        self.plan = plan
        self.plan_version += 1
        control = {len(plan) - 1: self.control_numel} if self.control_numel else {}
        kinds: dict[tuple[str, str], list[PlanEntry]] = {}
        for e in plan:  # pinned: the control slot, or one tensor over the threshold
            if e.index not in control and e.nbytes <= self.fusion_threshold:
                kinds.setdefault((e.dtype, e.device), []).append(e)
        self.slabs: list[Slab] = []
        slab_of: dict[int, Slab] = {}
        for key, members in kinds.items():
            largest = max(e.numel for e in members)
            slabs = [Slab(largest, *key) for _ in range(min(SLABS_PER_KIND, len(members)))]
            self.slabs += slabs
            slab_of.update((e.index, slabs[n % len(slabs)]) for n, e in enumerate(members))
        self.buckets = [Bucket(e, self.specs, f"{self.name}.bucket{e.index}",
                               wire_dtype=self.compressor.wire_dtype(e.dtype),
                               control_numel=control.get(e.index, 0), slab=slab_of.get(e.index))
                        for e in plan]
        self.bucket_of = {i: e.index for e in plan for i in e.members}

    def slab_bytes(self) -> int:
        """Bytes of the slabs allocated so far (for memory reports)."""
        return sum(s.numel * itemsize(s.dtype) for s in self.slabs if s.storage is not None)

    def replan(self, order: Sequence[int]) -> bool:
        """Re-plan for the ready order ``order``; True if the buckets changed."""
        plan = self._plan(order)
        if [b.members for b in plan] == [b.members for b in self.plan]:
            return False
        control = self.buckets[-1].control if self.buckets else None
        self._install(plan)
        if control is not None:  # the control slot's values move with it
            self._backend().pack(self._control(), control)
        return True

    def _backend(self, like: Any = None) -> ArrayOps:
        if self.ops is None:
            if like is not None:
                self.ops = ops_for(like)
            elif all(s.device == "cpu" for s in self.specs):
                self.ops = NumpyOps()
            else:
                self.ops = TorchOps()
        return self.ops

    def _control(self, like: Any = None) -> Any:
        """The control slot (in the last bucket's buffer)."""
        last = self.buckets[-1]
        last.allocate(self._backend(like))
        return last.control

    # -- public API ----------------------------------------------------------
    def agree(self) -> None:
        """Check now that every rank registered the same tensors and settings,
        if that has not run (collective; otherwise the first bucket's launch
        does it). Call it at a point every rank reaches in the same order
        (the optimizer's construction, the step being traced), never in a
        gradient hook: it blocks. Raises ``LayoutMismatchError`` on every rank."""
        if not self.agreed:
            self.agreed = True
            self._guard(lambda: check(self.engine, Request.fused(self.specs, self.what,
                                                                 self.settings)))

    def flags_of(self, name: str, like: Any = None) -> Any:
        """The flag group ``name`` (one element per rank of the engine, in the
        control slot): write this rank's element before the step's last
        bucket launches; read every rank's after ``synchronize()``. Ask each
        time: the elements move when the plan is rebuilt. ``like`` picks the
        array backend."""
        k, n = self.flag_names.index(name), self.engine.size
        with self._lock:
            return self._control(like)[k * n:(k + 1) * n]

    def mark_ready(self, index: int, tensor: Any) -> None:
        """Report that ``tensor`` holds the gradient of spec ``index`` for this pass.

        On the ``backward_passes_per_step``-th call for a tensor since the last
        ``synchronize()`` it counts as ready; complete buckets are launched in
        bucket order. May run collectives (see the class docstring).
        """
        with self._lock:
            self._check_usable(f"scheduler {self.name!r}")
            index, spec = self._checked(index, tensor)
            self._backend(tensor)
            st = self._state
            if st.started_at is None:
                st.started_at = time.perf_counter()
            if st.passes[index] >= self.backward_passes_per_step:
                raise DPPluginError(  # Horovod's message, then which tensor
                    "Gradients were computed more than backward_passes_per_step times before "
                    "call to step()/synchronize(). Increase backward_passes_per_step to "
                    f"accumulate gradients locally. (tensor {spec.name!r}, "
                    f"backward_passes_per_step={self.backward_passes_per_step})")
            st.passes[index] += 1
            st.tensors[index] = tensor
            if st.passes[index] == self.backward_passes_per_step:
                self._set_ready(index)
                self._launch_ready()
            self._poll()

    def synchronize(self) -> list[Any]:
        """Finish this step's reduction and return the reduced tensors.

        Tensors never marked ready this step contribute zeros (so every rank
        runs the same collectives); tensors marked fewer than
        ``backward_passes_per_step`` times contribute what they were given.
        Returns, per spec index, the tensor holding the result: the caller's
        tensor (updated in place) or the zeros tensor made for a missing one.
        Synchronization point; resets the pass counters.
        """
        self.launch_all()
        with self._lock:
            st = self._state
            self._launch_ready()  # what launch_all left for a slab to come free
            exposed = st.late_launch_s
            for r in self.buckets:
                before = time.perf_counter()
                self._guard(r.wait)
                exposed += time.perf_counter() - before
                handle = self._guard(r.finish, self.timeline)
                if handle is not None:
                    st.intervals.append((handle.started_at, handle.completed_at or before))
            self.stats.append(st.record(self.timeline, time.perf_counter(), exposed))
            result = list(st.tensors)
            if self._rebuild_pending and not (self.postpone_rebuild is not None
                                              and self.postpone_rebuild()):
                self._rebuild_pending = False  # rank 0's ready order, for all
                order = self._from_root(np.array(st.ready_order, dtype=np.int64), "bucket_order")
                self._order = order.tolist()
                self.replan(self._order)
                self.rebuilt = True
            if self.autotuner is not None and self.autotuner.decision is None:
                self._autotune(self.autotuner)
            self._state = StepState(st.step + 1, len(self.specs), len(self.plan))
            return result

    def launch_all(self) -> None:
        """Start every bucket not started yet (tensors never marked ready
        contribute zeros), except those that would wait for a slab of an
        earlier bucket: this never blocks. ``synchronize()`` starts the rest.
        A rank that must not block (one that has joined, answering other
        collectives meanwhile) calls this, polls ``all_done()`` (which starts
        what it can), then ``synchronize()``."""
        with self._lock:
            st = self._state
            if st.syncing:
                return
            self._check_usable(f"scheduler {self.name!r}")
            st.sync_start = time.perf_counter()
            st.syncing = True
            ops = self._backend()
            for i, spec in enumerate(self.specs):
                if st.tensors[i] is None:
                    st.tensors[i] = ops.zeros(spec.shape, spec.dtype, spec.device)
                if st.passes[i] < self.backward_passes_per_step:  # not ready yet
                    self._set_ready(i)
            self._launch_ready(block=False)

    def all_done(self) -> bool:
        """Non-blocking, after ``launch_all()``: has every bucket's collective
        started and finished? Starts buckets whose slab came free."""
        with self._lock:
            self._launch_ready(block=False)
            return self._state.next_launch == len(self.plan) and \
                all(self._guard(r.done) for r in self.buckets)

    def view_for(self, index: int, like: Any = None) -> Any:
        """A tensor shaped like spec ``index`` that lives inside its fusion buffer.

        An adapter may use it as the gradient's storage (PyTorch DDP's
        ``gradient_as_bucket_view``): a gradient passed to ``mark_ready`` that
        *is* this view is reduced without the pack and unpack copies. ``like``
        (a tensor of the adapter's framework) picks the array backend when no
        gradient was seen yet. The view stays valid until the plan changes:
        compare ``plan_version`` before reusing it. A single-tensor bucket
        needs no view: its gradient is reduced in place anyway. The buffer is
        pinned from then on.
        """
        with self._lock:
            index = self._index(index)
            r = self.buckets[self.bucket_of[index]]
            if not r.pinned and r.handle is not None:
                raise DPPluginError(
                    f"{self.name!r}: a view of tensor {self.specs[index].name!r} was asked for "
                    "while its bucket is in flight; take views before the bucket starts (a "
                    "programming error in the caller)")
            member = r.entry.members.index(index)
            return r.view(self._backend(like), member).reshape(self.specs[index].shape)

    def adopt(self, index: int, tensor: Any) -> Any:
        """``tensor`` (this step's gradient of spec ``index``) moved into its
        slice of the fusion buffer; returns that view, shaped like the spec.

        Call it before ``mark_ready`` (see ``view_for``); a gradient that stays
        the view costs no copy at all in later steps. Returns ``tensor`` itself
        when it already is the view, when its bucket reduces it in place anyway
        (a one-member bucket), or when the tensor was already marked ready this
        step (its bucket may be in flight).
        """
        with self._lock:
            index, _ = self._checked(index, tensor)
            if self._state.passes[index] or self.buckets[self.bucket_of[index]].in_place:
                return tensor
            ops = self._backend(tensor)
            view = self.view_for(index, tensor)
            if ops.shares_memory(view, tensor):
                return tensor
            ops.pack(view.reshape(-1), tensor)
            return view

    def close(self) -> None:
        """Flush and close the timeline; later steps still work but record no events."""
        self.timeline.close()

    # -- the step -------------------------------------------------------------
    def _index(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise TypeError(f"mark_ready index must be an int, got {index!r}")
        if not 0 <= index < len(self.specs):
            raise IndexError(
                f"mark_ready index {index} is out of range: {len(self.specs)} tensors were "
                f"registered with scheduler {self.name!r} (valid: 0..{len(self.specs) - 1})"
            )
        return int(index)

    def _checked(self, index: int, tensor: Any) -> tuple[int, TensorSpec]:
        """``index`` as an int and its spec, once ``tensor`` is checked against it."""
        index = self._index(index)
        spec = self.specs[index]
        if not (isinstance(tensor, np.ndarray) or is_torch(tensor)):
            # Anything else (a list, a numpy scalar) would be converted to a
            # copy, and the reduced values written back into that copy.
            raise TypeError(
                f"mark_ready for tensor {spec.name!r} needs a numpy array or a torch tensor "
                f"(the result is written back into it in place), got {type(tensor).__name__}"
            )
        try:
            shape, dtype, device = spec_of(tensor)
        except TypeError as exc:
            raise TypeError(f"mark_ready for tensor {spec.name!r}: {exc}") from None
        if shape != spec.shape or dtype != spec.dtype or device != spec.device:
            raise ValueError(
                f"mark_ready got a tensor that does not match its registration: registered "
                f"{spec.describe()}, got shape {shape} {dtype} on {device}. Pass the gradient of "
                "the registered tensor, or re-create the scheduler after changing the model"
            )
        return index, spec

    def _set_ready(self, index: int) -> None:
        st = self._state
        st.ready_count[self.bucket_of[index]] += 1
        st.ready_order.append(index)

    def _launch_ready(self, block: bool = True) -> None:
        """Launch complete buckets, strictly in index order; with ``block=False``
        stop before one that would wait for an earlier bucket's slab."""
        st = self._state
        while st.next_launch < len(self.plan) and \
                st.ready_count[st.next_launch] == len(self.plan[st.next_launch].members):
            r = self.buckets[st.next_launch]
            if r.numel:  # an empty bucket moves nothing; every rank skips it alike (same plan)
                members = [st.tensors[i] for i in r.entry.members]
                ops = self._backend(members[0])
                if not block and self._guard(r.would_wait, ops, members):
                    return
                t0 = time.perf_counter()
                self._check_usable()
                self.agree()
                handle = self._guard(r.start, ops, members, self.policy, self.hook, self.state)
                if st.syncing:  # launched late: nothing overlaps it any more
                    st.late_launch_s += time.perf_counter() - t0
                sent = handle.payload_bytes  # a hook that sends less (PowerSGD) says so
                st.bytes += r.numel * itemsize(r.wire_dtype) if sent is None else sent
                st.launched += 1
            st.next_launch += 1

    def _poll(self) -> None:
        """Timestamp completions of in-flight all-reduces (for the stats).

        Buckets finish roughly in launch order, so only the oldest unfinished
        one is tested: O(1) per ready event instead of O(buckets).
        """
        st = self._state
        while st.polled < st.next_launch:
            if not self._guard(self.buckets[st.polled].done):
                return
            st.polled += 1

    def _autotune(self, tuner: Autotuner) -> None:
        """One step of autotune: re-plan for the threshold ``tuner`` switches
        to, if any (every rank at the same point, between steps), and record it."""
        threshold = tuner.step_ended(
            lambda t: tuple(b.members for b in self._plan(self._order, t)),  # the plan of t
            lambda medians: self._from_root(medians, "autotune"))
        if threshold is None:
            return
        self.fusion_threshold = threshold
        self.settings["fusion threshold"] = threshold
        self.replan(self._order)
        now = time.perf_counter()
        if tuner.decision is None:
            self.timeline.instant(f"autotune: try {mib(threshold)}", "autotune", now, tid="step",
                                  args={"threshold": threshold})
            return
        self.timeline.instant("autotune: decision", "autotune", now, tid="step",
                              args=tuner.decision.as_args())
        if self.engine.rank == 0:
            log.info("dp_plugin: %s [%s]", tuner.decision.describe(), self.name)

    def _from_root(self, values: np.ndarray, what: str) -> np.ndarray:
        """Rank 0's ``values`` on every rank (one broadcast on this Reducer's engine)."""
        buf = to_device(values, self.engine.buffer_device)
        if self.engine.size > 1:
            self._guard(lambda: self.engine.broadcast(buf, 0, name=f"{self.name}.{what}"))
        return to_host(buf)

    # -- errors -------------------------------------------------------------------------
    def _guard(self, fn: Any, *args: Any) -> Any:
        """Run a step of the protocol; on failure the Reducer is unusable: the
        ranks no longer agree on what comes next, so later calls re-raise
        instead of starting collectives that could only mismatch or hang."""
        try:
            return fn(*args)
        except BaseException as exc:
            self.broken = exc
            raise

    def _check_usable(self, subject: str | None = None) -> None:
        """Raise if an earlier collective failed; ``subject`` names the caller
        in the message (default: this Reducer's name)."""
        if self.broken is not None:
            who = f"{self.name!r}" if subject is None else subject
            raise DPPluginError(
                f"{who} failed earlier ({type(self.broken).__name__}: {self.broken}); "
                "the ranks' collectives are out of step, so it cannot continue. Fix the cause "
                "and restart the job"
            ) from self.broken


class GradientScheduler(Reducer):
    """Turn "this gradient is ready" events into fused all-reduces.

    An adapter registers every tensor to reduce once (``specs``, in
    registration order), calls ``mark_ready(i, grad)`` from each gradient's
    backward hook and ``synchronize()`` before the optimizer steps::

        sched = GradientScheduler([TensorSpec.of(n, p) for n, p in named_params])
        # backward: for each gradient as it is produced
        sched.mark_ready(i, grad_i)
        reduced = sched.synchronize()      # grads now hold the averaged values

    Distributed contract:
    - every rank constructs the scheduler with the same specs, in the same
      order, and the same ``op``, ``compression``, threshold, scale factors,
      ``backward_passes_per_step`` and ``rebuild_buckets`` setting; the first
      step checks all of them and raises ``LayoutMismatchError`` on every
      rank, naming the tensor or setting that differs;
    - buckets are launched strictly in bucket-index order on every rank,
      whatever order the gradients become ready in, so the engines always see
      the same sequence of collectives;
    - ``mark_ready`` may start collectives (and, in the first step, the
      agreement check), and wait for an earlier bucket whose slab a copied
      bucket needs (``dp_plugin.reduce.bucket``: at most two in flight per kind);
      ``synchronize()`` is a synchronization point: it returns once every
      bucket has been reduced on this rank. After the first
      ``synchronize()`` the plan may be rebuilt from rank 0's observed ready
      order (one broadcast);
    - a tensor passed to ``mark_ready`` must not be modified until
      ``synchronize()`` returns; the reduced values are written back into it.

    Scaling is Horovod's (``dp_plugin.reduce.hooks.ReducePolicy``). ``engine``
    defaults to the one ``dp_plugin.init()`` started; ``fusion_threshold``
    (bytes) to ``engine.config.bucket_caps`` (an explicit one applies to every
    bucket); ``timeline`` to the Chrome trace named by ``engine.config.timeline``;
    ``name`` prefixes the collectives' names; ``autotune=True`` measures the
    candidate thresholds of ``engine.config`` during the first steps and keeps
    the fastest (``dp_plugin.reduce.autotune``). The other arguments are
    ``Reducer``'s.

    Calls are serialised by a lock, so ``mark_ready`` may come from autograd's
    worker threads; one step must still end (``synchronize()``) before the
    next begins.
    """

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        *,
        engine: Any = None,
        op: ReduceOp | str = "average",
        gradient_predivide_factor: float = 1.0,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        backward_passes_per_step: int = 1,
        timeline: Any = None,
        **options: Any,
    ) -> None:
        if engine is None:
            engine = runtime.engine()
        checked = checked_specs(specs)
        policy = ReducePolicy(op, engine.size, predivide=gradient_predivide_factor,
                              prescale=prescale_factor, postscale=postscale_factor,
                              gradients=checked)
        config = engine.config
        if timeline is None:
            timeline = open_timeline(config.timeline, engine.rank, config.timeline_max_bytes)
        super().__init__(checked, engine=engine, policy=policy,
                         passes=backward_passes_per_step, timeline=timeline, **options)
