"""Property-based: random text and numbers in every variable the config parser
and launch detection read give a result or one of dp_plugin's own errors
(``DPPluginError``: ``ConfigError``, ``LaunchError``) naming the variable,
never a bare ValueError, KeyError, ZeroDivisionError, OverflowError, ...

Kept small (``max_examples`` ~200 each, no deadline): ``make test`` runs it.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from dp_plugin.config import Config
from dp_plugin.errors import DPPluginError
from dp_plugin.launch.launchers import Topology, detect
from dp_plugin.launch.variables import LAUNCHER_VARIABLE_NAMES
from tests.unit.test_launch import horovodrun, intelmpi, mpich, openmpi, srun, torchrun

CONFIG_VARIABLES = (
    "DP_PLUGIN_ENGINE", "DP_PLUGIN_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD",
    "DP_PLUGIN_TIMELINE", "HOROVOD_TIMELINE", "DP_PLUGIN_TIMEOUT",
    "DP_PLUGIN_REBUILD_BUCKETS", "DP_PLUGIN_CHECK_FINITE", "DP_PLUGIN_JOB_SECRET",
    "DP_PLUGIN_AUTOTUNE", "DP_PLUGIN_AUTOTUNE_WARMUP_STEPS", "DP_PLUGIN_AUTOTUNE_STEPS",
    "DP_PLUGIN_AUTOTUNE_CANDIDATES",
)
FUZZ = settings(max_examples=200, deadline=None)

numbers = st.one_of(
    st.integers(min_value=-(10 ** 30), max_value=10 ** 30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.floats().map(lambda f: f"{f:e}"),
    st.sampled_from(["0", "-0", "1e400", "-1e400", "nan", "inf", "-inf", "0x10", "1_000",
                     " 7 ", "+3", "٣", "1.5", "1e3", "9" * 5000, "", " ", "\x00", "True"]),
)
values = st.one_of(numbers, st.text(max_size=40), st.text(alphabet="0123456789.-+e ",
                                                          max_size=12))


def _assert_ours(exc: BaseException, env: dict[str, str]) -> None:
    assert isinstance(exc, DPPluginError), f"{type(exc).__name__}: {exc} for {env!r}"
    text = str(exc)
    assert any(name in text for name in env), f"message names no variable: {text}"


@FUZZ
@given(st.dictionaries(st.sampled_from(CONFIG_VARIABLES), values, max_size=4))
def test_config_from_env_gives_a_config_or_a_clear_error(env: dict[str, str]) -> None:
    try:
        config = Config.from_env(env)
    except Exception as exc:
        _assert_ours(exc, env)
        return
    assert math.isfinite(config.timeout_s) and config.timeout_s > 0
    assert config.fusion_threshold >= 1


def _launch_env() -> st.SearchStrategy[dict[str, str]]:
    """A real launcher's variables with some replaced, dropped or added."""
    base = st.sampled_from([horovodrun, torchrun, mpich, intelmpi, openmpi, srun]).map(
        lambda make: make())
    names = st.sampled_from(sorted(LAUNCHER_VARIABLE_NAMES))

    def mutate(env: dict[str, str], changes: dict[str, str | None]) -> dict[str, str]:
        out = dict(env)
        for name, value in changes.items():
            if value is None:
                out.pop(name, None)
            else:
                out[name] = value
        return out

    return st.builds(mutate, base, st.dictionaries(names, st.none() | values, max_size=4))


@FUZZ
@given(_launch_env())
def test_detect_gives_a_topology_or_a_launch_error(env: dict[str, str]) -> None:
    try:
        topology = detect(env)
    except Exception as exc:
        _assert_ours(exc, env)
        return
    assert isinstance(topology, Topology)
    assert 0 <= topology.rank < topology.size


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(LAUNCHER_VARIABLE_NAMES)), values, max_size=8))
def test_detect_on_random_launcher_variables(env: dict[str, str]) -> None:
    try:
        detect(env)
    except Exception as exc:
        _assert_ours(exc, env)


kwarg_values = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
                         st.lists(st.integers(), max_size=2))


@FUZZ
@given(st.dictionaries(st.sampled_from(["engine", "fusion_threshold", "timeline", "timeout_s",
                                        "rebuild_buckets", "check_finite", "autotune",
                                        "autotune_steps", "autotune_warmup_steps",
                                        "autotune_candidates"]),
                       kwarg_values, max_size=3))
def test_config_constructor_gives_a_config_or_a_clear_error(kwargs: dict[str, object]) -> None:
    try:
        Config(**kwargs)  # type: ignore[arg-type]
    except Exception as exc:
        assert isinstance(exc, DPPluginError), f"{type(exc).__name__}: {exc} for {kwargs!r}"
        assert any(name in str(exc) for name in kwargs), str(exc)

