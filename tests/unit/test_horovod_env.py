"""The HOROVOD_* variables the horovod engine sets around hvd.init()."""

from __future__ import annotations

import os

import pytest

from dp_plugin.config import Config
from dp_plugin.engines import horovod_env
from dp_plugin.engines.horovod_env import LIBRARY_FUSION_BYTES, library_fusion, library_settings
from dp_plugin.errors import EngineUnavailableError

NAMES = ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_DYNAMIC_PROCESS_SETS")


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """No HOROVOD_* variable set, and no earlier hvd.init() in this "process"."""
    for name in NAMES:
        monkeypatch.setenv(name, "recorded")  # so that teardown removes what the test sets
        monkeypatch.delenv(name)
    monkeypatch.setattr(horovod_env, "_both_fixed", False)


def test_library_fusion_stays_below_dp_plugins_buckets() -> None:
    assert library_fusion(Config()) == str(LIBRARY_FUSION_BYTES)
    assert library_fusion(Config(fusion_threshold=4096)) == "4096"
    assert library_fusion(Config(fusion_threshold=1)) == "0"  # the user asked for no fusion
    # HOROVOD_FUSION_THRESHOLD=0 is dp_plugin's 1-byte threshold, and Horovod's 0.
    assert library_fusion(Config.from_env({"HOROVOD_FUSION_THRESHOLD": "0"})) == "0"


@pytest.mark.parametrize("user", [None, "0", "8388608"])
def test_fusion_threshold_is_the_librarys_inside_and_the_users_after(
        monkeypatch: pytest.MonkeyPatch, user: str | None) -> None:
    if user is not None:
        monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", user)
    config = Config.from_env()
    with library_settings(config):
        assert os.environ["HOROVOD_FUSION_THRESHOLD"] == library_fusion(config)
        assert "HOROVOD_CYCLE_TIME" not in os.environ  # never beside the threshold
        assert "HOROVOD_DYNAMIC_PROCESS_SETS" not in os.environ  # not asked for
    assert os.environ.get("HOROVOD_FUSION_THRESHOLD") == user
    assert Config.from_env() == config  # a later init reads the user's value again


def test_dynamic_sets_only_on_request_and_a_users_cycle_time_alone_stays_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "2")
    for _ in range(3):  # init, shutdown, init...: never both fixed, so never refused
        with library_settings(Config(process_sets=True)):
            assert os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] == "1"
            assert os.environ["HOROVOD_CYCLE_TIME"] == "2"
            assert "HOROVOD_FUSION_THRESHOLD" not in os.environ


def test_a_reinit_after_both_were_set_is_refused_not_crashed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "2")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "8388608")
    with library_settings(Config.from_env()):  # the user's own choice: both, once
        assert os.environ["HOROVOD_FUSION_THRESHOLD"] == str(LIBRARY_FUSION_BYTES)
    monkeypatch.delenv("HOROVOD_CYCLE_TIME")  # too late: Horovod keeps both fixed
    with pytest.raises(EngineUnavailableError) as err, library_settings(Config()):
        raise AssertionError("not reached")
    message = str(err.value)
    for part in ("HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD", "segmentation fault",
                 "DP_PLUGIN_FUSION_THRESHOLD", "DP_PLUGIN_ENGINE=gloo"):
        assert part in message


def test_the_variable_is_restored_when_init_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "123")
    with pytest.raises(RuntimeError, match="rendezvous"), library_settings(Config()):
        raise RuntimeError("rendezvous failed")
    assert os.environ["HOROVOD_FUSION_THRESHOLD"] == "123"
