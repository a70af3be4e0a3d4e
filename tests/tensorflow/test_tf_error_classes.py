"""TF's error class comes from the kind of error the core's check raised, not
from words in the message, so every rank raises the same class.

Two ranks on a fake thread group (``tests.unit.fakes``) run the core's
``dp_plugin.agree.check`` and translate its error as the TF adapter does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dp_plugin.agree import check, request
from dp_plugin.tensorflow.errors import (
    CollectiveArgumentError,
    CollectiveMismatchError,
    as_tensorflow_error,
)
from tests.unit.fakes import FakeEngine, make_thread_group, run_ranks_outcomes


def _classes(make: Any) -> list[type]:
    def body(e: FakeEngine) -> Any:
        check.check(e, make(e.rank))

    outcomes = run_ranks_outcomes(make_thread_group(2), body)
    assert all(isinstance(o, BaseException) for o in outcomes), outcomes
    return [type(as_tensorflow_error(o)) for o in outcomes]


def test_a_rank_with_bad_splits_raises_the_first_problem_s_class_like_the_others() -> None:
    """Rank 0's 0-dim input is the first problem; rank 1's bad splits only add
    "On this rank: splits ..." to its message."""

    def make(rank: int) -> request.Request:
        buf = np.zeros((), np.float32) if rank == 0 else np.zeros((4, 2), np.float32)
        return request.Request.of("alltoall", [buf], name="a2a",
                                  splits=None if rank == 0 else [1, 1])

    assert _classes(make) == [CollectiveArgumentError, CollectiveArgumentError]


def test_bad_splits_raise_an_argument_error_on_every_rank() -> None:
    def make(rank: int) -> request.Request:
        return request.Request.of("alltoall", [np.zeros((4, 2), np.float32)], name="a2a",
                                  splits=[1, 1] if rank == 1 else [2, 2])

    assert _classes(make) == [CollectiveArgumentError, CollectiveArgumentError]


@pytest.mark.parametrize("name", ["splits", "input_splits"])
def test_a_mismatch_of_a_tensor_named_splits_is_a_mismatch(name: str) -> None:
    def make(rank: int) -> request.Request:
        return request.Request.of("allgather", [np.zeros((2, 1 + rank), np.float32)], name=name)

    assert _classes(make) == [CollectiveMismatchError, CollectiveMismatchError]
