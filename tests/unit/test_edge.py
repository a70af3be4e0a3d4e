"""dp_plugin.agree.edge: the public call's name reaches the messages built below it."""

from __future__ import annotations

import threading

from dp_plugin.agree.edge import caller, calling, deferred, public


@public("outer_call")
def _outer() -> list[str]:
    return [caller(), _inner(), caller()]


@public("inner_call")
def _inner() -> str:
    return caller()


def test_the_innermost_public_call_names_the_message_and_the_outer_one_comes_back() -> None:
    assert _outer() == ["outer_call", "inner_call", "outer_call"]
    assert caller() == "dp_plugin"
    assert caller("process set") == "process set"


def test_the_name_is_restored_when_the_call_raises() -> None:
    @public("failing_call")
    def failing() -> None:
        raise ValueError(f"{caller()}: bad")

    try:
        failing()
    except ValueError as exc:
        assert str(exc) == "failing_call: bad"
    assert caller() == "dp_plugin"


def test_each_thread_sees_its_own_call_and_deferred_work_keeps_the_name() -> None:
    seen: dict[str, str] = {}
    with calling("allreduce"):
        later = deferred(lambda: caller())
        other = threading.Thread(target=lambda: seen.update(plain=caller(),
                                                            deferred=later()))
        other.start()
        other.join()
    assert seen == {"plain": "dp_plugin", "deferred": "allreduce"}
    assert later() == "allreduce"  # also after the call has returned
