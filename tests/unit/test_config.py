"""Config.from_env: defaults, names, precedence and error messages."""

from __future__ import annotations

import dataclasses

import pytest

from dp_plugin.config import (
    DEFAULT_FIRST_BUCKET_THRESHOLD,
    DEFAULT_FUSION_THRESHOLD,
    DEFAULT_MIN_BUCKETS,
    DEFAULT_TIMEOUT_S,
    ENGINE_NAMES,
    Config,
)
from dp_plugin.errors import ConfigError


def test_defaults_from_an_empty_environment() -> None:
    config = Config.from_env({})
    assert config == Config()
    assert config.engine == "auto"
    assert config.fusion_threshold == DEFAULT_FUSION_THRESHOLD == 25 * 1024 * 1024
    assert config.first_bucket_threshold == DEFAULT_FIRST_BUCKET_THRESHOLD == 1024 * 1024
    assert config.gradient_as_bucket_view is True
    assert config.timeline is None
    assert config.timeout_s == DEFAULT_TIMEOUT_S > 0
    assert config.rebuild_buckets is True
    assert config.shared_memory is True  # gloo on one host: all-reduce through /dev/shm
    assert config.process_sets is False  # the horovod engine's dynamic sets stay off


def test_unrelated_variables_are_ignored() -> None:
    env = {"PATH": "/usr/bin", "HOROVOD_CYCLE_TIME": "5", "DP_PLUGINX": "1", "RANK": "0"}
    assert Config.from_env(env) == Config()


def test_plugin_names() -> None:
    config = Config.from_env({
        "DP_PLUGIN_ENGINE": "gloo",
        "DP_PLUGIN_FUSION_THRESHOLD": "1048576",
        "DP_PLUGIN_TIMELINE": "/tmp/t.json",
        "DP_PLUGIN_TIMEOUT": "12.5",
        "DP_PLUGIN_REBUILD_BUCKETS": "0",
        "DP_PLUGIN_SHARED_MEMORY": "off",
    })
    assert config == Config(engine="gloo", fusion_threshold=1 << 20, timeline="/tmp/t.json",
                            timeout_s=12.5, rebuild_buckets=False, first_bucket_threshold=None,
                            min_buckets=1, shared_memory=False)


@pytest.mark.parametrize("name", ENGINE_NAMES)
def test_every_engine_name_is_accepted_in_any_case(name: str) -> None:
    assert Config.from_env({"DP_PLUGIN_ENGINE": f" {name.upper()} "}).engine == name


def test_horovod_names() -> None:
    config = Config.from_env({"HOROVOD_FUSION_THRESHOLD": "33554432",
                              "HOROVOD_TIMELINE": "/tmp/hvd.json"})
    assert config.fusion_threshold == 32 * 1024 * 1024
    assert config.timeline == "/tmp/hvd.json"


def test_horovod_fusion_threshold_zero_means_one_tensor_per_bucket() -> None:
    assert Config.from_env({"HOROVOD_FUSION_THRESHOLD": "0"}).fusion_threshold == 1


def test_plugin_names_win_over_horovod_names() -> None:
    config = Config.from_env({
        "DP_PLUGIN_FUSION_THRESHOLD": "1000", "HOROVOD_FUSION_THRESHOLD": "2000",
        "DP_PLUGIN_TIMELINE": "mine.json", "HOROVOD_TIMELINE": "hvd.json",
    })
    assert config.fusion_threshold == 1000
    assert config.timeline == "mine.json"
    # The Horovod value is not even parsed when the plugin's is set.
    env = {"DP_PLUGIN_FUSION_THRESHOLD": "1000", "HOROVOD_FUSION_THRESHOLD": "lots"}
    assert Config.from_env(env).fusion_threshold == 1000


def test_empty_timeline_means_none() -> None:
    assert Config.from_env({"DP_PLUGIN_TIMELINE": ""}).timeline is None
    # An empty plugin value does not hide Horovod's.
    env = {"DP_PLUGIN_TIMELINE": "", "HOROVOD_TIMELINE": "hvd.json"}
    assert Config.from_env(env).timeline == "hvd.json"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("true", True), ("YES", True), ("on", True),
     ("0", False), ("false", False), ("No", False), ("off", False), ("", False)],
)
def test_boolean_spellings(raw: str, expected: bool) -> None:
    assert Config.from_env({"DP_PLUGIN_REBUILD_BUCKETS": raw}).rebuild_buckets is expected


def test_from_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DP_PLUGIN_FUSION_THRESHOLD", "4096")
    monkeypatch.delenv("DP_PLUGIN_ENGINE", raising=False)
    config = Config.from_env()
    assert config.fusion_threshold == 4096


# -- bad values ---------------------------------------------------------------------

def _message(env: dict[str, str]) -> str:
    with pytest.raises(ValueError) as info:
        Config.from_env(env)
    return str(info.value)


def test_unknown_engine_lists_the_valid_ones() -> None:
    message = _message({"DP_PLUGIN_ENGINE": "nvlink"})
    assert "DP_PLUGIN_ENGINE='nvlink'" in message
    for name in ENGINE_NAMES:
        assert name in message


@pytest.mark.parametrize("name", ["DP_PLUGIN_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"])
@pytest.mark.parametrize("raw", ["64MB", "1.5", "", "lots"])
def test_non_integer_threshold_names_variable_and_value(name: str, raw: str) -> None:
    message = _message({name: raw})
    assert f"{name}={raw!r}" in message
    assert "integer" in message


@pytest.mark.parametrize(
    ("env", "shown"),
    [
        ({"DP_PLUGIN_FUSION_THRESHOLD": "0"}, "DP_PLUGIN_FUSION_THRESHOLD='0'"),
        ({"DP_PLUGIN_FUSION_THRESHOLD": "-5"}, "DP_PLUGIN_FUSION_THRESHOLD='-5'"),
        ({"HOROVOD_FUSION_THRESHOLD": "-1"}, "HOROVOD_FUSION_THRESHOLD='-1'"),
    ],
)
def test_threshold_must_be_positive(env: dict[str, str], shown: str) -> None:
    message = _message(env)
    assert shown in message
    assert "positive" in message and str(DEFAULT_FUSION_THRESHOLD) in message


@pytest.mark.parametrize("raw", ["0", "-3", "soon", "nan", "", "inf"])
def test_bad_timeout_names_variable_and_value(raw: str) -> None:
    message = _message({"DP_PLUGIN_TIMEOUT": raw})
    assert f"DP_PLUGIN_TIMEOUT={raw!r}" in message
    assert "positive number of seconds" in message


def test_stall_warning_default_off_and_seconds() -> None:
    assert Config().stall_warning_s == 60.0  # Horovod's stall inspector's default
    assert Config.from_env({"DP_PLUGIN_STALL_WARNING_SECONDS": "0"}).stall_warning_s == 0.0
    assert Config.from_env({"DP_PLUGIN_STALL_WARNING_SECONDS": "2.5"}).stall_warning_s == 2.5
    assert Config.from_env({"DP_PLUGIN_STALL_WARNING_SECONDS": "2.5"}).timeout_s == \
        DEFAULT_TIMEOUT_S


@pytest.mark.parametrize("raw", ["-1", "soon", "nan", "", "inf"])
def test_bad_stall_warning_names_variable_value_and_off(raw: str) -> None:
    message = _message({"DP_PLUGIN_STALL_WARNING_SECONDS": raw})
    assert f"DP_PLUGIN_STALL_WARNING_SECONDS={raw!r}" in message
    assert "0 turns the warning off" in message


def test_bad_boolean_lists_the_spellings() -> None:
    message = _message({"DP_PLUGIN_REBUILD_BUCKETS": "maybe"})
    assert "DP_PLUGIN_REBUILD_BUCKETS='maybe'" in message
    assert "true/false" in message


# -- the dataclass itself ----------------------------------------------------------

def test_config_is_frozen_keyword_only_and_slotted() -> None:
    config = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.engine = "mpi"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Config("mpi")  # type: ignore[call-arg]
    assert not hasattr(config, "__dict__")
    assert dataclasses.replace(config, engine="mpi").engine == "mpi"
    assert config.engine == "auto"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"engine": "bogus"}, ["'bogus'", "DP_PLUGIN_ENGINE", *ENGINE_NAMES]),
        ({"fusion_threshold": 0}, ["fusion_threshold", ">= 1", "got 0"]),
        ({"fusion_threshold": True}, ["fusion_threshold", "True"]),
        ({"fusion_threshold": 1.5}, ["fusion_threshold", "1.5"]),
        ({"timeout_s": 0.0}, ["timeout_s", "0.0"]),
        ({"timeout_s": float("nan")}, ["timeout_s", "nan"]),
        ({"timeout_s": float("inf")}, ["timeout_s", "inf", "finite"]),
        ({"timeout_s": "300"}, ["timeout_s", "'300'"]),
        ({"stall_warning_s": -1.0}, ["stall_warning_s", "-1.0", "0 turns the warning off"]),
    ],
)
def test_direct_construction_is_validated(kwargs: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        Config(**kwargs)  # type: ignore[arg-type]
    for word in words:
        assert word in str(info.value)


# -- found by the property-based tests (tests/unit/test_fuzz_config_launch.py) ----------


@pytest.mark.parametrize(("env", "words"), [
    # Accepted before, then crashed in timedelta(seconds=1e300) at engine start.
    ({"DP_PLUGIN_TIMEOUT": "1e300"}, ["DP_PLUGIN_TIMEOUT='1e300'", "at most 604800"]),
    ({"DP_PLUGIN_FUSION_THRESHOLD": "1" + "0" * 30}, ["DP_PLUGIN_FUSION_THRESHOLD", "<= "]),
    ({"HOROVOD_FUSION_THRESHOLD": "9" * 5000}, ["HOROVOD_FUSION_THRESHOLD", "not an integer"]),
    ({"DP_PLUGIN_TIMELINE": "/tmp/a\x00b"}, ["DP_PLUGIN_TIMELINE", "NUL"]),
    ({"DP_PLUGIN_REBUILD_BUCKETS": "0.0"}, ["DP_PLUGIN_REBUILD_BUCKETS='0.0'", "1/0"]),
    ({"DP_PLUGIN_SHARED_MEMORY": "shm"}, ["DP_PLUGIN_SHARED_MEMORY='shm'", "1/0"]),
])
def test_bad_values_raise_config_error_naming_the_variable(env: dict[str, str],
                                                           words: list[str]) -> None:
    from dp_plugin.errors import ConfigError, DPPluginError

    with pytest.raises(ConfigError) as info:
        Config.from_env(env)
    assert isinstance(info.value, DPPluginError) and isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value), str(info.value)


@pytest.mark.parametrize(("kwargs", "word"), [
    ({"rebuild_buckets": "no"}, "rebuild_buckets"),  # was silently truthy
    ({"process_sets": "dynamic"}, "process_sets"),
    ({"timeline": 3}, "timeline"),
    ({"timeout_s": 10 ** 400}, "timeout_s"),  # was an OverflowError from float()
    ({"fusion_threshold": 1 << 50}, "fusion_threshold"),
    ({"timeline_max_bytes": -1}, "DP_PLUGIN_TIMELINE_MAX_BYTES"),
])
def test_direct_construction_refuses_what_from_env_refuses(kwargs: dict[str, object],
                                                           word: str) -> None:
    from dp_plugin.errors import ConfigError

    with pytest.raises(ConfigError, match=word):
        Config(**kwargs)  # type: ignore[arg-type]


def test_timeline_max_bytes_from_env() -> None:
    from dp_plugin.config import DEFAULT_TIMELINE_MAX_BYTES
    from dp_plugin.errors import ConfigError

    assert Config().timeline_max_bytes == DEFAULT_TIMELINE_MAX_BYTES == 1 << 30
    env = {"DP_PLUGIN_TIMELINE_MAX_BYTES": "4096"}
    assert Config.from_env(env).timeline_max_bytes == 4096
    assert Config.from_env({"DP_PLUGIN_TIMELINE_MAX_BYTES": "0"}).timeline_max_bytes == 0
    for bad in ("-1", "1MB", ""):
        with pytest.raises(ConfigError, match=f"DP_PLUGIN_TIMELINE_MAX_BYTES={bad!r}"):
            Config.from_env({"DP_PLUGIN_TIMELINE_MAX_BYTES": bad})


def test_default_timeout_is_torch_gloo_default_thirty_minutes() -> None:
    # A rank-0-only evaluation or checkpoint must not kill the job (docs/configuration.md).
    assert Config().timeout_s == DEFAULT_TIMEOUT_S == 1800.0


@pytest.mark.parametrize("variable", ["DP_PLUGIN_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"])
def test_a_users_threshold_applies_to_every_bucket_including_the_first(variable: str) -> None:
    # As DDP with bucket_cap_mb: the small first bucket is the default's only.
    config = Config.from_env({variable: str(8 << 20)})
    assert config.fusion_threshold == 8 << 20
    assert config.first_bucket_threshold is None
    assert config.min_buckets == 1  # and no spreading: the user's size is kept
    assert config.bucket_caps(total_bytes=10 << 20) == (8 << 20, None)
    # Unless they also ask for it.
    both = Config.from_env({variable: str(8 << 20), "DP_PLUGIN_MIN_BUCKETS": "5"})
    assert both.min_buckets == 5


def test_gradient_as_bucket_view_can_be_turned_off() -> None:
    assert Config.from_env({"DP_PLUGIN_GRADIENT_AS_BUCKET_VIEW": "0"}).gradient_as_bucket_view \
        is False
    with pytest.raises(ConfigError, match=r"DP_PLUGIN_GRADIENT_AS_BUCKET_VIEW.*'maybe'"):
        Config.from_env({"DP_PLUGIN_GRADIENT_AS_BUCKET_VIEW": "maybe"})
    with pytest.raises(ConfigError, match="gradient_as_bucket_view must be True or False, got 1"):
        Config(gradient_as_bucket_view=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"first_bucket_threshold.*got 0"):
        Config(first_bucket_threshold=0)


def test_runtime_init_records_a_request_for_process_sets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``init(process_sets=...)`` reaches the engine's Config (the horovod engine
    enables dynamic sets only then); a plain init leaves it off."""
    from dp_plugin.launch import runtime

    seen: list[Config] = []

    def fake_create(name: str, topo: object, config: Config) -> object:
        seen.append(config)
        return object()

    monkeypatch.setattr("dp_plugin.engines.create_engine", fake_create)
    for asked in (False, True):
        monkeypatch.setattr(runtime, "_engine", None)
        runtime.init(Config(engine="local"), env={}, process_sets=asked)
        assert seen[-1].process_sets is asked
        assert seen[-1].engine == "local"
    monkeypatch.setattr(runtime, "_engine", None)


def test_bucket_caps_keep_the_small_first_bucket_only_for_the_configured_threshold() -> None:
    config = Config()
    assert config.bucket_caps() == (DEFAULT_FUSION_THRESHOLD, DEFAULT_FIRST_BUCKET_THRESHOLD)
    assert config.bucket_caps(4096) == (4096, None)  # a caller's explicit threshold
    assert Config(first_bucket_threshold=None).bucket_caps() == (DEFAULT_FUSION_THRESHOLD, None)


MIB = 1 << 20


@pytest.mark.parametrize(("total", "cap"), [
    (0, DEFAULT_FUSION_THRESHOLD),                 # unknown size: the threshold
    (500 * MIB, DEFAULT_FUSION_THRESHOLD),         # a large model: DDP's 25 MiB
    (100 * MIB, DEFAULT_FUSION_THRESHOLD),         # exactly 4 of them
    (int(28.5 * MIB), -(-int(28.5 * MIB) // 4)),   # the BERT-like encoder: a quarter each
    (2 * MIB, DEFAULT_FIRST_BUCKET_THRESHOLD),     # never below the first bucket's cap
])
def test_the_default_plan_spreads_a_small_gradient_over_four_buckets(total: int, cap: int) -> None:
    assert DEFAULT_MIN_BUCKETS == 4
    assert Config().bucket_caps(total_bytes=total) == (cap, DEFAULT_FIRST_BUCKET_THRESHOLD)
    # Turned off, or a caller's explicit threshold: the size as set.
    assert Config(min_buckets=1).bucket_caps(total_bytes=total)[0] == DEFAULT_FUSION_THRESHOLD
    assert Config().bucket_caps(4096, total_bytes=total) == (4096, None)
    assert Config.from_env({"DP_PLUGIN_MIN_BUCKETS": "2"}).bucket_caps(
        total_bytes=20 * MIB)[0] == 10 * MIB


@pytest.mark.parametrize("bad", [0, 1025, True, 2.0, "4"])
def test_min_buckets_must_be_a_small_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError, match=rf"min_buckets must be .*got {bad!r}.*"
                                          "DP_PLUGIN_MIN_BUCKETS"):
        Config(min_buckets=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("raw", ["0", "many", "2000"])
def test_min_buckets_from_the_environment_names_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match=rf"DP_PLUGIN_MIN_BUCKETS.*{raw}"):
        Config.from_env({"DP_PLUGIN_MIN_BUCKETS": raw})
