"""Worker: alltoall, reducescatter and subgroups of one engine.

Run under any launcher (see tests/multiproc/harness.py)::

    python engine_extras.py --engine gloo --case alltoall_reducescatter   # "rank R OK"
    python engine_extras.py --list-cases

Every input is a function of (rank, row, column), so each rank computes the
expected result without communicating. Any failure prints a traceback and
exits 1 at once (``os._exit``): the other ranks then fail their next
collective instead of waiting for this one.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from _fail_fast import run_cases

from dp_plugin.agree import checked
from dp_plugin.engines.base import Engine
from dp_plugin.launch import runtime
from dp_plugin.reduce.arrays import as_numpy, is_torch, numpy_dtype

KINDS = ("numpy", "torch")


def rows_of(rank: int, rows: int, cols: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
    """Row i of rank r holds r*1000 + i*10 + column: exact in every dtype used."""
    n_cols = int(np.prod(cols, dtype=np.int64))
    grid = rank * 1000 + np.arange(rows)[:, None] * 10 + np.arange(n_cols)[None, :]
    if dtype in ("int8", "uint8"):
        grid = grid % 100
    return grid.reshape((rows, *cols)).astype(numpy_dtype(dtype))


def to_kind(arr: np.ndarray, kind: str) -> Any:
    if kind == "numpy":
        return arr.copy()
    if arr.dtype == numpy_dtype("bfloat16"):
        return torch.from_numpy(arr.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(arr.copy())


def check(got: Any, want: np.ndarray, kind: str, what: str) -> None:
    if is_torch(got) != (kind == "torch"):
        raise AssertionError(f"{what}: returned a {type(got).__name__} for a {kind} input")
    arr = as_numpy(got)
    if arr.shape != want.shape or arr.dtype != want.dtype:
        raise AssertionError(f"{what}: got {arr.dtype}{arr.shape}, want {want.dtype}{want.shape}")
    if not np.array_equal(arr.astype(np.float64), want.astype(np.float64)):
        raise AssertionError(f"{what}: got\n{arr}\nwant\n{want}")


def expect_error(kind: type[Exception], fn: Callable[[], Any], *needles: str) -> str:
    try:
        fn()
    except kind as exc:
        text = str(exc)
        missing = [n for n in needles if n not in text]
        if missing:
            raise AssertionError(f"error lacks {missing}: {text}") from exc
        return text
    raise AssertionError(f"expected {kind.__name__}, nothing was raised")


# -- alltoall ----------------------------------------------------------------

def send_counts(rank: int, size: int, pattern: str) -> list[int]:
    if pattern == "even":
        return [2] * size
    if pattern == "zeros":
        return [0] * size
    if pattern == "one-sends-nothing":  # Horovod's alltoall_one_rank_sends_nothing
        return [0] * size if rank == 0 else [rank + 1] * size
    return [(rank + 2 * j) % 3 for j in range(size)]  # uneven, with zero rows


def alltoall_case(engine: Engine, kind: str, pattern: str, cols: tuple[int, ...],
                  dtype: str) -> None:
    me, size = engine.rank, engine.size
    mine = send_counts(me, size, pattern)
    # A copy: numpy gives an empty copy strides of 0, which broke the byte
    # view of a rank sending no rows.
    buf = to_kind(rows_of(me, sum(mine), cols, dtype).copy(), kind)
    splits = None if pattern == "even" else mine
    got, received = checked.alltoall(engine, buf, splits, name=f"a2a.{pattern}")
    want_counts = [send_counts(src, size, pattern)[me] for src in range(size)]
    blocks = []
    for src in range(size):
        theirs = send_counts(src, size, pattern)
        start = sum(theirs[:me])
        blocks.append(rows_of(src, sum(theirs), cols, dtype)[start:start + theirs[me]])
    if received != want_counts:
        raise AssertionError(f"alltoall {pattern}: received splits {received}, want {want_counts}")
    check(got, np.concatenate(blocks), kind, f"alltoall {pattern} {kind} {dtype}{cols}")


def run_alltoall(engine: Engine) -> None:
    for kind in KINDS:
        alltoall_case(engine, kind, "even", (3,), "float32")
        alltoall_case(engine, kind, "uneven", (2,), "float64")
        alltoall_case(engine, kind, "uneven", (), "int64")
        alltoall_case(engine, kind, "zeros", (3,), "float32")
        for dtype in ("float32", "int16", "uint8"):
            alltoall_case(engine, kind, "one-sends-nothing", (2,), dtype)
    alltoall_case(engine, "torch", "uneven", (2, 2), "bfloat16")
    alltoall_case(engine, "numpy", "uneven", (3,), "int16")
    # The input is not modified, and a torch split list / tensor is accepted.
    buf = torch.from_numpy(rows_of(engine.rank, 2 * engine.size, (1,)))
    before = buf.clone()
    checked.alltoall(engine, buf, torch.tensor([2] * engine.size), name="a2a.tensor-splits")
    if not torch.equal(buf, before):
        raise AssertionError("alltoall modified its input")


# -- reducescatter -----------------------------------------------------------

def run_reducescatter(engine: Engine) -> None:
    me, size = engine.rank, engine.size
    cases = [
        (2 * size, (3,), "float32", "sum"),       # even
        (2 * size, (3,), "float32", "average"),
        (size + 1, (2,), "float64", "sum"),       # uneven: rank 0 gets one more row
        (size + 2, (), "float32", "average"),
        (1, (2,), "float32", "sum"),              # fewer rows than ranks
        (size + 1, (2,), "int16", "sum"),
        (size + 1, (2,), "int32", "max"),
        (size, (2,), "float32", "min"),
    ]
    for rows, cols, dtype, op in cases:
        inputs = [rows_of(r, rows, cols, dtype) for r in range(size)]
        if op in ("sum", "average"):
            total = np.sum([x.astype(np.float64) for x in inputs], axis=0)
            reduced = total / size if op == "average" else total
        else:
            reduced = (np.max if op == "max" else np.min)(np.stack(inputs), axis=0)
        counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
        start = sum(counts[:me])
        want = reduced[start:start + counts[me]].astype(inputs[0].dtype)
        for kind in KINDS:
            buf = to_kind(inputs[me], kind)
            got = checked.reducescatter(engine, buf, op, name=f"rs.{rows}.{dtype}.{op}")
            check(got, want, kind, f"reducescatter {op} {kind} {dtype}[{rows}, {cols}]")
            check(buf, inputs[me], kind, "reducescatter input (must not change)")


# -- subgroups ---------------------------------------------------------------

def run_in_group(group: Engine, label: str) -> None:
    """Every collective inside a group, checked against the group's members."""
    members = group.global_ranks
    me, size = group.rank, group.size
    value = np.full(5, float(members[me] + 1), dtype=np.float32)
    group.allreduce_async(value, "sum", name=f"{label}.ar").wait()
    check(value, np.full(5, float(sum(m + 1 for m in members)), np.float32), "numpy",
          f"{label} allreduce")
    avg = torch.full((4,), float(members[me]), dtype=torch.float64)
    group.allreduce_async(avg, "average", name=f"{label}.avg").wait()
    check(avg, np.full(4, sum(members) / size), "torch", f"{label} average")
    root = size - 1  # a group rank, not a job-wide one
    payload = np.arange(6, dtype=np.int32) * (members[me] + 1)
    group.broadcast(payload, root, name=f"{label}.bcast")
    check(payload, np.arange(6, dtype=np.int32) * (members[root] + 1), "numpy",
          f"{label} broadcast")
    gathered = checked.allgather(group, rows_of(members[me], me + 1, (2,)), name=f"{label}.ag")
    check(gathered, np.concatenate([rows_of(m, i + 1, (2,)) for i, m in enumerate(members)]),
          "numpy", f"{label} allgather")
    group.barrier()
    got, received = checked.alltoall(group, torch.from_numpy(rows_of(members[me], size, (2,))),
                                   name=f"{label}.a2a")
    want = np.concatenate([rows_of(m, size, (2,))[me:me + 1] for m in members])
    check(got, want, "torch", f"{label} alltoall")
    if received != [1] * size:
        raise AssertionError(f"{label} alltoall received splits {received}")
    rows = size + 1
    got = checked.reducescatter(group, rows_of(members[me], rows, (2,)), "sum", name=f"{label}.rs")
    total = np.sum([rows_of(m, rows, (2,)) for m in members], axis=0)
    counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
    start = sum(counts[:me])
    check(got, total[start:start + counts[me]], "numpy", f"{label} reducescatter")


def global_sum_check(engine: Engine, label: str) -> None:
    buf = np.full(7, float(engine.rank + 1), dtype=np.float64)
    engine.allreduce_async(buf, "sum", name=label).wait()
    check(buf, np.full(7, engine.size * (engine.size + 1) / 2), "numpy", label)


def run_subgroups(engine: Engine, nested: bool) -> None:
    me, size = engine.rank, engine.size
    evens = list(range(0, size, 2))
    odds = list(range(1, size, 2))
    group_a = checked.subgroup(engine, evens, name="evens")
    group_b = checked.subgroup(engine, odds, name="odds")
    mine, other = (group_a, group_b) if me % 2 == 0 else (group_b, group_a)
    if mine is None or other is not None:
        raise AssertionError(f"rank {me}: membership wrong ({group_a!r}, {group_b!r})")
    members = tuple(evens if me % 2 == 0 else odds)
    if mine.global_ranks != members or mine.size != len(members):
        raise AssertionError(f"group {mine.global_ranks} size {mine.size}, want {members}")
    if mine.rank != members.index(me):
        raise AssertionError(f"group rank {mine.rank}, want {members.index(me)}")
    shm = getattr(mine, "_shm", None)  # gloo on one host: its messages name job ranks
    if shm is not None and (shm.ranks, shm.job_rank) != (members, me):
        raise AssertionError(f"the group's shared memory names ranks {shm.ranks} and itself "
                             f"{shm.job_rank}, want the job's {members} and {me}")
    # Both groups run their collectives at the same time: no cross-talk.
    run_in_group(mine, "evens" if me % 2 == 0 else "odds")
    global_sum_check(engine, "after-groups")
    if nested and mine.size > 1:
        inner = checked.subgroup(mine, [mine.size - 1], name="inner")
        if (inner is not None) != (mine.rank == mine.size - 1):
            raise AssertionError("nested membership wrong")
        if inner is not None:
            if inner.global_ranks != (members[-1],):
                raise AssertionError(f"nested global ranks {inner.global_ranks}")
            run_in_group(inner, "inner")
            inner.shutdown()
        mine.barrier()
    elif mine.size > 1:
        expect_error(NotImplementedError, lambda: checked.subgroup(mine, [0], name="inner"),
                     "cannot be split further")
    mine.shutdown()
    global_sum_check(engine, "after-group-shutdown")
    # The same members again, after the first group was shut down.
    again = checked.subgroup(engine, evens, name="evens-again")
    if (again is not None) != (me % 2 == 0):
        raise AssertionError("membership of the re-created group is wrong")
    if again is not None:
        run_in_group(again, "evens-again")
        again.shutdown()
    whole = checked.subgroup(engine, list(range(size)), name="everyone")
    if whole is None or whole.rank != me or whole.size != size:
        raise AssertionError("the subgroup of every rank is wrong")
    run_in_group(whole, "everyone")
    whole.shutdown()
    global_sum_check(engine, "after-all-groups")


# -- errors (raised on every rank) -------------------------------------------

def run_errors(engine: Engine) -> None:
    me, size = engine.rank, engine.size
    rows = np.zeros((2 * size, 3), np.float32)
    bad_len = [2 * size] if me == 0 else [2] * size  # only rank 0 errs
    text = expect_error(ValueError, lambda: checked.alltoall(engine, rows, bad_len, name="e1"),
                        "rank(s) [0] passed invalid splits")
    if me == 0 and "entries but there are" not in text:
        raise AssertionError(f"rank 0 lacks its detail: {text}")
    negative = [-1, 2 * size + 1] + [0] * (size - 2)
    expect_error(ValueError, lambda: checked.alltoall(engine, rows, negative, name="e2"),
                 "negative")
    expect_error(ValueError, lambda: checked.alltoall(engine, rows, [1] * size, name="e3"),
                 "sums to")
    odd_rows = np.zeros((2 * size + 1, 3), np.float32)
    expect_error(ValueError, lambda: checked.alltoall(engine, odd_rows, name="e4"), "not divisible")
    mixed = rows if me else rows.astype(np.float64)
    expect_error(ValueError, lambda: checked.alltoall(engine, mixed, name="e5"),
                 "Mismatched alltoall tensor types", "float64", "float32")
    wider = rows if me else np.zeros((2 * size, 4), np.float32)
    expect_error(ValueError, lambda: checked.alltoall(engine, wider, name="e6"),
                 "Mismatched alltoall tensor shapes")
    longer = np.zeros((size + me, 2), np.float32)
    expect_error(ValueError, lambda: checked.reducescatter(engine, longer, name="e7"),
                 "Mismatched reducescatter tensor shapes", "same shape")
    op = "sum" if me else "max"
    expect_error(ValueError, lambda: checked.reducescatter(engine, rows, op, name="e8"),
                 "Mismatched reducescatter tensor reduce ops")
    expect_error(TypeError, lambda: checked.reducescatter(engine, np.zeros(size, bool), "sum"),
                 "dtype bool, which collectives do not support")
    scalar = np.zeros((), np.float32) if me == size - 1 else np.zeros(size, np.float32)
    expect_error(ValueError, lambda: checked.reducescatter(engine, scalar, name="e9"), "0-dim")
    members = [0] if me == 0 else [0, 1]
    expect_error(ValueError, lambda: checked.subgroup(engine, members, name="e10"),
                 "Mismatched subgroup members")
    expect_error(ValueError, lambda: checked.subgroup(engine, [1, 0], name="e11"),
                 "sorted and unique")
    expect_error(ValueError, lambda: checked.subgroup(engine, [0, size], name="e12"),
                 f"must lie in 0..{size - 1}")
    global_sum_check(engine, "after-errors")


# -- dp_plugin.torch process sets -----------------------------------------------

def run_process_sets(engine: Engine) -> None:
    """The Horovod process-set API over ``engine`` (the runtime's engine)."""
    from dp_plugin.api import process_sets as ps

    me, size = engine.rank, engine.size
    ps.setup(None, "dp_plugin.torch")
    if ps.global_process_set.ranks != list(range(size)) or ps.global_process_set.size() != size:
        raise AssertionError(f"global set {ps.global_process_set}")
    if ps.global_process_set.engine() is not engine or ps.global_process_set.rank() != me:
        raise AssertionError("the global set does not run on the runtime's engine")
    upper = list(range(1, size))  # a proper subset with a rank-0-free numbering
    first = ps.ProcessSet(upper[::-1])  # sorted by the constructor
    if first.ranks != upper or first.size() is not None or first.rank() is not None:
        raise AssertionError(f"unregistered set {first}")
    expect_error(ValueError, first.engine, "is not registered")
    if ps.add_process_set(first) is not first:
        raise AssertionError("add_process_set must return the set it registered")
    zero = ps.add_process_set([0])
    if (first.process_set_id, zero.process_set_id) != (1, 2):
        raise AssertionError(f"ids {first.process_set_id}, {zero.process_set_id}")
    expect_error(ValueError, lambda: ps.add_process_set(upper), "duplicate")
    expect_error(ValueError, lambda: ps.add_process_set(list(range(size))), "duplicate")
    if first.included() != (me >= 1) or first.size() != size - 1:
        raise AssertionError(f"membership of {first}")
    if first.included():
        group = first.engine()
        if group.rank != first.rank() or group.global_ranks != tuple(upper):
            raise AssertionError(f"engine of {first}: rank {group.rank}, {group.global_ranks}")
        run_in_group(group, "process-set-1")
    else:
        expect_error(ValueError, first.engine, f"this rank ({me}) is not in")
        expect_error(ValueError, first.rank, "not part of")
        zero.engine().barrier()
    global_sum_check(engine, "after-process-set")
    if not ps.remove_process_set(first) or ps.remove_process_set(first):
        raise AssertionError("remove_process_set should succeed once")
    if ps.remove_process_set(ps.global_process_set):
        raise AssertionError("the global set was removed")
    again = ps.add_process_set(upper)
    if again.process_set_id != 1:  # freed ids are reused first
        raise AssertionError(f"re-added set got id {again.process_set_id}")
    if again.included():
        again.engine().barrier()
    ps.reset()
    if again.process_set_id is not None or zero.process_set_id is not None:
        raise AssertionError("reset left sets registered")
    global_sum_check(engine, "after-process-set-reset")


class Ctx(NamedTuple):
    engine: Engine
    nested: bool


def start(args: argparse.Namespace) -> Ctx:
    os.environ["DP_PLUGIN_ENGINE"] = args.engine
    # The process-set API runs on the runtime's engine.
    # Under the horovod engine, subgroups need Horovod's dynamic process sets.
    return Ctx(runtime.init(process_sets=args.case == "subgroups_process_sets"), args.nested)


def case_alltoall_reducescatter(ctx: Ctx) -> None:
    """The collectives, then input mistakes on one rank raising on every rank."""
    run_alltoall(ctx.engine)
    run_reducescatter(ctx.engine)
    run_errors(ctx.engine)


def case_subgroups_process_sets(ctx: Ctx) -> None:
    run_subgroups(ctx.engine, ctx.nested)
    run_process_sets(ctx.engine)


CASES = {
    "alltoall_reducescatter": case_alltoall_reducescatter,
    "subgroups_process_sets": case_subgroups_process_sets,
}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--nested", action="store_true",
                        help="the engine supports subgroups of subgroups")
    run_cases(CASES, parser=parser, setup=start, teardown=lambda ctx: runtime.shutdown())
