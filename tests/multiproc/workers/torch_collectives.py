"""Worker: every tensor collective of dp_plugin.torch against a local reference.

Run under any launcher (see tests/multiproc/harness.py)::

    python torch_collectives.py --engine gloo --case collectives    # prints "rank R OK"
    python torch_collectives.py --list-cases

Inputs are deterministic per (rank, case), so every rank computes the
expected result of every collective locally, from all ranks' inputs. One
launch runs one case. ``collectives``: allreduce (every op, dtypes, 0-dim,
empty, non-contiguous, pre/post scale, in place, async, grouped, fp16
compression), allgather (uneven), broadcast (every root), alltoall (uneven
splits), reducescatter (Horovod's split rule), sparse allreduce, barrier and
process sets when the engine supports them; ``autograd`` through each
collective; ``mistakes``: rank-dependent mistakes (shape,
dtype, root, splits, group size, name; a duplicate name on one rank (raised there alone),
different collectives), which must raise the
same error on every rank and leave the engine usable: a final all-reduce
proves the ranks still agree. Any failure prints a traceback and exits 1 at
once (``os._exit``): the other ranks then fail their next collective
(``DP_PLUGIN_TIMEOUT``) instead of waiting.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from _fail_fast import run_cases

import dp_plugin.torch.ops as ops
from dp_plugin.api.process_sets import add_process_set, remove_process_set
from dp_plugin.errors import DPPluginError, MismatchError
from dp_plugin.torch.autograd_ops import (
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    reducescatter,
)
from dp_plugin.torch.basics import init as hvd_init
from dp_plugin.torch.basics import rank as hvd_rank
from dp_plugin.torch.basics import shutdown as hvd_shutdown
from dp_plugin.torch.basics import size as hvd_size
from dp_plugin.torch.collectives import (
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_async_,
    grouped_allreduce_async,
    reducescatter_async,
)
from dp_plugin.torch.handles import poll, synchronize
from dp_plugin.torch.sparse import sparse_allreduce_async
from dp_plugin.torch.submit import DuplicateNameError

RANK = 0
SIZE = 1
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def data(rank: int, case: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input for ``case``: the same on every process."""
    seed = int.from_bytes(hashlib.sha256(f"{case}/{rank}".encode()).digest()[:4], "little")
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-20, 21, shape, generator=g, dtype=torch.int64).to(dtype)


def inputs(case: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    return [data(r, case, shape, dtype) for r in range(SIZE)]


def close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{what}: got {got.dtype}{tuple(got.shape)}, "
                             f"want {want.dtype}{tuple(want.shape)}")
    tol = TOL.get(want.dtype, 0.0)
    ok = (torch.equal(got, want) if tol == 0.0 else
          torch.allclose(got.double(), want.double(), rtol=tol, atol=tol))
    if not ok:
        raise AssertionError(f"{what}: got {got.flatten()[:8].tolist()}, "
                             f"want {want.flatten()[:8].tolist()}")


def grad(x: torch.Tensor) -> torch.Tensor:
    if x.grad is None:
        raise AssertionError("no gradient reached the input")
    return x.grad


def reference(xs: list[torch.Tensor], op: Any, pre: float = 1.0, post: float = 1.0) -> torch.Tensor:
    """Horovod's result: prescale each input, reduce, postscale (Average: / size)."""
    dtype = xs[0].dtype
    if dtype.is_floating_point:
        stack = torch.stack([x.double() * pre for x in xs])
    else:
        stack = torch.stack([(x.double() * pre).trunc() for x in xs])
    reduced = {ops.Sum: stack.sum(0), ops.Average: stack.sum(0), ops.Min: stack.min(0).values,
               ops.Max: stack.max(0).values, ops.Product: stack.prod(0)}[op]
    factor = post / SIZE if op is ops.Average else post
    out = reduced * factor
    return (out if dtype.is_floating_point else out.trunc()).to(dtype)


# -- cases ----------------------------------------------------------------------------


def check_allreduce() -> None:
    shapes: list[tuple[int, ...]] = [(), (0,), (7,), (3, 4)]
    for op in (ops.Average, ops.Sum, ops.Min, ops.Max, ops.Product):
        for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16):
            for shape in shapes:
                case = f"ar/{op}/{dtype}/{shape}"
                xs = inputs(case, shape, dtype)
                if op is ops.Product and not dtype.is_floating_point:
                    xs = [x.remainder(3) + 1 for x in xs]  # no overflow
                pre, post = (0.5, 3.0) if dtype.is_floating_point else (1.0, 2.0)
                if op is ops.Product and dtype == torch.float16:
                    pre, post = 1.0, 1.0
                mine = xs[RANK].clone()
                out = allreduce(mine, name=case, op=op, prescale_factor=pre,
                                postscale_factor=post)
                close(case, out, reference(xs, op, pre, post))
                close(f"{case} input untouched", mine, xs[RANK])
    # non-contiguous, in place, async, deprecated average
    xs = inputs("ar/strided", (4, 6), torch.float32)
    want = reference(xs, ops.Sum)
    close("strided", allreduce(xs[RANK].t(), op=ops.Sum), want.t())
    target = xs[RANK].clone().t()
    allreduce_(target, op=ops.Sum, name="strided_")
    close("strided in place", target, want.t())
    mine = xs[RANK].clone()
    handle = allreduce_async_(mine, op=ops.Sum, name="async_")
    while not poll(handle):
        pass
    if synchronize(handle) is not mine:
        raise AssertionError("allreduce_async_ must return its input")
    close("async in place", mine, want)
    close("async", synchronize(allreduce_async(xs[RANK], op=ops.Average)),
          reference(xs, ops.Average))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        close("average=False", allreduce(xs[RANK], average=False), want)


def check_grouped_and_compression() -> None:
    specs = [((3,), torch.float32), ((2, 2), torch.int64), ((), torch.float64),
             ((5,), torch.float32), ((0,), torch.float32), ((4,), torch.float16)]
    groups = [inputs(f"grp/{i}", s, d) for i, (s, d) in enumerate(specs)]
    mine = [g[RANK] for g in groups]
    outs = grouped_allreduce(mine, name="grp", op=ops.Sum, postscale_factor=2.0)
    for i, g in enumerate(groups):
        close(f"grouped {i}", outs[i], reference(g, ops.Sum, post=2.0))
    copies = [t.clone() for t in mine]
    grouped_allreduce_(copies, op=ops.Max)
    for i, g in enumerate(groups):
        close(f"grouped_ {i}", copies[i], reference(g, ops.Max))
    outs = synchronize(grouped_allreduce_async(mine, op=ops.Average, name="grp_async"))
    for i, g in enumerate(groups):
        close(f"grouped async {i}", outs[i], reference(g, ops.Average))
    xs = inputs("fp16", (64,), torch.float32)
    out = allreduce(xs[RANK], compression=ops.Compression.fp16, op=ops.Sum)
    want = reference([x.half().double() for x in xs], ops.Sum).float()
    if out.dtype != torch.float32 or not torch.allclose(out, want, rtol=3e-3, atol=3e-3):
        raise AssertionError(f"fp16 compression: {out[:4].tolist()} vs {want[:4].tolist()}")


def check_gather_broadcast() -> None:
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        parts = [data(r, f"ag/{dtype}", (r + 1, 3), dtype) for r in range(SIZE)]
        close(f"allgather {dtype}", allgather(parts[RANK], name=f"ag/{dtype}"), torch.cat(parts))
    empty = [torch.zeros(0 if r % 2 else 2, 2) for r in range(SIZE)]
    close("allgather some empty", synchronize(allgather_async(empty[RANK])), torch.cat(empty))
    a = [data(r, "gag/a", (r + 2,), torch.float64) for r in range(SIZE)]
    b = [data(r, "gag/b", (SIZE - r, 2), torch.int32) for r in range(SIZE)]
    outs = grouped_allgather([a[RANK], b[RANK]], name="gag")
    close("grouped allgather a", outs[0], torch.cat(a))
    close("grouped allgather b", outs[1], torch.cat(b))
    for root in range(SIZE):
        for shape in [(), (5, 2), (0,)]:
            xs = inputs(f"bc/{root}/{shape}", shape, torch.float32)
            close(f"broadcast root {root} {shape}", broadcast(xs[RANK], root), xs[root])
        mine = inputs(f"bc_/{root}", (3, 3), torch.int32)
        target = mine[RANK].clone().t()
        broadcast_(target, root, name=f"bc_/{root}")
        close(f"broadcast_ root {root}", target, mine[root].t())
        target = mine[RANK].clone()
        if synchronize(broadcast_async_(target, root)) is not target:
            raise AssertionError("broadcast_async_ must return its input")
        close(f"broadcast_async_ root {root}", target, mine[root])


def sent_rows(src: int) -> tuple[torch.Tensor, list[int]]:
    """Rank ``src``'s alltoall input: splits[j] = (src + j) % 3 rows to rank j."""
    splits = [(src + j) % 3 for j in range(SIZE)]
    rows = sum(splits)
    values = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + 1000 * src
    return values, splits


def received_rows(dst: int) -> tuple[torch.Tensor, list[int]]:
    blocks, counts = [], []
    for src in range(SIZE):
        values, splits = sent_rows(src)
        start = sum(splits[:dst])
        blocks.append(values[start:start + splits[dst]])
        counts.append(splits[dst])
    return torch.cat(blocks), counts


def check_alltoall_reducescatter() -> None:
    values, splits = sent_rows(RANK)
    want, counts = received_rows(RANK)
    out, recv = alltoall(values, splits=splits, name="a2a")
    close("alltoall uneven", out, want)
    if recv.tolist() != counts or recv.dtype != torch.int32:
        raise AssertionError(f"alltoall received splits {recv} != {counts}")
    out, recv = synchronize(alltoall_async(values, torch.tensor(splits, dtype=torch.int64)))
    close("alltoall async", out, want)
    if recv.dtype != torch.int64:
        raise AssertionError(f"received splits dtype {recv.dtype}, want int64")
    even = [torch.arange(2 * SIZE, dtype=torch.int64) * 10 + r for r in range(SIZE)]
    close("alltoall even", alltoall(even[RANK]),
          torch.cat([e[2 * RANK:2 * RANK + 2] for e in even]))
    rows = 2 * SIZE + 1
    counts = [rows // SIZE + (1 if r < rows % SIZE else 0) for r in range(SIZE)]
    start = sum(counts[:RANK])
    for op, pre, post in [(ops.Sum, 1.0, 1.0), (ops.Average, 2.0, 0.5)]:
        xs = inputs(f"rs/{op}", (rows, 3), torch.float64)
        full = reference(xs, op, pre, post)
        out = reducescatter(xs[RANK], op=op, prescale_factor=pre, postscale_factor=post)
        close(f"reducescatter {op}", out, full[start:start + counts[RANK]])
    ints = inputs("rs/int", (rows,), torch.int32)
    close("reducescatter int async", synchronize(reducescatter_async(ints[RANK], op=ops.Sum)),
          reference(ints, ops.Sum)[start:start + counts[RANK]])
    pair = [inputs("rs/g0", (rows, 2), torch.float32), inputs("rs/g1", (SIZE,), torch.float32)]
    outs = grouped_reducescatter([p[RANK] for p in pair], op=ops.Sum, name="rsg")
    close("grouped reducescatter 0", outs[0], reference(pair[0], ops.Sum)[start:start +
                                                                          counts[RANK]])
    close("grouped reducescatter 1", outs[1], reference(pair[1], ops.Sum)[RANK:RANK + 1])


def check_sparse_and_barrier() -> None:
    dense = []
    for r in range(SIZE):
        d = torch.zeros(6, 3)
        d[r % 6] = r + 1.0
        d[(2 * r + 1) % 6, 1] = 0.5 * (r + 1)
        d[0, 2] = 1.0  # every rank touches row 0
        dense.append(d)
    for op in (ops.Sum, ops.Average):
        handle = sparse_allreduce_async(dense[RANK].to_sparse(), f"sp/{op}", op)
        want = torch.stack(dense).sum(0) / (SIZE if op is ops.Average else 1)
        close(f"sparse {op}", handle().to_dense(), want)
    barrier()


def check_autograd() -> None:
    w = [torch.arange(4.0) + r for r in range(SIZE)]  # rank r's upstream weights
    mean_w = torch.stack(w).mean(0)
    x = torch.ones(4, requires_grad=True)
    (allreduce(x, op=ops.Sum, postscale_factor=2.0) * w[RANK]).sum().backward()
    close("grad allreduce", grad(x), torch.stack(w).sum(0) * 2)
    x = torch.ones(4, requires_grad=True)
    (allreduce(x) * w[RANK]).sum().backward()
    close("grad allreduce average", grad(x), mean_w)
    xs = [torch.ones(3, requires_grad=True), torch.ones(2, requires_grad=True)]
    outs = grouped_allreduce(xs, op=ops.Sum)
    (outs[0].sum() * (RANK + 1) + outs[1].sum()).backward()
    close("grad grouped 0", grad(xs[0]), torch.full((3,), SIZE * (SIZE + 1) / 2))
    close("grad grouped 1", grad(xs[1]), torch.full((2,), float(SIZE)))
    # allgather: gradient = average over ranks of the upstream, this rank's rows
    rows = [r + 1 for r in range(SIZE)]
    x = torch.ones(rows[RANK], 2, requires_grad=True)
    weights = [torch.arange(sum(rows) * 2.0).reshape(-1, 2) * (r + 1) for r in range(SIZE)]
    (allgather(x) * weights[RANK]).sum().backward()
    start = sum(rows[:RANK])
    close("grad allgather", grad(x),
          torch.stack(weights).mean(0)[start:start + rows[RANK]])
    # broadcast: the root gets the averaged gradient, the others zeros
    root = SIZE - 1
    x = torch.ones(4, requires_grad=True)
    (broadcast(x, root) * w[RANK]).sum().backward()
    close("grad broadcast", grad(x), mean_w if root == RANK else torch.zeros(4))
    # alltoall: the gradient of each sent row is the receiver's weight for it
    values, splits = sent_rows(RANK)
    x = values.clone().requires_grad_()
    out, _ = alltoall(x, splits=splits)
    (out * (RANK + 1)).sum().backward()
    receivers = [j for j in range(SIZE) for _ in range(splits[j])]
    want = torch.tensor([[j + 1.0] * 2 for j in receivers]).reshape(-1, 2)
    close("grad alltoall", grad(x), want)
    # reducescatter (Sum): Horovod's gradient is the all-gather of size * upstream
    rows_total = 2 * SIZE + 1
    x = torch.ones(rows_total, 2, requires_grad=True)
    out = reducescatter(x, op=ops.Sum)
    (out * (RANK + 1)).sum().backward()
    counts = [rows_total // SIZE + (1 if r < rows_total % SIZE else 0) for r in range(SIZE)]
    want = torch.cat([torch.full((counts[r], 2), float(SIZE * (r + 1))) for r in range(SIZE)])
    close("grad reducescatter", grad(x), want)


# -- mistakes: the same error on every rank -----------------------------------------


def expect_everywhere(what: str, error: type[BaseException], pattern: str,
                      fn: Callable[[], Any]) -> None:
    """``fn`` must raise ``error`` matching ``pattern`` here, and every rank
    must see the same message (compared by hash; the part after 'On this
    rank' is each rank's own detail)."""
    try:
        fn()
    except error as exc:
        text = str(exc)
        if not re.search(pattern, text, re.S):
            raise AssertionError(f"{what}: message {text!r} lacks {pattern!r}") from exc
        common = text.split(" On this rank:")[0]
    else:
        raise AssertionError(f"{what}: no {error.__name__} raised")
    digest = int.from_bytes(hashlib.sha256(common.encode()).digest()[:7], "little")
    everyone = allgather(torch.tensor([digest], dtype=torch.int64), name=f"msg/{what}")
    if len(set(everyone.tolist())) != 1:
        raise AssertionError(f"{what}: ranks raised different messages; mine: {common}")


def check_mistakes() -> None:
    last = RANK == SIZE - 1
    expect_everywhere("shape", MismatchError, r"Mismatched allreduce tensor shapes for 'w'",
                      lambda: allreduce(torch.ones(5 if last else 4), name="w"))
    expect_everywhere("dtype", MismatchError, r"Mismatched allgather tensor types",
                      lambda: allgather(torch.ones(2, dtype=torch.int32 if last else
                                                   torch.int64)))
    expect_everywhere("root", MismatchError, r"Mismatched broadcast tensor root ranks",
                      lambda: broadcast(torch.ones(2), 0 if last else SIZE - 1))
    expect_everywhere("splits", ValueError, rf"rank\(s\) \[{SIZE - 1}\] passed invalid splits",
                      lambda: alltoall(torch.ones(SIZE), splits=[SIZE] + [1] * (SIZE - 1)
                                       if last else [1] * SIZE))
    expect_everywhere("group", MismatchError, r"Mismatched group sizes",
                      lambda: grouped_allreduce([torch.ones(2)] * (3 if last else 2)))
    expect_everywhere("name", MismatchError, r"Mismatched names for allreduce",
                      lambda: allreduce(torch.ones(2), name="b" if last else "a"))
    expect_everywhere("op", MismatchError, r"Mismatched reducescatter tensor reduce ops",
                      lambda: reducescatter(torch.ones(SIZE), op=ops.Sum if last else
                                            ops.Average))
    expect_everywhere("kind", MismatchError, r"Mismatched collectives",
                      lambda: allgather(torch.ones(2)) if last else allreduce(torch.ones(2)))
    # A name still in flight: ValueError on that rank alone, nothing sent (Horovod).
    handle = allreduce_async(torch.ones(1), name="dup")
    if last:
        try:
            allreduce(torch.ones(1), name="dup")
        except DuplicateNameError as exc:
            assert "Only this rank raises" in str(exc), exc
        else:
            raise AssertionError("duplicate: no DuplicateNameError on the rank that reused it")
    close("first dup", synchronize(handle), torch.ones(1))
    close("second dup", allreduce(torch.ones(2), op=ops.Sum, name="dup"),
          torch.full((2,), float(SIZE)))
    # The engine is still in step on every rank.
    close("after mistakes", allreduce(torch.ones(3), op=ops.Sum), torch.full((3,), float(SIZE)))


def check_process_sets() -> None:
    """Collectives on a subset of ranks: [1] at size 2, [0, size - 1] above."""
    if SIZE < 2:
        return
    members = [1] if SIZE == 2 else [0, SIZE - 1]
    m = len(members)
    pset = add_process_set(members)
    if RANK in members:
        me = members.index(RANK)
        xs = [data(r, "ps/ar", (5,), torch.float32) for r in members]
        close("set allreduce", allreduce(xs[me], op=ops.Sum, process_set=pset),
              reference(xs, ops.Sum))
        close("set average", allreduce(xs[me], process_set=pset),
              torch.stack([x.double() for x in xs]).mean(0).float())
        parts = [torch.full((i + 1, 2), float(r)) for i, r in enumerate(members)]
        close("set allgather", allgather(parts[me], process_set=pset), torch.cat(parts))
        close("set broadcast",  # root_rank is a job-wide rank, as in Horovod
              broadcast(torch.full((3,), float(RANK)), SIZE - 1, process_set=pset),
              torch.full((3,), float(SIZE - 1)))
        out, _ = alltoall(torch.tensor([10.0 * RANK + j for j in range(m)]), splits=[1] * m,
                          process_set=pset)
        close("set alltoall", out, torch.tensor([10.0 * r + me for r in members]))
        close("set reducescatter", reducescatter(torch.ones(2 * m, 1), op=ops.Sum,
                                                 process_set=pset),
              torch.full((2, 1), float(m)))
        x = torch.ones(2, requires_grad=True)
        (allreduce(x, op=ops.Sum, process_set=pset) * (me + 1)).sum().backward()
        close("set grad", grad(x), torch.full((2,), m * (m + 1) / 2))
        held = allreduce_async(torch.ones(1), name="same", process_set=pset)
        # A name is per process set: the global set may use it meanwhile.
    else:
        try:
            allreduce(torch.ones(2), process_set=pset)
        except ValueError as exc:
            if "not in" not in str(exc):
                raise
        else:
            raise AssertionError("a non-member ran a collective of the set")
    close("global while set busy", allreduce(torch.ones(1), op=ops.Sum, name="same"),
          torch.full((1,), float(SIZE)))
    if RANK in members:
        close("set held", synchronize(held), torch.ones(1))
        barrier(process_set=pset)
    remove_process_set(pset)


def check_sets_not_asked_for(engine: str) -> None:
    """Sets after a plain init(): refused on every rank under the horovod engine
    (as in Horovod: dynamic sets cost every cycle), added by every other engine."""
    members = list(range(SIZE - 1)) or [0]
    if engine == "horovod":
        expect_everywhere("sets not asked for", DPPluginError,
                          r"hvd\.init\(process_sets='dynamic'\)",
                          lambda: add_process_set(members))
    else:
        pset = add_process_set(members)
        if RANK in members:
            close("unasked set", allreduce(torch.ones(2), op=ops.Sum, process_set=pset),
                  torch.full((2,), float(len(members))))
        remove_process_set(pset)
    close("global after", allreduce(torch.ones(1), op=ops.Sum), torch.full((1,), float(SIZE)))


def case_collectives(_: object) -> None:
    check_allreduce()
    check_grouped_and_compression()
    check_gather_broadcast()
    check_alltoall_reducescatter()
    check_sparse_and_barrier()
    check_process_sets()


CASES = {
    "collectives": case_collectives,
    "autograd": lambda _: check_autograd(),
    "mistakes": lambda _: check_mistakes(),
    "sets_not_asked_for": lambda args: check_sets_not_asked_for(args.engine),
}
ASKS_FOR_SETS = {"collectives"}


def start(args: argparse.Namespace) -> argparse.Namespace:
    global RANK, SIZE
    os.environ["DP_PLUGIN_ENGINE"] = args.engine
    hvd_init(process_sets="dynamic" if args.case in ASKS_FOR_SETS else None)
    RANK, SIZE = hvd_rank(), hvd_size()
    return args


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", required=True)
    run_cases(CASES, parser=parser, setup=start, teardown=lambda _: hvd_shutdown())
