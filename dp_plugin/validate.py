"""Argument and environment-variable checks in the project's error style.

Every message names the argument (or variable), shows the bad value, says
what was expected and, when the caller passes one, how to fix it::

    check_int("backward_passes_per_step", 0, minimum=1)
    # ValueError: backward_passes_per_step must be an int >= 1, got 0

    env_positive_float(os.environ, "DP_PLUGIN_TIMEOUT", unit="seconds", fix="the default is 1800")
    # ValueError: DP_PLUGIN_TIMEOUT='soon' must be a positive number of seconds; the default is 1800

``where`` prefixes the message with who checks (``"DistributedOptimizer"``);
``error`` chooses the exception class (``LaunchError`` in launch detection).
``bool`` is never accepted as a number: ``True`` for ``root_rank`` is a bug.
Each function returns the value it checked, converted (``int``, ``float``).

Pure Python, no framework imports: the core and every adapter may use it.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def _message(where: str, text: str, fix: str) -> str:
    prefix = f"{where}: " if where else ""
    suffix = f"; {fix}" if fix else ""
    return f"{prefix}{text}{suffix}"


def _bounds(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in {minimum}..{maximum}"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def is_int(value: object) -> bool:
    """An integer (Python or numpy), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(
    name: str, value: object, *, minimum: int | None = None, maximum: int | None = None,
    where: str = "", fix: str = "", error: type[Exception] = ValueError,
) -> int:
    """``value`` as an ``int`` in ``minimum..maximum`` (either bound optional)."""
    if not is_int(value) or (
        (minimum is not None and value < minimum)  # type: ignore[operator]
        or (maximum is not None and value > maximum)  # type: ignore[operator]
    ):
        raise error(_message(
            where, f"{name} must be an int{_bounds(minimum, maximum)}, got {value!r}", fix
        ))
    return int(value)  # type: ignore[call-overload]


def check_groups(groups: Any, num_groups: Any, member: type | tuple[type, ...], kind: str,
                 stacklevel: int = 3) -> Any:
    """Horovod's ``DistributedOptimizer(groups=..., num_groups=...)``, checked by
    Horovod's rules; returns ``groups`` with the deprecated ``num_groups``
    folded in (warning ``stacklevel`` frames up): None, an int > 0, or a list
    of lists of ``member`` instances (``kind`` names them), each at most once."""
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups`.",
                      DeprecationWarning, stacklevel=stacklevel)
        if groups is None:
            groups = num_groups
    if groups is None:
        return None
    if isinstance(groups, list):
        seen: set[int] = set()
        for group in groups:
            for p in group:
                if not isinstance(p, member):
                    raise ValueError(f"groups must consist of {kind}, got {type(p).__name__}")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
        return groups
    if not is_int(groups) or groups <= 0:
        raise ValueError(
            f"groups should be a non-negative integer or a list of list of {kind}, got {groups!r}"
        )
    return int(groups)


def check_positive_float(
    name: str, value: object, *, unit: str = "", maximum: float | None = None, where: str = "",
    fix: str = "", error: type[Exception] = ValueError,
) -> float:
    """``value`` (an int or float, not bool) as a finite ``float`` > 0 (and <= ``maximum``).

    ``check_positive_float("cycle_time_s", 0)`` raises
    ``ValueError("cycle_time_s must be a finite number > 0, got 0")``.
    """
    number = math.nan  # not a number at all: refused below
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int beyond float's range
            number = math.inf
    if not (math.isfinite(number) and number > 0 and (maximum is None or number <= maximum)):
        unit_text = f" ({unit})" if unit else ""
        most = f" and <= {maximum:g}" if maximum is not None else ""
        raise error(_message(
            where, f"{name} must be a finite number > 0{most}{unit_text}, got {value!r}", fix
        ))
    return number


def check_choice(
    name: str, value: object, choices: Iterable[str], *, kind: str = "values",
    fix: str = "", error: type[Exception] = ValueError,
) -> str:
    """``value`` if it is one of ``choices``.

    ``check_choice("engine", "nvlink", ENGINE_NAMES, kind="engines")`` raises
    ``ValueError("engine 'nvlink' is not known; valid engines: auto, ...")``.
    """
    options = tuple(choices)
    if not isinstance(value, str) or value not in options:
        raise error(_message(
            "", f"{name} {value!r} is not known; valid {kind}: {', '.join(options)}", fix
        ))
    return value


# -- environment variables: the message shows NAME='raw text' ----------------------

def env_int(
    env: Mapping[str, str], name: str, *, minimum: int | None = None,
    maximum: int | None = None, unit: str = "", fix: str = "",
    error: type[Exception] = ValueError,
) -> int:
    """``env[name]`` parsed as a base-10 integer (surrounding spaces allowed)."""
    raw = env[name]
    unit_text = f" number of {unit}" if unit else ""
    try:
        value = int(raw.strip(), 10)
    except ValueError:  # also more digits than int() parses
        raise error(_message("", f"{name}={raw!r} is not an integer{unit_text}", fix)) from None
    if minimum is not None and value < minimum:
        raise error(_message("", f"{name}={raw!r} must be an integer >= {minimum}", fix))
    if maximum is not None and value > maximum:
        raise error(_message("", f"{name}={raw!r} must be an integer <= {maximum}", fix))
    return value


def env_int_list(
    env: Mapping[str, str], name: str, *, minimum: int | None = None,
    maximum: int | None = None, max_items: int | None = None, unit: str = "", fix: str = "",
    error: type[Exception] = ValueError,
) -> list[int]:
    """``env[name]`` as a comma-separated list of base-10 integers (at least one)."""
    raw = env[name]
    pieces = raw.split(",")
    unit_text = f" of {unit}" if unit else ""
    if not raw.strip() or (max_items is not None and len(pieces) > max_items):
        most = f"at most {max_items} " if max_items is not None else ""
        raise error(_message("", f"{name}={raw!r} must be a comma-separated list of {most}"
                                 f"integers{unit_text}", fix))
    values = []
    for piece in pieces:
        try:
            value = int(piece.strip(), 10)
        except ValueError:
            raise error(_message("", f"{name}={raw!r}: {piece!r} is not an integer{unit_text}",
                                 fix)) from None
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise error(_message("", f"{name}={raw!r}: {value} must be an integer"
                                     f"{_bounds(minimum, maximum)}", fix))
        values.append(value)
    return values


def env_positive_float(
    env: Mapping[str, str], name: str, *, unit: str = "", maximum: float | None = None,
    fix: str = "", error: type[Exception] = ValueError,
) -> float:
    """``env[name]`` parsed as a finite number > 0 and <= ``maximum`` (``inf`` and
    ``nan`` refused)."""
    raw = env[name]
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0 and (maximum is None or value <= maximum)):
        unit_text = f" of {unit}" if unit else ""
        most = f" at most {maximum:g}" if maximum is not None else ""
        raise error(_message(
            "", f"{name}={raw!r} must be a positive number{unit_text} (finite){most}", fix
        ))
    return value


def env_choice(
    env: Mapping[str, str], name: str, choices: Iterable[str], *, kind: str = "value",
    fix: str = "", error: type[Exception] = ValueError,
) -> str:
    """``env[name]``, stripped and lower-cased, if it is one of ``choices``."""
    raw = env[name]
    value = raw.strip().lower()
    options = tuple(choices)
    if value not in options:
        raise error(_message(
            "", f"{name}={raw!r} is not a known {kind}; valid values: {', '.join(options)}", fix
        ))
    return value


def env_bool(env: Mapping[str, str], name: str, *, error: type[Exception] = ValueError) -> bool:
    """``env[name]`` as a boolean: 1/0, true/false, yes/no, on/off (any case); empty is False."""
    raw = env[name]
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise error(f"{name}={raw!r} is not a boolean; use 1/0, true/false, yes/no, on/off")
