"""The HOROVOD_* variables the horovod engine sets around hvd.init()."""

from __future__ import annotations

import os

import pytest

from dp_plugin.config import Config
from dp_plugin.engines.horovod_env import LIBRARY_FUSION_BYTES, library_fusion, library_settings


def test_library_fusion_stays_below_dp_plugins_buckets() -> None:
    assert library_fusion(Config()) == str(LIBRARY_FUSION_BYTES)
    assert library_fusion(Config(fusion_threshold=4096)) == "4096"
    assert library_fusion(Config(fusion_threshold=1)) == "0"  # the user asked for no fusion
    # HOROVOD_FUSION_THRESHOLD=0 is dp_plugin's 1-byte threshold, and Horovod's 0.
    assert library_fusion(Config.from_env({"HOROVOD_FUSION_THRESHOLD": "0"})) == "0"


@pytest.mark.parametrize("user", [None, "0", "8388608"])
def test_fusion_threshold_is_the_librarys_inside_and_the_users_after(
        monkeypatch: pytest.MonkeyPatch, user: str | None) -> None:
    for name in ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME",
                 "HOROVOD_DYNAMIC_PROCESS_SETS"):
        monkeypatch.setenv(name, "recorded")  # so that teardown removes what the test sets
        monkeypatch.delenv(name)
    if user is not None:
        monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", user)
    config = Config.from_env()
    with library_settings(config):
        assert os.environ["HOROVOD_FUSION_THRESHOLD"] == library_fusion(config)
        assert os.environ["HOROVOD_CYCLE_TIME"] == "5"
        assert "HOROVOD_DYNAMIC_PROCESS_SETS" not in os.environ  # not asked for
    assert os.environ.get("HOROVOD_FUSION_THRESHOLD") == user
    assert Config.from_env() == config  # a later init reads the user's value again


def test_dynamic_sets_only_on_request_and_a_users_cycle_time_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "2")
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "recorded")
    monkeypatch.delenv("HOROVOD_DYNAMIC_PROCESS_SETS")
    with library_settings(Config(process_sets=True)):
        assert os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] == "1"
        assert os.environ["HOROVOD_CYCLE_TIME"] == "2"


def test_the_variable_is_restored_when_init_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "123")
    with pytest.raises(RuntimeError, match="rendezvous"), library_settings(Config()):
        raise RuntimeError("rendezvous failed")
    assert os.environ["HOROVOD_FUSION_THRESHOLD"] == "123"
