"""The gloo engine's hierarchical all-reduce (dp_plugin/engines/hierarchical.py)
and the shared-memory transport's per-operation check, in real processes.

Four ranks as two "hosts" of two (``workers/fake_hosts.py`` sets the
variables torchrun sets on each host; the engine decides from the
topology it reads): chosen automatically, and forced flat by Horovod's
variable, both match a single-process reference within 1e-5, with every
rank bitwise equal; DistributedOptimizer training (``torch_equivalence.py``,
bitwise equal ranks, within 1e-5 of one process) forced hierarchical by
``DP_PLUGIN_HIERARCHICAL_ALLREDUCE=1``; a rank killed while pieces are in
the pipeline fails every other rank, none hangs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers

WORKERS = Path(__file__).parent / "workers"
FAKE_HOSTS = WORKERS / "fake_hosts.py"
WORKER = WORKERS / "hierarchical_allreduce.py"
ENV = {"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "60", "DP_TEST_RANKS_PER_HOST": "2"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("setting", "expect"), [({}, "1"),
                                                  ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, "0")],
                         ids=["automatic", "flat-by-horovod-variable"])
def test_hierarchical_and_flat_match_one_process(setting: dict[str, str], expect: str) -> None:
    env = dict(ENV, DP_TEST_EXPECT_HIERARCHICAL=expect, **setting)
    result = run_workers("env", 4, FAKE_HOSTS, [str(WORKER), "--case", "equivalence"], env=env,
                         timeout=240)
    assert_ranks_ok(result, 4)


@pytest.mark.timeout(300)
def test_training_under_the_hierarchical_path_matches_one_process() -> None:
    result = run_workers("env", 4, FAKE_HOSTS,
                         [str(WORKERS / "torch_equivalence.py"), "--case", "optimizers"],
                         env=dict(ENV, DP_PLUGIN_HIERARCHICAL_ALLREDUCE="1"), timeout=240)
    assert_ranks_ok(result, 4)


@pytest.mark.timeout(120)
def test_a_rank_killed_mid_pipeline_fails_every_other_rank() -> None:
    result = run_workers("env", 4, FAKE_HOSTS, [str(WORKER), "--case", "killed"],
                         env=dict(ENV, DP_PLUGIN_TIMEOUT="8"), timeout=100, check=False)
    assert result.returncodes[3] == -9, result.returncodes
    for rank in (0, 1, 2):
        assert f"rank {rank} raised: " in result.output, result.output
    said = {rank: next(x for x in result.output.splitlines() if f"rank {rank} raised: " in x)
            for rank in (0, 1, 2)}
    # Its host peer names job ranks: itself (2) and the dead one (3), not
    # their local ranks on the host (0 and 1).
    assert "rank 2 raised: rank 2: " in said[2] and "rank 3 of this shared-memory group" in said[2]
    # The other host: rank 1 loses rank 3 in its cross-host step. Both used
    # to get Gloo's raw text (or 'rank 1 closed its connection'), naming no
    # rank, in a nested description.
    assert "rank 1 raised: rank 1: gloo allreduce of 'killed." in said[1], said[1]
    assert ("rank 3 (its peer on another host, in the cross-host step of elements "
            in said[1]), said[1]
    # Rank 0 is two hops from the dead rank, and which hop breaks first is a
    # race: its host peer (rank 1) stops because rank 3 cannot be reached, or
    # its cross-host peer (rank 2) stops because rank 3 died beside it. Either
    # way it names the rank that stopped and why.
    assert "rank 0 raised: rank 0: gloo allreduce of 'killed." in said[0], said[0]
    via_host_peer = ("rank 1 of this shared-memory group stopped, as rank 3 (its peer on "
                     "another host, in the cross-host step" in said[0])
    via_cross_host_peer = ("rank 2 (its peer on another host, in the cross-host step of "
                           "elements " in said[0]
                           and "rank 2: stopped, as rank 3 (its peer on the same host, in the "
                           "shared-memory transport) cannot be reached" in said[0])
    assert via_host_peer or via_cross_host_peer, said[0]
    for line in said.values():
        assert "pair.cc" not in line and 'allreduce of "' not in line, line


@pytest.mark.timeout(120)
def test_different_counts_raise_on_both_ranks_through_the_engine() -> None:
    result = run_workers("env", 2, WORKER, ["--case", "mismatch"],
                         env={"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "30"}, timeout=100)
    assert_ranks_ok(result, 2)
    assert result.output.count("raised: ") == 2, result.output
