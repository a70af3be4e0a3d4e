"""The order test files run in: the longest first.

``make test`` runs two test processes (pytest-xdist, ``--dist loadfile``),
each test file whole in one of them, handed out in the order the files
were collected. Left to itself, xdist hands out the files with the most
tests first (``--loadscope-reorder``), which put the few long tests of the
schedulers and examples last: one process ran a 80 s Ray test alone while
the other had finished. The Makefile turns that off
(``--no-loadscope-reorder``) and this hook sorts the files by their known
cost instead, the longest first, so the short unit files fill the tail.

A file's cost is its summed test time from ``FILE_SECONDS`` (seconds on a
quiet 2-core machine, from ``--durations=0``; rounded, since only the order
matters: refresh it when a file's time moves a lot), else an estimate from
its number of tests. The order inside
a file never changes, and the sort is the same in every test process, as
xdist requires.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent

# Summed test time per file, seconds (the files over ~15 s).
FILE_SECONDS: dict[str, float] = {
    "tests/schedulers/test_ray.py": 230,
    "tests/examples/test_cluster.py": 120,
    "tests/multiproc/test_fault_matrix.py": 90,
    "tests/multiproc/test_faults.py": 90,
    "tests/multiproc/test_keras_train.py": 75,
    "tests/schedulers/test_slurm.py": 70,
    "tests/multiproc/test_torch_training.py": 70,
    "tests/multiproc/test_torch_powersgd.py": 70,
    "tests/multiproc/test_lightning.py": 60,
    "tests/multiproc/test_torch_syncbn_compile_amp.py": 60,
    "tests/multiproc/test_torch_collectives.py": 60,
    "tests/multiproc/test_torch_elastic.py": 55,
    "tests/examples/test_kubernetes.py": 50,
    "tests/multiproc/test_engines_mpi_horovod.py": 50,
    "tests/multiproc/test_torch_sharded.py": 45,
    "tests/multiproc/test_from_ddp_doc.py": 45,
    "tests/examples/test_bert_pretrain.py": 40,
    "tests/multiproc/test_tf_elastic.py": 40,
    "tests/multiproc/test_engine_extras.py": 40,
    "tests/multiproc/test_engines_torch.py": 35,
    "tests/examples/test_resnet_digits.py": 30,
    "tests/schedulers/test_process_group.py": 30,
    "tests/examples/test_keras_digits.py": 28,
    "tests/multiproc/test_keras_torch_train.py": 25,
    "tests/examples/test_recommender.py": 20,
    "tests/tensorflow/test_keras_adapter.py": 20,
}

# Estimated seconds per test, by directory, for files not in FILE_SECONDS.
PER_TEST_SECONDS: dict[str, float] = {
    "schedulers": 20.0,
    "examples": 10.0,
    "install": 10.0,
    "multiproc": 2.5,
    "tensorflow": 0.3,
    "torch": 0.05,
    "unit": 0.05,
}


def _relative(item: pytest.Item) -> str:
    path = item.path.resolve()
    try:
        return path.relative_to(_ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def file_costs(names: list[str]) -> dict[str, float]:
    """Each file's known or estimated cost, in seconds, from the file of
    every collected test (``names``, one entry per test)."""
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    costs = {}
    for name, count in counts.items():
        parts = name.split("/")
        directory = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
        costs[name] = FILE_SECONDS.get(name, count * PER_TEST_SECONDS.get(directory, 0.1))
    return costs


def longest_files_first(names: list[str]) -> list[int]:
    """The positions of the tests whose files are ``names``, reordered: files
    by cost, longest first, ties in collection order; each file's tests
    together and in their order."""
    costs = file_costs(names)
    first_seen: dict[str, int] = {}
    for index, name in enumerate(names):
        first_seen.setdefault(name, index)
    return sorted(range(len(names)), key=lambda i: (-costs[names[i]], first_seen[names[i]], i))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = longest_files_first([_relative(item) for item in items])
    items[:] = [items[i] for i in order]
