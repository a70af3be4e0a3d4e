"""When the gloo engine goes hierarchical, and the layout it reads
(dp_plugin/engines/hierarchical.py); the path itself runs in real
processes in tests/multiproc/test_hierarchical.py."""

from __future__ import annotations

import numpy as np
import pytest

from dp_plugin.config import Config
from dp_plugin.engines import hierarchical
from dp_plugin.errors import ConfigError
from dp_plugin.launch import Topology


def topo(size: int, local_size: int, cross_size: int) -> Topology:
    return Topology(launcher="torchrun", rank=0, size=size, local_rank=0,
                    local_size=local_size, cross_rank=0, cross_size=cross_size)


@pytest.mark.parametrize(("env", "t", "expect"), [
    ({}, topo(4, 2, 2), True),                 # 2 hosts x 2: automatic
    ({}, topo(2, 1, 2), False),                # one rank per host: nothing inside a host
    ({}, topo(4, 4, 1), False),                # one host: flat shared memory
    ({}, topo(5, 3, 2), False),                # uneven hosts
    ({"DP_PLUGIN_SHARED_MEMORY": "0"}, topo(4, 2, 2), False),
    ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, topo(4, 2, 2), False),
    ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}, topo(4, 4, 1), True),
    ({"DP_PLUGIN_HIERARCHICAL_ALLREDUCE": "0", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1"},
     topo(4, 2, 2), False),                    # ours wins
    ({"DP_PLUGIN_HIERARCHICAL_ALLREDUCE": "1"}, Topology.single(), False),
])
def test_wanted_follows_the_topology_and_the_switch(env: dict[str, str], t: Topology,
                                                    expect: bool) -> None:
    assert hierarchical.wanted(t, Config.from_env(env)) is expect


def test_a_bad_switch_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="HOROVOD_HIERARCHICAL_ALLREDUCE='maybe'"):
        Config.from_env({"HOROVOD_HIERARCHICAL_ALLREDUCE": "maybe"})
    with pytest.raises(ConfigError, match="DP_PLUGIN_SHARED_MEMORY_BUDGET"):
        Config.from_env({"DP_PLUGIN_SHARED_MEMORY_BUDGET": "-1"})
    assert Config.from_env({"DP_PLUGIN_SHARED_MEMORY_BUDGET": "16777216"}
                           ).shared_memory_budget == 16 << 20


def test_layout_of_round_robin_placement() -> None:
    # mpirun --map-by node: ranks go round the hosts in turn
    table = np.array([[0, 0], [1, 0], [0, 1], [1, 1], [0, 2], [1, 2]])
    layout, why = hierarchical.layout(table)
    assert layout is not None, why
    assert layout.hosts == ((0, 2, 4), (1, 3, 5))
    assert layout.host_of(3) == (1, 3, 5)
    assert layout.peer_groups() == [(0, 1), (2, 3), (4, 5)]


@pytest.mark.parametrize(("table", "why"), [
    ([[0, 0], [0, 1], [1, 0]], "different numbers of ranks (host 0: 2, host 1: 1)"),
    ([[0, 0], [0, 0]], "ranks 0 and 1 both say they are local rank 0 of host 0"),
    ([[0, 0], [1, 0]], "every host runs one rank"),
    ([[0, 0], [0, 2]], "host 0's local ranks are [0, 2], not 0..1"),
])
def test_layouts_that_are_not_a_grid_keep_the_flat_ring(table: list[list[int]], why: str) -> None:
    layout, said = hierarchical.layout(np.array(table))
    assert layout is None and why in said


def test_the_host_exchange_gives_up_everywhere_when_one_rank_does() -> None:
    job = np.array([[4096, 7], [4096, 0], [0, 0], [4096, 0]])  # rank 2 (host 1) cannot
    among = hierarchical.host_exchange(lambda row, what: job, (0, 1))
    got = among(np.array([4096, 7]), "shm setup")
    assert got.tolist() == [[0, 7], [0, 0]]
    job[2, 0] = 4096
    assert among(np.array([4096, 7]), "shm setup").tolist() == [[4096, 7], [4096, 0]]
