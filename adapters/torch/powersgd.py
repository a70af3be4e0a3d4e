"""PowerSGD low-rank gradient compression with error feedback, as a comm hook.

    from dp_plugin.torch.powersgd import PowerSGDHook

    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    optimizer.register_comm_hook(PowerSGDHook(rank=8, start_iter=10))  # the defaults

The algorithm is Vogels et al. (2019), as torch's DDP ``powerSGD_hook``
runs it; what is compressed and the bytes it moves are
``dp_plugin.reduce.powersgd``'s. Per fusion bucket, each step past ``start_iter``:

1. each compressed member ``M`` (its matrix view) gets this rank's error of
   the last step added; the error buffer takes a copy of ``M``;
2. ``P = M Q`` with the warm-started ``Q`` (orthogonalized); ``P`` and the
   members that travel whole (biases, norms, small matrices, the control
   slot) are packed into one wire buffer and all-reduced (sum);
3. once that is back: the whole members are copied home, each ``P`` is
   orthogonalized, ``Q = M^T P`` and the ``Q`` s are all-reduced (sum);
4. once that is back: ``M`` is replaced by ``P Q^T`` (the approximation of
   the ranks' sum; the unpack's post-scale averages it, as for a plain
   all-reduce), and the error becomes ``M - P Q^T / size``.

Every rank computes ``P Q^T`` from the same summed ``P`` and ``Q``, so the
ranks' gradients stay bitwise equal; only the errors differ per rank.

Both all-reduces are ordinary all-reduces through the optimizer's engine,
so every engine (Gloo with shared memory and the hierarchical path, MPI,
Horovod's ring) carries them, overlapped with backward like any bucket.
Step 3 starts when step 2 completes, which differs in time between ranks,
so the ``Q`` all-reduces run on a second communicator of their own
(``bind``: made when the hook is registered, on every rank) and are
started strictly in bucket order: on each communicator every rank runs the
same all-reduces in the same order, and nothing blocks while a bucket is
started (``hvd.join()`` starts a joined rank's zero steps without waiting).

State: the error and ``Q`` of each bucket live in the bucket
(``GradBucket.scratch``), so a new bucket plan (the first step's rebuild,
``refresh_parameters()``, autotune) starts them afresh; the step counter
lives in the hook (one hook per optimizer). None of it is in checkpoints or
the elastic state: after a restart the hook starts again with
``start_iter`` plain steps, zero errors and the seeded ``Q`` (see
docs/torch.md, "PowerSGD").
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from dp_plugin.engines.base import Engine, Handle, ReduceOp
from dp_plugin.reduce.hooks import GradBucket, HookState
from dp_plugin.reduce.powersgd import DEFAULT_RANK, DEFAULT_START_ITER, PowerSGDSettings, matrix_of

__all__ = ["PowerSGDHook"]


@dataclass(frozen=True, slots=True)
class _Matrix:
    """One compressed member: ``flat[offset:offset + n * m]`` as ``n x m``, rank ``r``;
    its ``P`` at ``p`` in the wire buffer (after the whole members), its
    ``Q`` at ``q`` in the Q buffer, its error at ``e`` in the error buffer."""

    offset: int
    n: int
    m: int
    r: int
    p: int
    q: int
    e: int


@dataclass(frozen=True, slots=True)
class _Layout:
    """How one bucket is compressed (the same on every rank: from the plan)."""

    matrices: tuple[_Matrix, ...]
    names: tuple[str, ...]
    """The compressed members' names (their ``Q`` s are seeded by name)."""
    whole: tuple[tuple[int, int, int], ...]
    """``[start, stop)`` ranges of ``flat`` that travel whole, and where each
    starts in the wire buffer."""
    whole_numel: int
    p_numel: int
    q_numel: int
    e_numel: int


def _layout(bucket: GradBucket, settings: PowerSGDSettings) -> _Layout:
    matrices, names, whole = [], [], []
    p = q = e = whole_numel = 0
    for name, shape, offset in zip(bucket.names, bucket.shapes, bucket.offsets, strict=True):
        found = matrix_of(shape, settings)
        if found is None:
            numel = math.prod(shape)
            if numel:
                whole.append((offset, offset + numel, whole_numel))
                whole_numel += numel
            continue
        n, m, r = found
        matrices.append(_Matrix(offset, n, m, r, p, q, e))
        names.append(name)
        p, q, e = p + n * r, q + m * r, e + n * m
    total = int(bucket.flat.shape[0])
    if bucket.control_numel:  # the per-rank flags: exact, every element
        whole.append((total - bucket.control_numel, total, whole_numel))
        whole_numel += bucket.control_numel
    return _Layout(tuple(matrices), tuple(names), tuple(whole), whole_numel, p, q, e)


def initial_q(name: str, m: int, r: int, seed: int) -> torch.Tensor:
    """The first ``Q`` (``m x r``, float32, standard normal) of the tensor
    ``name``: the same on every rank, and whatever bucket it falls in."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(m, r, generator=gen)


def orthogonalize_(a: torch.Tensor, epsilon: float) -> None:
    """Gram-Schmidt on the columns of ``a`` (``n x r``), in place; ``epsilon``
    keeps an all-zero column zero."""
    for i in range(a.shape[1]):
        col = a[:, i:i + 1]
        col.div_(torch.linalg.vector_norm(col) + epsilon)
        if i + 1 < a.shape[1]:
            rest = a[:, i + 1:]
            rest.sub_(col @ (col.mT @ rest))


class PowerSGDHook:
    """A comm hook (``optimizer.register_comm_hook``) that all-reduces each
    bucket's gradients as rank-``rank`` approximations with error feedback,
    after ``start_iter`` steps of plain all-reduces (``dp_plugin.reduce.powersgd``
    for the other arguments and the rules). See the module docstring.

    Distributed contract: every rank registers a hook with the same
    settings, at the same point (registering is collective: it makes the
    hook's second communicator), and one hook serves one optimizer. The
    reduction must be a sum or an average (``op=hvd.Average`` or ``hvd.Sum``).
    """

    def __init__(self, rank: int = DEFAULT_RANK, start_iter: int = DEFAULT_START_ITER, *,
                 min_compression_rate: float = 2.0, seed: int = 0,
                 epsilon: float = 1e-8) -> None:
        self.settings = PowerSGDSettings(rank=rank, start_iter=start_iter,
                                         min_compression_rate=min_compression_rate, seed=seed,
                                         epsilon=epsilon)
        self.__name__ = "powersgd_hook"
        self.step = 0
        """Steps begun (counted at each step's first bucket)."""
        self.sent_numel = 0
        """Elements this rank has put into all-reduces so far (the wire formula's count)."""
        self._engine: Engine | None = None
        self._q_engine: Engine | None = None
        self._waiting: list[_Compressed] = []
        """Buckets whose ``Q`` all-reduce has not started, in bucket order."""

    def describe(self) -> str:
        """The settings, compared across ranks when the optimizer is wrapped."""
        return self.settings.describe()

    def bind(self, state: HookState, new_channel: Callable[[str], Engine]) -> None:
        """Attach to the optimizer's engine (``state.engine``) and make the
        communicator the ``Q`` all-reduces run on (``new_channel(name)``: a
        new communicator over the same ranks). Collective: the optimizer
        calls it when the hook is registered (and its buckets re-planned),
        on every rank, once the ranks agreed on the settings."""
        if state.engine_op is not ReduceOp.SUM:
            raise ValueError(
                f"PowerSGD approximates a sum, but this optimizer reduces with "
                f"op={state.engine_op.value!r}; use op=hvd.Average (the default) or hvd.Sum, "
                "or no PowerSGDHook")
        engine = state.engine
        if self._engine is engine:
            return
        if self._engine is not None and not self._engine.closed:
            raise ValueError(
                "this PowerSGDHook is already registered with another optimizer; its step "
                "counter and errors belong to one: make one PowerSGDHook(...) per optimizer")
        self._engine = engine
        self._q_engine = new_channel("powersgd.q")
        self._waiting = []

    def __call__(self, state: HookState, bucket: GradBucket) -> Handle:
        engine, q_engine = self._engine, self._q_engine
        if engine is None or q_engine is None or state.engine is not engine:
            raise ValueError(
                "PowerSGDHook was called on an engine it was not bound to; register it with "
                "optimizer.register_comm_hook(hook) on every rank (that binds it), or call "
                "hook.bind(state, new_channel) on every rank before the first step")
        if bucket.index == 0:
            self.step += 1
        flat = bucket.buffer()
        compress = self.step > self.settings.start_iter
        if compress and "powersgd" not in bucket.scratch:
            bucket.scratch["powersgd"] = _layout(bucket, self.settings)
        layout = bucket.scratch["powersgd"] if compress else None
        if layout is None or not layout.matrices:  # a plain step, or nothing worth compressing
            self.sent_numel += int(flat.shape[0])
            return engine.allreduce_async(flat, ReduceOp.SUM, name=bucket.label)
        compressed = _Compressed(self, bucket, layout)
        self._waiting.append(compressed)
        return compressed

    def _start_qs(self, upto: _Compressed, block: bool) -> None:
        """Start ``Q`` all-reduces strictly in bucket order: each waiting
        bucket up to ``upto`` (``block``: waiting for its ``P``), then every
        later one whose ``P`` is back already, so that one wait does not hold
        back the buckets behind it."""
        waiting = self._waiting
        while waiting:
            first = waiting[0]
            if not first._first.done() and not (block and upto._second is None):
                return
            first._first.wait()
            first._second = self._start_q(first._bucket, first._layout)
            waiting.pop(0)

    # -- the three phases of one bucket, called by _Compressed ---------------------------
    def _buffers(self, bucket: GradBucket, layout: _Layout) -> tuple[torch.Tensor, ...]:
        """The bucket's wire, Q and error buffers (made once; Q seeded alike on
        every rank, the error zero)."""
        scratch = bucket.scratch
        if "powersgd.q" not in scratch:
            flat = bucket.flat
            make = dict(dtype=flat.dtype, device=flat.device)
            scratch["powersgd.wire"] = torch.empty(layout.whole_numel + layout.p_numel, **make)
            scratch["powersgd.error"] = torch.zeros(layout.e_numel, **make)
            scratch["powersgd.q"] = torch.cat([  # each Q stored transposed, r x m
                initial_q(name, x.m, x.r, self.settings.seed).mT.reshape(-1)
                for name, x in zip(layout.names, layout.matrices, strict=True)]).to(**make)
        return tuple(scratch[f"powersgd.{k}"] for k in ("wire", "q", "error"))

    def _start_p(self, bucket: GradBucket, layout: _Layout) -> Handle:
        flat = bucket.buffer()
        wire, q, error = self._buffers(bucket, layout)
        eps = self.settings.epsilon
        for lo, hi, at in layout.whole:
            wire[at:at + hi - lo].copy_(flat[lo:hi])
        base = layout.whole_numel
        for x in layout.matrices:
            m = flat[x.offset:x.offset + x.n * x.m].view(x.n, x.m)
            e = error[x.e:x.e + x.n * x.m].view(x.n, x.m)
            m.add_(e)
            e.copy_(m)  # the error is M minus what comes back (_finish)
            qt = q[x.q:x.q + x.m * x.r].view(x.r, x.m)
            orthogonalize_(qt.mT, eps)
            torch.matmul(m, qt.mT, out=wire[base + x.p:base + x.p + x.n * x.r].view(x.n, x.r))
        self.sent_numel += int(wire.shape[0])
        return self._engine.allreduce_async(  # type: ignore[union-attr]
            wire, ReduceOp.SUM, name=f"{bucket.label}.powersgd.p")

    def _start_q(self, bucket: GradBucket, layout: _Layout) -> Handle:
        flat = bucket.buffer()
        wire, q, _ = self._buffers(bucket, layout)
        for lo, hi, at in layout.whole:
            flat[lo:hi].copy_(wire[at:at + hi - lo])
        base = layout.whole_numel
        for x in layout.matrices:
            p = wire[base + x.p:base + x.p + x.n * x.r].view(x.n, x.r)
            orthogonalize_(p, self.settings.epsilon)
            m = flat[x.offset:x.offset + x.n * x.m].view(x.n, x.m)
            # Q^T = P^T M: M^T P reads M against its layout (20x slower on a CPU).
            torch.matmul(p.mT, m, out=q[x.q:x.q + x.m * x.r].view(x.r, x.m))
        self.sent_numel += int(q.shape[0])
        return self._q_engine.allreduce_async(  # type: ignore[union-attr]
            q, ReduceOp.SUM, name=f"{bucket.label}.powersgd.q")

    def _finish(self, bucket: GradBucket, layout: _Layout) -> None:
        flat = bucket.buffer()
        wire, q, error = self._buffers(bucket, layout)
        share = 1.0 / self._engine.size  # type: ignore[union-attr]
        base = layout.whole_numel
        for x in layout.matrices:
            p = wire[base + x.p:base + x.p + x.n * x.r].view(x.n, x.r)
            qt = q[x.q:x.q + x.m * x.r].view(x.r, x.m)
            m = flat[x.offset:x.offset + x.n * x.m].view(x.n, x.m)
            torch.matmul(p, qt, out=m)
            error[x.e:x.e + x.n * x.m].view(x.n, x.m).sub_(m, alpha=share)


class _Compressed(Handle):
    """One bucket's two all-reduces as one handle: ``P`` (with the whole
    members) starts at once; ``Q`` once ``P`` is back and every earlier
    bucket's ``Q`` has started (polling never blocks; waiting does)."""

    def __init__(self, hook: PowerSGDHook, bucket: GradBucket, layout: _Layout) -> None:
        first = hook._start_p(bucket, layout)
        super().__init__(f"PowerSGD all-reduces of {bucket.label!r}", first.rank,
                         first.timeout_s)
        self._hook, self._bucket, self._layout = hook, bucket, layout
        self._first: Handle = first
        self._second: Handle | None = None
        self.payload_bytes = bucket.flat.element_size() * (
            layout.whole_numel + layout.p_numel + layout.q_numel)
        self.then(self._complete)

    def _complete(self) -> None:
        """Wait for the ``Q`` all-reduce's own handle, which runs its
        finishers (Horovod's synchronize, which frees the name; a staged
        copy back) also when polling found it done, then write the bucket."""
        self._second.wait()  # type: ignore[union-attr]
        self._hook._finish(self._bucket, self._layout)

    def _advance(self, block: bool) -> bool:
        """Start this bucket's ``Q`` all-reduce if it can start now (``block``:
        wait until it can), and every later one that can. True once this one
        has started."""
        if self._second is None:
            self._hook._start_qs(self, block)
        return self._second is not None

    def _test(self) -> bool:
        return self._advance(block=False) and self._second is not None and self._second.done()

    def _block(self, timeout_s: float) -> bool:
        """Each all-reduce waits under its own engine's timeout."""
        self._advance(block=True)
        self._second.wait()  # type: ignore[union-attr]
        return True

    def report(self) -> str:
        return (self._second or self._first).report()

