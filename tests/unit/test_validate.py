"""dp_plugin.validate: the shared checks and the messages they produce."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dp_plugin.errors import LaunchError
from dp_plugin.validate import (
    check_choice,
    check_int,
    check_positive_float,
    env_bool,
    env_choice,
    env_int,
    env_positive_float,
    is_int,
)

# -- check_int -----------------------------------------------------------------------


def test_check_int_returns_the_int() -> None:
    assert check_int("n", 3, minimum=1) == 3
    assert check_int("n", np.int64(2), minimum=0, maximum=2) == 2
    assert type(check_int("n", np.int64(2))) is int
    assert check_int("n", -7) == -7  # no bound, any int


@pytest.mark.parametrize(
    ("value", "shown"),
    [(0, "got 0"), (-1, "got -1"), (True, "got True"), (1.0, "got 1.0"), ("2", "got '2'"),
     (None, "got None")],
)
def test_check_int_names_argument_value_and_expectation(value: object, shown: str) -> None:
    with pytest.raises(ValueError) as info:
        check_int("backward_passes_per_step", value, minimum=1)
    assert str(info.value) == f"backward_passes_per_step must be an int >= 1, {shown}"


def test_check_int_bounds_where_fix_and_error_class() -> None:
    with pytest.raises(ValueError, match=r"^root_rank must be an int in 0\.\.2, got 3$"):
        check_int("root_rank", 3, minimum=0, maximum=2)
    with pytest.raises(ValueError, match=r"^n must be an int <= 5, got 6$"):
        check_int("n", 6, maximum=5)
    with pytest.raises(LaunchError, match=r"^Cb: root_rank must be an int >= 0, got -1; "
                                          r"pass a rank of the job$"):
        check_int("root_rank", -1, minimum=0, where="Cb", fix="pass a rank of the job",
                  error=LaunchError)


def test_is_int_refuses_bool() -> None:
    assert is_int(1) and is_int(np.int32(1))
    assert not is_int(True) and not is_int(np.float64(1.0)) and not is_int(1.0)


# -- check_positive_float ------------------------------------------------------------


def test_check_positive_float_accepts_ints_and_floats() -> None:
    assert check_positive_float("lr", 1) == 1.0
    assert type(check_positive_float("lr", 1)) is float
    assert check_positive_float("lr", np.float32(0.5)) == 0.5


@pytest.mark.parametrize("value", [0, 0.0, -1.5, math.inf, math.nan, True, "0.1", None])
def test_check_positive_float_refuses(value: object) -> None:
    with pytest.raises(ValueError) as info:
        check_positive_float("initial_lr", value, where="Warmup", fix="e.g. 0.1")
    assert str(info.value) == (
        f"Warmup: initial_lr must be a finite number > 0, got {value!r}; e.g. 0.1"
    )


def test_check_positive_float_unit() -> None:
    with pytest.raises(ValueError, match=r"^timeout_s must be a finite number > 0 \(seconds\), "
                                         r"got -2$"):
        check_positive_float("timeout_s", -2, unit="seconds")


# -- check_choice --------------------------------------------------------------------


def test_check_choice() -> None:
    assert check_choice("engine", "gloo", ("gloo", "mpi")) == "gloo"
    with pytest.raises(ValueError, match=r"^engine 'nvlink' is not known; valid engines: gloo, "
                                         r"mpi; set DP_PLUGIN_ENGINE to one of them$"):
        check_choice("engine", "nvlink", ["gloo", "mpi"], kind="engines",
                     fix="set DP_PLUGIN_ENGINE to one of them")
    with pytest.raises(ValueError, match=r"^op 3 is not known; valid values: sum$"):
        check_choice("op", 3, ("sum",))


# -- environment variables -------------------------------------------------------------


def test_env_int() -> None:
    assert env_int({"N": " 12 "}, "N", minimum=0) == 12
    with pytest.raises(ValueError, match=r"^N='12MB' is not an integer number of bytes; fix it$"):
        env_int({"N": "12MB"}, "N", unit="bytes", fix="fix it")
    with pytest.raises(LaunchError, match=r"^N='-1' must be an integer >= 0$"):
        env_int({"N": "-1"}, "N", minimum=0, error=LaunchError)
    with pytest.raises(ValueError, match="not an integer"):
        env_int({"N": "1.5"}, "N")


@pytest.mark.parametrize("raw", ["0", "-3", "soon", "nan", "inf", ""])
def test_env_positive_float_refuses(raw: str) -> None:
    with pytest.raises(ValueError) as info:
        env_positive_float({"T": raw}, "T", unit="seconds", fix="default 300")
    assert str(info.value) == (
        f"T={raw!r} must be a positive number of seconds (finite); default 300"
    )


def test_env_positive_float_and_choice_and_bool() -> None:
    assert env_positive_float({"T": "2.5"}, "T") == 2.5
    assert env_choice({"E": " GLOO "}, "E", ("gloo", "mpi")) == "gloo"
    with pytest.raises(ValueError, match=r"^E='x' is not a known engine; valid values: gloo, mpi$"):
        env_choice({"E": "x"}, "E", ("gloo", "mpi"), kind="engine")
    for raw, want in [("1", True), ("Yes", True), ("on", True), ("0", False), ("off", False),
                      ("", False), ("FALSE", False)]:
        assert env_bool({"B": raw}, "B") is want
    with pytest.raises(ValueError, match=r"^B='maybe' is not a boolean; use 1/0, true/false"):
        env_bool({"B": "maybe"}, "B")
