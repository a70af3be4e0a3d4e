"""The suite's order (tests/conftest.py): the longest files first, each
file's tests together and in their order."""

from __future__ import annotations

from tests.conftest import FILE_SECONDS, file_costs, longest_files_first


def test_known_long_files_go_before_many_short_tests() -> None:
    names = (["tests/unit/test_config.py"] * 300
             + ["tests/examples/test_cluster.py"] * 2
             + ["tests/unit/test_fusion.py"] * 2
             + ["tests/schedulers/test_ray.py"] * 4)
    order = longest_files_first(names)
    assert sorted(order) == list(range(len(names)))
    assert [names[i] for i in order[:6]] == (["tests/schedulers/test_ray.py"] * 4
                                            + ["tests/examples/test_cluster.py"] * 2)
    # each file's tests stay in their order
    assert order[:6] == [304, 305, 306, 307, 300, 301]
    assert order[6:306] == list(range(300))
    assert order[306:] == [302, 303]


def test_unknown_files_are_estimated_from_their_directory_and_count() -> None:
    costs = file_costs(["tests/multiproc/test_new.py"] * 4 + ["tests/unit/test_new.py"] * 40
                       + ["tests/examples/test_new.py"])
    assert costs["tests/multiproc/test_new.py"] > costs["tests/unit/test_new.py"]
    assert costs["tests/examples/test_new.py"] > costs["tests/unit/test_new.py"]


def test_ties_keep_the_collection_order() -> None:
    names = ["tests/unit/test_b.py", "tests/unit/test_a.py"]
    assert longest_files_first(names) == [0, 1]


def test_every_listed_file_exists() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    missing = [name for name in FILE_SECONDS if not (root / name).is_file()]
    assert not missing, f"tests/conftest.py's FILE_SECONDS names files that are gone: {missing}"
