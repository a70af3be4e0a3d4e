"""Gradient scheduling: ready events -> fused, asynchronous, ordered all-reduces.

See ``GradientScheduler``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dp_plugin.arrays import ArrayOps, NumpyOps, is_torch, ops_for, spec_of
from dp_plugin.compression import Compressor, get_compressor
from dp_plugin.dtypes import is_floating, itemsize
from dp_plugin.engines.base import Handle, ReduceOp
from dp_plugin.errors import DPPluginError
from dp_plugin.fusion import Bucket, TensorSpec, plan_buckets
from dp_plugin.layout import check_layout, control_device, to_device, to_host
from dp_plugin.timeline import StatsHistory, StepStats, open_timeline, union_length

_ACCUMULATION_ERROR = (
    "Gradients were computed more than backward_passes_per_step times before call to "
    "step()/synchronize(). Increase backward_passes_per_step to accumulate gradients locally."
)


class _BucketState:
    """Persistent buffers of one bucket and its in-flight collective."""

    __slots__ = ("aliased", "bucket", "direct", "flat", "handle", "pack_span", "views", "wire")

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.flat: Any = None
        """The fusion buffer, in the bucket's dtype; allocated on first use."""
        self.wire: Any = None
        """What the engine reduces: ``flat`` itself, or a narrower copy when compressing."""
        self.views: list[Any] = []
        """One 1-D slice of ``flat`` per member, made once with the buffer."""
        self.handle: Handle | None = None
        self.pack_span: tuple[float, float] = (0.0, 0.0)
        self.direct: Any = None
        """This step's tensor itself (1-D alias) when it was reduced in place, unpacked."""
        self.aliased: list[bool] = []
        """Per member, this step: the tensor *is* its slice of ``flat`` (no copy needed)."""


class GradientScheduler:
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
      order, and the same ``op``, ``compression``, threshold and
      ``backward_passes_per_step`` (and the same ``rebuild_buckets`` setting);
      the first step checks the layout and raises ``LayoutMismatchError`` on
      every rank if the specs differ;
    - buckets are launched strictly in bucket-index order on every rank,
      whatever order the gradients become ready in, so the engines always see
      the same sequence of collectives;
    - ``mark_ready`` may start collectives (and, in the first step, the
      layout check); ``synchronize()`` is a synchronization point: it returns
      once every bucket has been reduced on this rank. After the first
      ``synchronize()`` the plan may be rebuilt from rank 0's observed ready
      order (one broadcast);
    - a tensor passed to ``mark_ready`` must not be modified until
      ``synchronize()`` returns; the reduced values are written back into it.

    Scaling follows Horovod's torch ``DistributedOptimizer``: with
    ``op='average'`` each rank multiplies by ``prescale/f`` before the sum and
    the result by ``postscale*f/size`` after it (``f`` is
    ``gradient_predivide_factor``); ``op='sum'`` applies only the user's
    factors; min/max/product allow no scaling.

    Arguments: ``engine`` defaults to the one ``dp_plugin.init()`` started
    (``NotInitializedError`` before it); ``fusion_threshold`` (bytes) to
    ``engine.config.fusion_threshold``; ``timeline`` to the Chrome trace named
    by ``engine.config.timeline`` (none if unset); ``compression`` is 'none',
    'fp16', 'bf16' or a ``Compressor``; ``name`` prefixes the collectives'
    names; ``array_ops`` overrides the array backend, which is otherwise
    chosen from the first tensor passed to ``mark_ready``.

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
        fusion_threshold: int | None = None,
        timeline: Any = None,
        name: str = "grads",
        array_ops: ArrayOps | None = None,
    ) -> None:
        if engine is None:
            from dp_plugin import runtime

            engine = runtime.engine()
        self.engine = engine
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        self.name = name
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        for i, spec in enumerate(self.specs):
            if not isinstance(spec, TensorSpec):
                raise TypeError(
                    f"specs[{i}] must be a dp_plugin.fusion.TensorSpec, got "
                    f"{type(spec).__name__}; build them with TensorSpec.of(name, tensor)"
                )
        self.op = ReduceOp.parse(op)
        self.compressor = get_compressor(compression)
        predivide = _positive("gradient_predivide_factor", gradient_predivide_factor)
        prescale = _positive("prescale_factor", prescale_factor)
        postscale = _positive("postscale_factor", postscale_factor)
        if (
            isinstance(backward_passes_per_step, bool)
            or not isinstance(backward_passes_per_step, int)
            or backward_passes_per_step < 1
        ):
            raise ValueError(
                f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}"
            )
        self.backward_passes_per_step = backward_passes_per_step
        self._prescale, self._postscale = self._scales(predivide, prescale, postscale)
        # Average is a sum here, scaled by postscale; min/max/product are native.
        self._engine_op = (
            ReduceOp.SUM if self.op in (ReduceOp.SUM, ReduceOp.AVERAGE) else self.op
        )
        self.fusion_threshold = (
            engine.config.fusion_threshold if fusion_threshold is None else fusion_threshold
        )
        self.plan: list[Bucket] = plan_buckets(self.specs, self.fusion_threshold)
        self.rebuilt = False
        """True once the plan was rebuilt from the ready order of the first step."""
        self._timeline = (
            open_timeline(engine.config.timeline, engine.rank) if timeline is None else timeline
        )
        self.stats = StatsHistory()
        """``StepStats`` of the recent completed ``synchronize()`` calls (step 0 first)."""

        self._ops: ArrayOps | None = array_ops
        self._lock = threading.RLock()
        self._layout_checked = False
        self._broken: BaseException | None = None
        self._step = -1  # _reset_step() below makes it 0
        self._states: list[_BucketState] = []
        self._bucket_of: list[int] = []
        # Per-step state, (re)set by _reset_step().
        self._passes: list[int] = []
        self._tensors: list[Any] = []
        self._is_ready: list[bool] = []
        self._ready_count: list[int] = []
        self._ready_order: list[int] = []
        self._next_launch = 0
        self._polled = 0
        """Buckets below this index are known to have finished (see _poll)."""
        self._step_start: float | None = None
        self._syncing = False
        self._sync_launch_s = 0.0
        self._bytes = 0
        self._launched = 0
        self._plan_version = -1
        self._install_plan(self.plan)
        self._reset_step()

    # -- public API ----------------------------------------------------------
    def mark_ready(self, index: int, tensor: Any) -> None:
        """Report that ``tensor`` holds the gradient of spec ``index`` for this pass.

        On the ``backward_passes_per_step``-th call for a tensor since the last
        ``synchronize()`` it counts as ready; complete buckets are launched in
        bucket order. May run collectives (see the class docstring).
        """
        with self._lock:
            self._raise_if_broken()
            spec = self._spec(index)
            index = int(index)
            self._check_tensor(spec, tensor)
            if self._ops is None:
                self._ops = ops_for(tensor)
            if self._step_start is None:
                self._step_start = time.perf_counter()
            if self._passes[index] >= self.backward_passes_per_step:
                raise DPPluginError(
                    f"{_ACCUMULATION_ERROR} (tensor {spec.name!r}, "
                    f"backward_passes_per_step={self.backward_passes_per_step})"
                )
            self._passes[index] += 1
            self._tensors[index] = tensor
            if self._passes[index] == self.backward_passes_per_step:
                self._set_ready(index)
                self._guarded(self._launch_ready)
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
        with self._lock:
            self._raise_if_broken()
            start = time.perf_counter()
            self._syncing = True
            step_start = start if self._step_start is None else self._step_start
            ops = self._backend()
            for bucket in self.plan:
                for i in bucket.members:
                    if self._tensors[i] is None:
                        spec = self.specs[i]
                        self._tensors[i] = ops.zeros(spec.shape, spec.dtype, spec.device)
                    if not self._is_ready[i]:
                        self._set_ready(i)
            self._guarded(self._launch_ready)
            exposed = self._sync_launch_s
            for st in self._states:
                if st.handle is not None:
                    before = time.perf_counter()
                    self._guarded(st.handle.wait, st)
                    exposed += time.perf_counter() - before
                self._finish(st)
            end = time.perf_counter()
            self._record(step_start, start, end, exposed)
            result = list(self._tensors)
            if self._step == 0 and self.engine.config.rebuild_buckets:
                order = self._ready_order
                self._guarded(lambda: self._rebuild(order))
            self._reset_step()
            return result

    def close(self) -> None:
        """Flush and close the timeline; later steps still work but record no events."""
        self._timeline.close()

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
            spec = self._spec(index)
            if self._ops is None and like is not None:
                self._ops = ops_for(like)
            ops = self._backend()
            st = self._states[self._bucket_of[int(index)]]
            if st.flat is None:
                self._allocate(st, ops)
            view = st.views[st.bucket.members.index(int(index))]
            return view.reshape(spec.shape)

    @property
    def plan_version(self) -> int:
        """Changes whenever the bucket plan (and so every fusion buffer) is replaced."""
        return self._plan_version

    # -- construction helpers -------------------------------------------------
    def _scales(self, predivide: float, prescale: float, postscale: float) -> tuple[float, float]:
        if self.op is ReduceOp.AVERAGE:
            for spec in self.specs:
                if not is_floating(spec.dtype):
                    raise TypeError(
                        f"tensor {spec.name!r} is {spec.dtype}, but op='average' needs "
                        "floating tensors; use op='sum' for integer tensors, or register "
                        "only floating ones"
                    )
            return prescale / predivide, postscale * predivide / self.engine.size
        if predivide != 1.0:
            raise ValueError(
                f"gradient_predivide_factor={predivide:g} only applies to op='average' (got "
                f"op={self.op.value!r}); leave it at 1.0"
            )
        if self.op is ReduceOp.SUM:
            if prescale != 1.0 or postscale != 1.0:
                for spec in self.specs:
                    if not is_floating(spec.dtype):
                        raise TypeError(
                            f"tensor {spec.name!r} is {spec.dtype}, which cannot be scaled by "
                            f"prescale_factor={prescale:g} / postscale_factor={postscale:g}; "
                            "leave both at 1.0 for integer tensors"
                        )
            return prescale, postscale
        if prescale != 1.0 or postscale != 1.0:
            raise ValueError(
                f"op={self.op.value!r} does not allow scaling (prescale_factor={prescale:g}, "
                f"postscale_factor={postscale:g}); leave both at 1.0, or use op='sum'/'average'"
            )
        return 1.0, 1.0

    def _install_plan(self, plan: list[Bucket]) -> None:
        self.plan = plan
        self._plan_version += 1
        self._states = [_BucketState(b) for b in plan]
        self._bucket_of = [0] * len(self.specs)
        for b in plan:
            for i in b.members:
                self._bucket_of[i] = b.index

    def _reset_step(self) -> None:
        n = len(self.specs)
        self._passes = [0] * n
        self._tensors = [None] * n
        self._is_ready = [False] * n
        self._ready_count = [0] * len(self.plan)
        self._next_launch = 0
        self._polled = 0
        self._step_start = None
        self._sync_launch_s = 0.0
        self._syncing = False
        self._bytes = 0
        self._launched = 0
        self._step += 1
        self._ready_order = []
        for st in self._states:
            st.handle = None

    # -- the step -------------------------------------------------------------
    def _spec(self, index: int) -> TensorSpec:
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise TypeError(f"mark_ready index must be an int, got {index!r}")
        if not 0 <= index < len(self.specs):
            raise IndexError(
                f"mark_ready index {index} is out of range: {len(self.specs)} tensors were "
                f"registered with scheduler {self.name!r} (valid: 0..{len(self.specs) - 1})"
            )
        return self.specs[int(index)]

    def _check_tensor(self, spec: TensorSpec, tensor: Any) -> None:
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

    def _backend(self) -> ArrayOps:
        if self._ops is None:
            # Nothing was marked ready: a CPU-only layout reduces in numpy;
            # any device tensor needs torch.
            if all(s.device == "cpu" for s in self.specs):
                self._ops = NumpyOps()
            else:
                from dp_plugin.arrays import TorchOps

                self._ops = TorchOps()
        return self._ops

    def _set_ready(self, index: int) -> None:
        self._is_ready[index] = True
        self._ready_count[self._bucket_of[index]] += 1
        self._ready_order.append(index)

    def _launch_ready(self) -> None:
        """Launch complete buckets, strictly in index order."""
        while (
            self._next_launch < len(self.plan)
            and self._ready_count[self._next_launch] == len(self.plan[self._next_launch].members)
        ):
            if not self._layout_checked:
                # Before the first collective of the first step, on every rank.
                self._layout_checked = True
                check_layout(self.engine, self.specs, what=f"tensors of scheduler {self.name!r}")
            self._launch(self._states[self._next_launch])
            self._next_launch += 1

    def _launch(self, st: _BucketState) -> None:
        bucket = st.bucket
        if bucket.numel == 0:
            return  # nothing to reduce; every rank skips it alike (same plan)
        ops = self._backend()
        t0 = time.perf_counter()
        st.direct = self._direct_buffer(st, ops)
        if st.direct is not None:
            # One uncompressed contiguous tensor: reduce it where it lies,
            # saving the pack and unpack copies (large embeddings, big layers).
            if self._prescale != 1.0:
                ops.scale_(st.direct, self._prescale)
            wire = st.direct
        else:
            if st.flat is None:
                self._allocate(st, ops)
            st.aliased = []
            for i, view in zip(bucket.members, st.views, strict=True):
                tensor = self._tensors[i]
                aliased = ops.shares_memory(view, tensor)
                st.aliased.append(aliased)
                if aliased:  # the gradient already lives in the fusion buffer
                    if self._prescale != 1.0:
                        ops.scale_(view, self._prescale)
                elif self._prescale != 1.0:
                    ops.pack_scaled(view, tensor, self._prescale)
                else:
                    ops.pack(view, tensor)
            self.compressor.compress(ops, st.wire, st.flat)
            wire = st.wire
        t1 = time.perf_counter()
        handle = self.engine.allreduce_async(
            wire, self._engine_op, name=f"{self.name}.bucket{bucket.index}"
        )
        t2 = time.perf_counter()
        # The engine's timeout message quotes the description: make it name the bucket.
        handle.description = f"{handle.description} [{self._describe(bucket)}]"
        st.handle = handle
        st.pack_span = (t0, t1)
        if self._syncing:  # launched late: nothing overlaps it any more
            self._sync_launch_s += t2 - t1
        self._bytes += bucket.numel * itemsize(self.compressor.wire_dtype(bucket.dtype))
        self._launched += 1

    def _direct_buffer(self, st: _BucketState, ops: ArrayOps) -> Any:
        bucket = st.bucket
        if len(bucket.members) != 1 or self.compressor.wire_dtype(bucket.dtype) != bucket.dtype:
            return None
        return ops.flat_alias(self._tensors[bucket.members[0]])

    def _allocate(self, st: _BucketState, ops: ArrayOps) -> None:
        bucket = st.bucket
        st.flat = ops.empty(bucket.numel, bucket.dtype, bucket.device)
        st.views = [
            ops.slice(st.flat, off, off + self.specs[i].numel)
            for i, off in zip(bucket.members, bucket.offsets, strict=True)
        ]
        wire_dtype = self.compressor.wire_dtype(bucket.dtype)
        st.wire = (
            st.flat
            if wire_dtype == bucket.dtype
            else ops.empty(bucket.numel, wire_dtype, bucket.device)
        )

    def _poll(self) -> None:
        """Timestamp completions of in-flight all-reduces (for the stats).

        Buckets finish roughly in launch order, so only the oldest unfinished
        one is tested: O(1) per ready event instead of O(buckets).
        """
        while self._polled < self._next_launch:
            st = self._states[self._polled]
            if st.handle is not None and not self._guarded(st.handle.done, st):
                return
            self._polled += 1

    def _finish(self, st: _BucketState) -> None:
        """Decompress, post-scale and unpack one reduced bucket."""
        bucket = st.bucket
        if st.handle is None:
            return
        ops = self._backend()
        t0 = time.perf_counter()
        post = self._postscale
        if st.direct is not None:
            if post != 1.0:
                ops.scale_(st.direct, post)
            st.direct = None
        else:
            self.compressor.decompress(ops, st.flat, st.wire)
            for i, view, aliased in zip(bucket.members, st.views, st.aliased, strict=True):
                if aliased:
                    if post != 1.0:
                        ops.scale_(view, post)
                elif post != 1.0:
                    ops.unpack_scaled(self._tensors[i], view, post)
                else:
                    ops.unpack(self._tensors[i], view)
        t1 = time.perf_counter()
        args = {"bucket": bucket.index, "tensors": len(bucket.members), "bytes": bucket.nbytes}
        tl = self._timeline
        tl.span(f"pack {bucket.index}", "pack", *st.pack_span, tid="pack", args=args)
        done = st.handle.completed_at or t0
        tl.span(f"allreduce {bucket.index}", "allreduce", st.handle.started_at, done,
                tid="allreduce", args=args)
        tl.span(f"unpack {bucket.index}", "unpack", t0, t1, tid="unpack", args=args)

    def _record(self, step_start: float, sync_start: float, end: float, exposed: float) -> None:
        intervals = [
            (st.handle.started_at, st.handle.completed_at or end)
            for st in self._states
            if st.handle is not None
        ]
        stats = StepStats(
            step=self._step,
            buckets=self._launched,
            bytes_reduced=self._bytes,
            allreduce_s=union_length(intervals),
            exposed_s=exposed,
            step_s=end - step_start,
        )
        self.stats.append(stats)
        self._timeline.span(
            f"step {self._step}", "step", step_start, end, tid="step",
            args={"buckets": stats.buckets, "bytes": stats.bytes_reduced,
                  "exposed_s": exposed, "synchronize_s": end - sync_start},
        )
        self._timeline.flush()

    def _rebuild(self, observed: list[int]) -> None:
        """Adopt rank 0's observed ready order as the bucket order (one broadcast)."""
        order = to_device(np.array(observed, dtype=np.int64), control_device(self.specs))
        if self.engine.size > 1:
            self.engine.broadcast(order, 0, name=f"{self.name}.bucket_order")
        plan = plan_buckets(self.specs, self.fusion_threshold, order=to_host(order).tolist())
        if [b.members for b in plan] != [b.members for b in self.plan]:
            self._install_plan(plan)  # new buffers are allocated on first use
        self.rebuilt = True

    # -- errors -----------------------------------------------------------------
    def _describe(self, bucket: Bucket) -> str:
        names = ", ".join(repr(self.specs[i].name) for i in bucket.members[:3])
        more = ", ..." if len(bucket.members) > 3 else ""
        return (
            f"bucket {bucket.index} of {self.name!r}: {len(bucket.members)} tensor(s), "
            f"{bucket.nbytes} bytes {bucket.dtype} on {bucket.device}, first {names}{more}"
        )

    def _guarded(self, fn: Any, st: _BucketState | None = None) -> Any:
        """Run a step of the protocol; on failure the scheduler is unusable.

        After a failed collective the ranks no longer agree on what comes
        next, so later calls re-raise instead of starting collectives that
        could only mismatch or hang.
        """
        try:
            return fn()
        except BaseException as exc:
            self._broken = exc
            add_note = getattr(exc, "add_note", None)  # Python >= 3.11
            if st is not None and add_note is not None:
                add_note(f"while reducing {self._describe(st.bucket)}")
            raise

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise DPPluginError(
                f"scheduler {self.name!r} failed earlier ({type(self._broken).__name__}: "
                f"{self._broken}); the ranks' collectives are out of step, so it cannot "
                "continue. Fix the cause and restart the job"
            ) from self._broken


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)

