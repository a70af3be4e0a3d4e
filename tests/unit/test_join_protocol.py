"""Join's wire protocol (``dp_plugin.agree.join``) on a fake thread group, no processes:
what a joined rank answers, what the others' check refuses, who joined last."""

from __future__ import annotations

import numpy as np
import pytest

from dp_plugin.agree import check, join, request
from dp_plugin.agree.agreement import compare
from dp_plugin.engines.base import ReduceOp
from dp_plugin.errors import JoinedRankError, MismatchError
from tests.unit.fakes import FakeEngine, make_thread_group, run_ranks_outcomes


def _one_round(req: request.Request, n: int = 3) -> list[object]:
    """Rank 0 has joined (a Listener); the others check ``req``. Per rank:
    rank 0's ``answerable``, the others' ``Agreed`` or error."""

    def body(e: FakeEngine) -> object:
        if e.rank == 0:
            heard = join.Listener(e).heard()
            assert heard.joined == (0,)
            described, _ = join.joined_view(heard)
            return described is not None and join.answerable(heard, described[0]["kind"])
        return check.check(e, req, accept_joined=True)

    return run_ranks_outcomes(make_thread_group(n), body)


def test_allreduce_and_barrier_are_answered() -> None:
    buf = np.ones(4, dtype=np.float32)
    for req in (request.Request.of("allreduce", [buf], op=ReduceOp.SUM),
                request.Request(kind="barrier")):
        answered, *agreed = _one_round(req)
        assert answered is True
        assert all(isinstance(a, request.Agreed) and a.joined == (0,) for a in agreed)


@pytest.mark.parametrize(("kind", "fields"), [
    ("allgather", {}), ("broadcast", {"root": 1}), ("reducescatter", {"op": ReduceOp.SUM}),
    ("alltoall", {}),
])
def test_horovods_refusals(kind: str, fields: dict[str, object]) -> None:
    req = request.Request.of(kind, [np.ones((6, 2), dtype=np.float32)], name="t", **fields)
    answered, *errors = _one_round(req)
    assert answered is False  # the joined rank is not disturbed: it listens on
    for exc in errors:
        assert isinstance(exc, JoinedRankError), exc
        assert "rank(s) 0 have called hvd.join()" in str(exc)
        assert f"'{kind.capitalize()} is not supported with Join'" in str(exc)


def test_an_agreement_that_refuses_joined_ranks_is_not_answered() -> None:
    def body(e: FakeEngine) -> object:
        if e.rank == 0:
            heard = join.Listener(e).heard()
            return join.answerable(heard, "allreduce")
        return compare(e, "SyncBatchNorm (stats)", [[3], "float64"])

    answered, *errors = run_ranks_outcomes(make_thread_group(2), body)
    assert answered is False
    assert isinstance(errors[0], JoinedRankError)
    assert "SyncBatchNorm (stats) cannot run while a rank is joined" in str(errors[0])


def test_everyone_joined_ends_the_listening() -> None:
    outcomes = run_ranks_outcomes(
        make_thread_group(3), lambda e: join.everyone_joined(join.Listener(e).heard(), e.size))
    assert outcomes == [True, True, True]


@pytest.mark.parametrize(("answered", "last"), [
    ([2, 0], 1), ([0, 2], 0), ([0, 0], 1), ([3, 0, 1], 1), ([0, 1, 1], 0), ([1, 0, 0], 2)])
def test_last_joined_answered_the_fewest_rounds(answered: list[int], last: int) -> None:
    engines = make_thread_group(len(answered))
    got = run_ranks_outcomes(engines, lambda e: join.last_joined(e, answered[e.rank]))
    assert got == [last] * len(answered)


@pytest.mark.parametrize(("op", "dtype"), [
    (ReduceOp.MIN, "int32"), (ReduceOp.MAX, "float32"), (ReduceOp.PRODUCT, "bfloat16"),
    (ReduceOp.SUM, "float64"),
])
def test_replay_contributes_the_ops_identity(op: ReduceOp, dtype: str) -> None:
    """Rank 0 has joined and replays what ranks 1 and 2 all-reduce: the result
    is theirs alone (``join.replay``, the core's zero contribution)."""
    from dp_plugin.reduce.arrays import numpy_dtype
    from dp_plugin.reduce.collective import fused_collective
    from dp_plugin.reduce.hooks import ReducePolicy

    def body(e: FakeEngine) -> object:
        if e.rank == 0:
            heard = join.Listener(e).heard()
            described, _ = join.joined_view(heard)
            assert described is not None and join.answerable(heard, "allreduce")
            join.replay(e, described)
            return None
        buf = np.full(3, e.rank + 1, dtype=numpy_dtype(dtype))
        check.check(e, request.Request.of("allreduce", [buf], name="m", op=op),
                      accept_joined=True)
        fused_collective([buf], engine=e, name="m", policy=ReducePolicy(op, e.size)).finish()
        return buf.astype(np.float64).tolist()

    want = {ReduceOp.MIN: 2.0, ReduceOp.MAX: 3.0, ReduceOp.PRODUCT: 6.0, ReduceOp.SUM: 5.0}[op]
    outcomes = run_ranks_outcomes(make_thread_group(3), body)
    assert outcomes == [None, [want] * 3, [want] * 3], outcomes


def test_a_mismatch_beside_a_joined_rank_names_the_ranks_that_differ() -> None:
    """Rank 1 has joined; ranks 0 and 2 pass different shapes. The message
    used to number the active ranks by position ('rank(s) 1 passed shape
    (5,)'), blaming the joined rank for rank 2's tensor."""
    def body(e: FakeEngine) -> object:
        if e.rank == 1:
            return join.Listener(e).heard().joined
        buf = np.ones(4 if e.rank == 0 else 5, dtype=np.float32)
        return check.check(e, request.Request.of("allreduce", [buf], name="g", op=ReduceOp.SUM),
                             accept_joined=True)

    first, joined, last = run_ranks_outcomes(make_thread_group(3), body)
    assert joined == (1,)
    for err in (first, last):
        assert isinstance(err, MismatchError), err
        assert "rank(s) 0 passed shape (4,); rank(s) 2 passed shape (5,)" in str(err), err

    def problem(e: FakeEngine) -> object:
        if e.rank == 1:
            return join.Listener(e).heard().joined
        buf = np.ones(4, dtype=np.complex64 if e.rank == 2 else np.float32)
        return check.check(e, request.Request.of("allreduce", [buf], op=ReduceOp.SUM),
                             accept_joined=True)

    first, _, last = run_ranks_outcomes(make_thread_group(3), problem)
    for err in (first, last):
        assert isinstance(err, MismatchError), err
        assert "rank(s) [2] passed a tensor of dtype complex64" in str(err), err

    def same_problem(e: FakeEngine) -> object:
        if e.rank == 1:
            return join.Listener(e).heard().joined
        buf = np.ones(4, dtype=np.complex64)
        return check.check(e, request.Request.of("allreduce", [buf], op=ReduceOp.SUM),
                             accept_joined=True)

    first, _, last = run_ranks_outcomes(make_thread_group(3), same_problem)
    for err in (first, last):
        assert isinstance(err, MismatchError), err
        assert "rank(s) [0, 2] passed a tensor of dtype complex64" in str(err), err
