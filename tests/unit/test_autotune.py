"""Autotune of the fusion threshold: the decision rule, the state machine, the
configuration, and the scheduler on a fake thread group where each rank
measures other step times (a fake clock) yet every rank adopts rank 0's choice.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from dp_plugin.config import DEFAULT_AUTOTUNE_CANDIDATES, Config
from dp_plugin.errors import ConfigError, LayoutMismatchError
from dp_plugin.reduce import autotune
from dp_plugin.reduce.autotune import Autotuner, choose, distinct
from dp_plugin.reduce.fusion import TensorSpec
from dp_plugin.reduce.reducer import GradientScheduler
from tests.unit.fakes import FakeEngine, make_thread_group, run_ranks, run_ranks_outcomes

# -- the decision rule ---------------------------------------------------------------


def test_choose_takes_the_lowest_median() -> None:
    assert choose([1, 4, 8], [0.3, 0.1, 0.2], configured=8) == 4


def test_choose_ties_keep_the_configured_threshold() -> None:
    assert choose([1, 4, 8], [0.1, 0.1, 0.1], configured=4) == 4


def test_choose_ties_without_the_configured_take_the_largest() -> None:
    assert choose([1, 4, 8, 16], [0.1, 0.1, 0.1, 0.2], configured=16) == 8


def test_choose_single_candidate() -> None:
    assert choose([25], [0.5], configured=25) == 25


def test_choose_needs_one_median_per_candidate() -> None:
    with pytest.raises(ValueError, match="one median per candidate"):
        choose([1, 4], [0.1], configured=1)
    with pytest.raises(ValueError, match="one median per candidate"):
        choose([], [], configured=1)


def test_distinct_collapses_thresholds_that_give_the_same_plan() -> None:
    # A "model" of 10 bytes: every threshold >= 10 gives one bucket.
    def key(t: int) -> object:
        return min(t, 10)

    assert distinct([1, 4, 16, 64], 32, key) == (1, 4, 32)  # configured represents its plan
    assert distinct([1, 4, 16, 64], 4, key) == (1, 4, 16)
    assert distinct([64, 16], 128, key) == (128,)


# -- the state machine -----------------------------------------------------------------


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """A clock that returns the values appended to the list, in order."""
    readings: list[float] = []
    monkeypatch.setattr(autotune, "clock", lambda: readings.pop(0))
    yield readings


def test_state_machine_switches_measures_and_decides(fake_clock: list[float]) -> None:
    tuner = Autotuner([1, 2], 3, warmup_steps=1, steps=2)
    shared: list[np.ndarray] = []

    def share(values: np.ndarray) -> np.ndarray:
        shared.append(values.copy())
        return values

    costs = {1: 0.5, 2: 0.2, 3: 0.3}
    now, active, switched = 0.0, 3, []
    for _ in range(1 + 3 * 3):
        fake_clock.append(now)
        new = tuner.step_ended(lambda t: t, share)
        if new is not None:
            switched.append(new)
            active = new
        now += costs[active]
    assert switched == [1, 2, 3, 2]  # each candidate, then the choice
    assert tuner.decision is not None
    assert tuner.decision.candidates == (1, 2, 3)
    assert tuner.decision.medians == pytest.approx((0.5, 0.2, 0.3))
    assert len(shared) == 1
    fake_clock.append(now)
    assert tuner.step_ended(lambda t: t, share) is None  # done: nothing more


def test_single_candidate_decides_at_once_without_a_collective(fake_clock: list[float]) -> None:
    tuner = Autotuner([64], 25, warmup_steps=1, steps=1)
    fake_clock.append(0.0)

    def share(values: np.ndarray) -> np.ndarray:
        raise AssertionError("no collective for a single candidate")

    assert tuner.step_ended(lambda t: "one bucket", share) == 25
    assert tuner.decision is not None and tuner.decision.chosen == 25


# -- configuration ---------------------------------------------------------------------


def test_autotune_is_off_by_default() -> None:
    config = Config.from_env({})
    assert config.autotune is False
    assert config.autotune_candidates == DEFAULT_AUTOTUNE_CANDIDATES
    assert config.autotune_warmup_steps == 2 and config.autotune_steps == 5


def test_autotune_from_env() -> None:
    config = Config.from_env({
        "DP_PLUGIN_AUTOTUNE": "1", "DP_PLUGIN_AUTOTUNE_WARMUP_STEPS": "0",
        "DP_PLUGIN_AUTOTUNE_STEPS": "7", "DP_PLUGIN_AUTOTUNE_CANDIDATES": " 1024, 4096 ",
    })
    assert config.autotune is True
    assert config.autotune_warmup_steps == 0 and config.autotune_steps == 7
    assert config.autotune_candidates == (1024, 4096)


@pytest.mark.parametrize(("env", "words"), [
    ({"DP_PLUGIN_AUTOTUNE": "maybe"}, ["DP_PLUGIN_AUTOTUNE='maybe'", "1/0"]),
    ({"DP_PLUGIN_AUTOTUNE_STEPS": "0"}, ["DP_PLUGIN_AUTOTUNE_STEPS='0'", ">= 1"]),
    ({"DP_PLUGIN_AUTOTUNE_STEPS": "many"}, ["DP_PLUGIN_AUTOTUNE_STEPS='many'", "integer"]),
    ({"DP_PLUGIN_AUTOTUNE_WARMUP_STEPS": "-1"}, ["DP_PLUGIN_AUTOTUNE_WARMUP_STEPS='-1'", ">= 0"]),
    ({"DP_PLUGIN_AUTOTUNE_WARMUP_STEPS": "5000"}, ["DP_PLUGIN_AUTOTUNE_WARMUP_STEPS", "<= 1000"]),
    ({"DP_PLUGIN_AUTOTUNE_CANDIDATES": "1MiB"}, ["DP_PLUGIN_AUTOTUNE_CANDIDATES='1MiB'",
                                                 "'1MiB' is not an integer", "1048576"]),
    ({"DP_PLUGIN_AUTOTUNE_CANDIDATES": "1024,0"}, ["DP_PLUGIN_AUTOTUNE_CANDIDATES", "0 must be"]),
    ({"DP_PLUGIN_AUTOTUNE_CANDIDATES": ""}, ["DP_PLUGIN_AUTOTUNE_CANDIDATES=''", "comma"]),
    ({"DP_PLUGIN_AUTOTUNE_CANDIDATES": ",".join(["1"] * 17)},
     ["DP_PLUGIN_AUTOTUNE_CANDIDATES", "at most 16"]),
])
def test_bad_autotune_values_name_the_variable(env: dict[str, str], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_env(env)
    for word in words:
        assert word in str(info.value), str(info.value)


@pytest.mark.parametrize(("kwargs", "word"), [
    ({"autotune": "yes"}, "autotune must be True or False"),
    ({"autotune_steps": 0}, "autotune_steps"),
    ({"autotune_warmup_steps": True}, "autotune_warmup_steps"),
    ({"autotune_candidates": [1024]}, "autotune_candidates"),
    ({"autotune_candidates": ()}, "autotune_candidates"),
    ({"autotune_candidates": (1024, 1 << 50)}, "autotune_candidates"),
])
def test_direct_construction_checks_autotune(kwargs: dict[str, object], word: str) -> None:
    with pytest.raises(ConfigError, match=word):
        Config(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("variable", ["DP_PLUGIN_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"])
def test_explicit_threshold_with_autotune_warns_and_becomes_a_candidate(variable: str) -> None:
    with pytest.warns(UserWarning, match=f"DP_PLUGIN_AUTOTUNE=1 and {variable}='8388608'"):
        config = Config.from_env({"DP_PLUGIN_AUTOTUNE": "1", variable: "8388608"})
    assert config.fusion_threshold == 8 << 20 and config.autotune


# -- the scheduler: every rank adopts rank 0's choice ------------------------------------

SPECS = [TensorSpec(f"t{i}", (n,), "float32") for i, n in enumerate([4, 6, 8, 2, 10, 3])]
CANDIDATES = (8, 40, 64)
"""Bytes: each gives another plan of SPECS (132 bytes), as does the configured 25 MiB."""


def fake_costs(rank: int) -> dict[int, float]:
    """Step seconds per threshold: rank 0 finds 40 fastest, rank 1 finds 8 fastest."""
    if rank == 0:
        return {8: 0.3, 40: 0.1, 64: 0.2, 25 << 20: 0.4}
    return {8: 0.05, 40: 0.5, 64: 0.2, 25 << 20: 0.4}


class PerRankClock:
    """``autotune.clock`` for thread-ranks: each rank's time advances by its own
    cost of the threshold its scheduler used in the step that just ended."""

    def __init__(self) -> None:
        self.local = threading.local()

    def start(self, rank: int, sched: GradientScheduler) -> None:
        self.local.rank, self.local.sched, self.local.now = rank, sched, 0.0

    def __call__(self) -> float:
        loc = self.local
        loc.now += fake_costs(loc.rank)[loc.sched.fusion_threshold]
        return float(loc.now)


def grads(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng([rank, step])
    return [(rng.integers(-8, 9, size=s.shape) / 4).astype(np.float32) for s in SPECS]


def train(e: FakeEngine, clock: PerRankClock, steps: int, **kwargs: Any) -> dict[str, Any]:
    sched = GradientScheduler(SPECS, engine=e, **kwargs)
    clock.start(e.rank, sched)
    results, thresholds = [], []
    for step in range(steps):
        g = grads(e.rank, step)
        for i in reversed(range(len(SPECS))):
            sched.mark_ready(i, g[i])
        out = sched.synchronize()
        results.append([np.array(o, copy=True) for o in out])
        thresholds.append(sched.fusion_threshold)
    sched.close()
    return {"sched": sched, "results": results, "thresholds": thresholds,
            "plan": [b.members for b in sched.plan]}


def autotune_config(**extra: Any) -> Config:
    # min_buckets=1: the configured threshold is a candidate as it is set.
    return Config(timeout_s=30.0, autotune=True, autotune_candidates=CANDIDATES,
                  autotune_warmup_steps=1, autotune_steps=3, min_buckets=1, **extra)


def test_every_rank_adopts_rank_zeros_choice(monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    clock = PerRankClock()
    monkeypatch.setattr(autotune, "clock", clock)
    engines = make_thread_group(2, config=autotune_config())
    steps = 1 + 4 * (1 + 3) + 2  # candidates 8, 40, 64, configured 25 MiB; then 2 more
    with caplog.at_level(logging.INFO, logger="dp_plugin"):
        out = run_ranks(engines, lambda e: train(e, clock, steps, autotune=True))
    decisions = [o["sched"].autotuner.decision for o in out]
    assert decisions[0].candidates == (8, 40, 64, 25 << 20)
    assert [d.chosen for d in decisions] == [40, 40]  # rank 1 alone would pick 8
    assert decisions[1].medians == decisions[0].medians == pytest.approx((0.3, 0.1, 0.2, 0.4))
    assert decisions[1].local_medians == pytest.approx((0.05, 0.5, 0.2, 0.4))
    assert out[0]["thresholds"] == out[1]["thresholds"]
    assert out[0]["thresholds"][-1] == 40 and out[0]["plan"] == out[1]["plan"]
    for rank in range(2):
        shares = [name for kind, name, _ in engines[rank].log if "autotune" in name]
        assert shares == ["grads.autotune"]  # one broadcast, once
    for step in range(steps):  # the average is right whatever the buckets
        want = [(grads(0, step)[i] + grads(1, step)[i]) / 2 for i in range(len(SPECS))]
        for rank in range(2):
            for got, w in zip(out[rank]["results"][step], want, strict=True):
                np.testing.assert_array_equal(got, w)
    lines = [r.getMessage() for r in caplog.records if "autotune chose" in r.getMessage()]
    assert len(lines) == 1 and "40 bytes" in lines[0] and "100.00 ms" in lines[0]


def test_decision_goes_to_the_timeline(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    clock = PerRankClock()
    monkeypatch.setattr(autotune, "clock", clock)
    path = tmp_path / "trace.json"
    engines = make_thread_group(2, config=autotune_config(timeline=str(path)))
    run_ranks(engines, lambda e: train(e, clock, 1 + 4 * 4, autotune=True))
    for rank in range(2):
        events = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())
        tuned = [ev for ev in events if ev.get("cat") == "autotune"]
        assert [ev["name"] for ev in tuned][-1] == "autotune: decision"
        args = tuned[-1]["args"]
        assert args["chosen"] == 40 and args["candidates"] == [8, 40, 64, 25 << 20]
        assert args["rank0_median_s"] == pytest.approx([0.3, 0.1, 0.2, 0.4])


def test_without_autotune_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = PerRankClock()
    monkeypatch.setattr(autotune, "clock", clock)
    engines = make_thread_group(2, config=autotune_config())
    out = run_ranks(engines, lambda e: train(e, clock, 6))
    assert out[0]["sched"].autotuner is None
    assert set(out[0]["thresholds"]) == {25 << 20}
    assert not [n for _, n, _ in engines[0].log if "autotune" in n]


def test_ranks_with_different_autotune_settings_fail_the_agreement() -> None:
    engines = make_thread_group(2, config=autotune_config())

    def body(e: FakeEngine) -> None:
        sched = GradientScheduler(SPECS, engine=e, autotune=e.rank == 0)
        sched.agree()

    outcomes = run_ranks_outcomes(engines, body)
    for o in outcomes:
        assert isinstance(o, LayoutMismatchError) and "DP_PLUGIN_AUTOTUNE" in str(o), o
