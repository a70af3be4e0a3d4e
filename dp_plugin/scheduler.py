"""Gradient reduction: ready events -> fused, asynchronous, ordered all-reduces.

``Reducer`` (one per gradient stream) tracks which gradients of the current
step are ready and launches its buckets (``dp_plugin.collective``) in
order; everything about one step lives in a ``StepState`` that is replaced
when the step ends. ``GradientScheduler`` is the Reducer built from the
user's keyword arguments (the core's public edge: it validates them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dp_plugin.agreement import to_device, to_host
from dp_plugin.arrays import ArrayOps, is_torch, spec_of
from dp_plugin.autotune import Autotuner, agreement_setting
from dp_plugin.collective import FusedCollective
from dp_plugin.compression import Compressor
from dp_plugin.engines.base import ReduceOp
from dp_plugin.errors import DPPluginError
from dp_plugin.fusion import TensorSpec, checked_specs, default_order
from dp_plugin.hooks import CommHook, ReducePolicy
from dp_plugin.step_state import StepState
from dp_plugin.timeline import StatsHistory, open_timeline
from dp_plugin.validate import check_int

_ACCUMULATION_ERROR = (
    "Gradients were computed more than backward_passes_per_step times before call to "
    "step()/synchronize(). Increase backward_passes_per_step to accumulate gradients locally."
)


class Reducer:
    """One gradient stream's reduction (DDP's ``Reducer``): ready tracking,
    fused buckets launched in order, the step's state, the agreement and the
    per-rank flags that ride on the last bucket.

    One constructor: ``policy`` is the one ``ReducePolicy`` (scaling),
    built where the arguments were validated (``GradientScheduler`` for a
    caller of the core; ``hvd.DistributedOptimizer`` and TensorFlow's
    ``parse_reduction`` for theirs); ``passes`` is ``backward_passes_per_step``.
    ``flags`` names groups of per-rank flags (one element per rank each) in
    the control slot: ``flags_of(name)`` is a group's elements, reduced
    (unscaled) with the last bucket, so they cost no collective of their
    own. ``what`` names the tensors in an agreement's messages. ``groups``
    (lists of spec indices) are reduced as one bucket each, launched when the
    whole group is ready (Horovod's ``groups=``; ``plan_buckets``). The other
    arguments are ``GradientScheduler``'s.
    """

    def __init__(self, specs: Sequence[TensorSpec], *, engine: Any, policy: ReducePolicy,
                 passes: int = 1, compression: str | Compressor = "none",
                 fusion_threshold: int | None = None, timeline: Any = None,
                 name: str = "grads", array_ops: ArrayOps | None = None,
                 hook: CommHook | None = None, flags: Sequence[str] = (),
                 settings: dict[str, Any] | None = None, autotune: bool = False,
                 what: str | None = None, groups: Sequence[Sequence[int]] = ()) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        self.engine, self.name, config = engine, name, engine.config
        self.specs: tuple[TensorSpec, ...] = checked_specs(specs)
        self.backward_passes_per_step = check_int("backward_passes_per_step", passes,
                                                  minimum=1)
        self.op = policy.op
        self.flag_names = tuple(flags)
        threshold, first = config.bucket_caps(fusion_threshold,
                                              sum(s.nbytes for s in self.specs))
        self.rebuild_buckets = bool(config.rebuild_buckets)
        self._timeline = timeline if timeline is not None else open_timeline(
            config.timeline, engine.rank, config.timeline_max_bytes)
        self.fused = FusedCollective(
            self.specs, engine=engine, name=name, threshold=threshold, first_threshold=first,
            policy=policy, compression=compression, hook=hook,
            groups=groups, control_numel=len(self.flag_names) * engine.size,
            settings={"backward_passes_per_step": self.backward_passes_per_step,
                      "rebuild_buckets": self.rebuild_buckets, **(settings or {}),
                      "DP_PLUGIN_AUTOTUNE": agreement_setting(config, autotune)},
            timeline=self._timeline, array_ops=array_ops,
            what=what or f"tensors of scheduler {name!r}")
        """The buckets (internal: callers use the Reducer's methods)."""
        self.fusion_threshold = threshold
        self.autotuner = Autotuner.of(config, threshold) if autotune else None
        """Measures bucket sizes in the first steps (``autotune=True``), else None."""
        self._order = default_order(len(self.specs))
        self.rebuilt = False
        """True once the plan was rebuilt from the ready order of the first step."""
        self.stats = StatsHistory()
        """``StepStats`` of the recent completed ``synchronize()`` calls (step 0 first)."""
        self._lock = threading.RLock()
        self._state = StepState(0, len(self.specs), len(self.plan))

    def agree(self) -> None:
        """Check now that every rank registered the same tensors and settings
        (collective; otherwise the first bucket's launch does it). Call it at
        a point every rank reaches in the same order (the optimizer's
        construction, the step being traced), never in a gradient hook: it
        blocks. Raises ``LayoutMismatchError`` on every rank."""
        self.fused.agree()

    def flags_of(self, name: str, like: Any = None) -> Any:
        """The flag group ``name`` (one element per rank of the engine, in the
        control slot): write this rank's element before the step's last
        bucket launches; read every rank's after ``synchronize()``. Ask each
        time: the elements move when the plan is rebuilt. ``like`` picks the
        array backend."""
        k, n = self.flag_names.index(name), self.engine.size
        with self._lock:
            return self.fused.control(like)[k * n:(k + 1) * n]

    @property
    def plan(self) -> list[Any]:
        return self.fused.plan

    @property
    def plan_version(self) -> int:
        """Changes whenever the bucket plan (and so every fusion buffer) is replaced."""
        return self.fused.plan_version

    # -- public API ----------------------------------------------------------
    def mark_ready(self, index: int, tensor: Any) -> None:
        """Report that ``tensor`` holds the gradient of spec ``index`` for this pass.

        On the ``backward_passes_per_step``-th call for a tensor since the last
        ``synchronize()`` it counts as ready; complete buckets are launched in
        bucket order. May run collectives (see the class docstring).
        """
        with self._lock:
            self.fused.check_usable(f"scheduler {self.name!r}")
            index, spec = self._checked(index, tensor)
            self.fused.backend(tensor)
            st = self._state
            if st.started_at is None:
                st.started_at = time.perf_counter()
            if st.passes[index] >= self.backward_passes_per_step:
                raise DPPluginError(
                    f"{_ACCUMULATION_ERROR} (tensor {spec.name!r}, "
                    f"backward_passes_per_step={self.backward_passes_per_step})"
                )
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
            for b in self.plan:
                before = time.perf_counter()
                self.fused.wait(b.index)
                exposed += time.perf_counter() - before
                handle = self.fused.finish(b.index)
                if handle is not None:
                    st.intervals.append((handle.started_at, handle.completed_at or before))
            self.stats.append(st.record(self._timeline, time.perf_counter(), exposed))
            result = list(st.tensors)
            if st.step == 0 and self.rebuild_buckets:
                self._rebuild(st.ready_order)
            if self.autotuner is not None and not self.autotuner.done:
                self.fusion_threshold = self.autotuner.after_step(
                    self.fused, self._order, self._timeline,
                    lambda medians: self._from_root(medians, "autotune"),
                    log_here=self.engine.rank == 0)
            self._state = StepState(st.step + 1, len(self.specs), len(self.plan))
            return result

    def launch_all(self) -> None:
        """Start every bucket not started yet (tensors never marked ready
        contribute zeros), except those that would wait for a slab of an
        earlier bucket (``dp_plugin.slabs``): this never blocks.
        ``synchronize()`` starts the rest. A rank that must not block (one
        that has joined, answering other collectives meanwhile) calls this,
        polls ``all_done()`` (which starts what it can), then ``synchronize()``."""
        with self._lock:
            st = self._state
            if st.syncing:
                return
            self.fused.check_usable(f"scheduler {self.name!r}")
            st.sync_start = time.perf_counter()
            st.syncing = True
            ops = self.fused.backend()
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
                all(self.fused.done(b.index) for b in self.plan)

    def view_for(self, index: int, like: Any = None) -> Any:
        """A tensor shaped like spec ``index`` that lives inside its fusion buffer.

        An adapter may use it as the gradient's storage (PyTorch DDP's
        ``gradient_as_bucket_view``): a gradient passed to ``mark_ready`` that
        *is* this view is reduced without the pack and unpack copies. ``like``
        (a tensor of the adapter's framework) picks the array backend when no
        gradient was seen yet. The view stays valid until the plan changes:
        compare ``plan_version`` before reusing it (it changes at most once,
        when the first step's ready order rebuilds the plan). A single-tensor
        bucket needs no view: its gradient is reduced in place anyway.
        """
        with self._lock:
            return self.fused.view(self._index(index), like)

    def adopt(self, index: int, tensor: Any) -> Any:
        """``tensor`` (this step's gradient of spec ``index``) moved into its
        slice of the fusion buffer; returns that view, shaped like the spec.

        For an adapter that keeps the view as the gradient's storage (DDP's
        ``gradient_as_bucket_view``): call it before ``mark_ready``; the bucket
        is then reduced without its pack and unpack copies, and a gradient
        that stays the view costs no copy at all in later steps. Returns
        ``tensor`` itself when it already is the view, when its bucket reduces
        it in place anyway (a one-member bucket), or when the tensor was
        already marked ready this step (its bucket may be in flight).
        """
        with self._lock:
            index, _ = self._checked(index, tensor)
            if self._state.passes[index] or not self.fused.packs(index):
                return tensor
            ops = self.fused.backend(tensor)
            view = self.fused.view(index, tensor)
            if ops.shares_memory(view, tensor):
                return tensor
            ops.pack(view.reshape(-1), tensor)
            return view

    def close(self) -> None:
        """Flush and close the timeline; later steps still work but record no events."""
        self._timeline.close()

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
            got = TensorSpec(spec.name, shape, dtype, device)
            raise ValueError(
                f"mark_ready got a tensor that does not match its registration: "
                f"registered {spec.describe()}, got shape {got.shape} {got.dtype} on "
                f"{got.device}. Pass the gradient of the registered tensor, or re-create the "
                "scheduler after changing the model"
            )
        return index, spec

    def _set_ready(self, index: int) -> None:
        st = self._state
        st.ready_count[self.fused.bucket_of[index]] += 1
        st.ready_order.append(index)

    def _launch_ready(self, block: bool = True) -> None:
        """Launch complete buckets, strictly in index order; with ``block=False``
        stop before one that would wait for an earlier bucket's slab."""
        st = self._state
        plan = self.plan
        while st.next_launch < len(plan) and \
                st.ready_count[st.next_launch] == len(plan[st.next_launch].members):
            if not block and self.fused.would_block(st.next_launch, st.tensors):
                return
            t0 = time.perf_counter()
            handle = self.fused.start(st.next_launch, st.tensors)
            if handle is not None:
                if st.syncing:  # launched late: nothing overlaps it any more
                    st.late_launch_s += time.perf_counter() - t0
                st.bytes += self.fused.wire_bytes(st.next_launch)
                st.launched += 1
            st.next_launch += 1

    def _poll(self) -> None:
        """Timestamp completions of in-flight all-reduces (for the stats).

        Buckets finish roughly in launch order, so only the oldest unfinished
        one is tested: O(1) per ready event instead of O(buckets).
        """
        st = self._state
        while st.polled < st.next_launch:
            if not self.fused.done(st.polled):
                return
            st.polled += 1

    def _rebuild(self, observed: list[int]) -> None:
        """Adopt rank 0's observed ready order as the bucket order (one broadcast)."""
        order = self._from_root(np.array(observed, dtype=np.int64), "bucket_order")
        self._order = order.tolist()
        self.fused.replan(self._order)
        self.rebuilt = True

    def _from_root(self, values: np.ndarray, what: str) -> np.ndarray:
        """Rank 0's ``values`` on every rank (one broadcast on this scheduler's engine)."""
        buf = to_device(values, self.engine.buffer_device)

        def share() -> None:
            if self.engine.size > 1:
                self.engine.broadcast(buf, 0, name=f"{self.name}.{what}")

        self.fused.guard(share)
        return to_host(buf)


class GradientScheduler(Reducer):
    """Turn "this gradient is ready" events into fused all-reduces.

    An adapter registers every tensor to reduce once (``specs``, in
    registration order), calls ``mark_ready(i, grad)`` from each gradient's
    backward hook and ``synchronize()`` before the optimizer steps::

        sched = GradientScheduler([TensorSpec.of(n, p) for n, p in named_params])
        # backward: for each gradient as it is produced
        sched.mark_ready(i, grad_i)
        reduced = sched.synchronize()      # grads now hold the averaged values

    Tensors are grouped into fusion buckets (``dp_plugin.fusion``). When every
    gradient of a bucket is ready the bucket is packed into a persistent flat
    buffer, scaled, optionally compressed, and its all-reduce starts, so
    communication overlaps the rest of backward.

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
      bucket needs (``dp_plugin.slabs``: at most two in flight per kind);
      ``synchronize()`` is a synchronization point: it returns once every
      bucket has been reduced on this rank. After the first
      ``synchronize()`` the plan may be rebuilt from rank 0's observed ready
      order (one broadcast);
    - a tensor passed to ``mark_ready`` must not be modified until
      ``synchronize()`` returns; the reduced values are written back into it.

    Scaling follows Horovod's torch ``DistributedOptimizer``
    (``dp_plugin.hooks.ReducePolicy``): with ``op='average'`` each rank
    multiplies by ``prescale/f`` before the sum and the result by
    ``postscale*f/size`` after it (``f`` is ``gradient_predivide_factor``).

    Arguments: ``engine`` defaults to the one ``dp_plugin.init()`` started;
    ``fusion_threshold`` (bytes) to ``engine.config.fusion_threshold``, with
    the first bucket capped at ``engine.config.first_bucket_threshold`` and
    a small gradient spread over ``engine.config.min_buckets`` buckets (an
    explicit ``fusion_threshold`` applies to every bucket);
    ``timeline`` to the Chrome trace named by ``engine.config.timeline``;
    ``compression`` is 'none', 'fp16', 'bf16' or a ``Compressor``; ``hook``
    replaces the default all-reduce hook (``dp_plugin.hooks``); ``name``
    prefixes the collectives' names; ``flags`` names groups of per-rank
    flags reduced with the last bucket (``flags_of``); ``settings`` (name ->
    value) are the caller's settings the first step compares across ranks;
    ``autotune=True`` measures the candidate thresholds of ``engine.config``
    during the first steps and keeps the fastest (``dp_plugin.autotune``).

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
        compression: str | Compressor = "none",
        gradient_predivide_factor: float = 1.0,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        backward_passes_per_step: int = 1,
        **options: Any,
    ) -> None:
        if engine is None:
            from dp_plugin import runtime

            engine = runtime.engine()
        checked = checked_specs(specs)
        passes = check_int("backward_passes_per_step", backward_passes_per_step, minimum=1)
        policy = ReducePolicy.make(op, engine.size, [(s.name, s.dtype) for s in checked],
                                   predivide=gradient_predivide_factor,
                                   prescale=prescale_factor, postscale=postscale_factor)
        super().__init__(checked, engine=engine, policy=policy, passes=passes,
                         compression=compression, **options)
