"""Every code block of the README and the migration pages runs in a test.

Each fenced block of README.md, docs/migrating.md and docs/from-ddp.md, and
of docs/keras.md's quick start (before its "Process-level API" section),
carries a ``<!-- doc-test: KIND -->`` line just above it, which says how it
is run:

- ``program``: a whole Python program, run as written at 2 ranks (the
  harness's env launcher, warm ranks unless the program picks a Keras
  backend, which a warm rank has already imported); every rank must exit 0.
- ``launch``: launch lines for the ``program`` block above it, saved as
  ``train.py``; each line runs under its launcher through the test harness
  (free port, timeout, every exit code checked).
- ``shell``: commands run one by one; each must exit 0.
- ``refused``: code the page says Keras 3 refuses; it must raise so.
- ``elsewhere PATH``: run by that test file, which must read the page.
- ``not run (why)``: kept to the few blocks whose run is the whole suite or
  a long job run by another test.

A block without a marker, or with a kind not listed, fails the test.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.multiproc.harness import BIN_DIR, run_workers

ROOT = Path(__file__).resolve().parents[2]
PAGES = {"README.md": None, "docs/migrating.md": None, "docs/from-ddp.md": None,
         "docs/keras.md": "## Process-level API"}
KINDS = ("program", "launch", "shell", "refused", "elsewhere", "not run")
# The few blocks not run, by page: each names why in its marker.
NOT_RUN = {"README.md": 1}
FENCE = re.compile(r"(?:<!-- doc-test: (?P<kind>.*?) -->\n)?^```(?P<lang>\S*)\n(?P<code>.*?)^```$",
                   flags=re.S | re.M)
ENV = {"DP_PLUGIN_TIMEOUT": "60"}


@dataclass(frozen=True)
class Block:
    page: str
    index: int
    kind: str       # the marker, "" where there is none
    lang: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}#{self.index}"


def blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text()
    stop = PAGES[page]
    if stop is not None:
        text = text.split(stop, 1)[0]
    return [Block(page, i, m["kind"] or "", m["lang"], m["code"])
            for i, m in enumerate(FENCE.finditer(text))]


ALL = [b for page in PAGES for b in blocks(page)]


def of_kind(kind: str) -> list[Block]:
    return [b for b in ALL if b.kind == kind]


def of_kind_prefix(prefix: str) -> list[Block]:
    return [b for b in ALL if b.kind.startswith(prefix)]


def test_every_block_says_how_it_is_run() -> None:
    unmarked = [b.id for b in ALL if not b.kind.startswith(KINDS)]
    assert not unmarked, (
        f"code blocks without a known <!-- doc-test: KIND --> line above them: {unmarked}; "
        f"kinds: {KINDS} (see this file's docstring)")


def test_the_blocks_not_run_stay_few() -> None:
    counts = {page: sum(b.kind.startswith("not run") for b in blocks(page)) for page in PAGES}
    assert counts == {page: NOT_RUN.get(page, 0) for page in PAGES}, counts
    for block in of_kind_prefix("not run"):
        assert re.fullmatch(r"not run \(.{20,}\)", block.kind), f"{block.id}: say why: {block.kind}"


@pytest.mark.parametrize("block", of_kind_prefix("elsewhere"), ids=lambda b: b.id)
def test_blocks_run_elsewhere_are_read_by_that_test(block: Block) -> None:
    test = ROOT / block.kind.split(" ", 1)[1]
    assert test.is_file(), f"{block.id}: {test} does not exist"
    assert Path(block.page).name in test.read_text(), f"{test} does not read {block.page}"


def _program(code: str, where: Path, name: str = "train.py") -> Path:
    script = where / name
    script.write_text(code)
    return script


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", of_kind("program"), ids=lambda b: b.id)
def test_program_runs_at_two_ranks(block: Block, tmp_path: Path) -> None:
    assert block.lang == "python", block.id
    fresh = "KERAS_BACKEND" in block.code
    result = run_workers("env", 2, _program(block.code, tmp_path), env=ENV, timeout=600,
                         fresh=fresh)
    assert result.returncodes == [0, 0], result.output


LAUNCH = {
    "torchrun": re.compile(r"torchrun --nproc_per_node (\d+) train\.py"),
    "horovodrun": re.compile(r"horovodrun -np (\d+) python train\.py"),
    "mpirun": re.compile(r"mpirun -n (\d+) python train\.py"),
}


def _launch_cases() -> list[tuple[Block, Block, str]]:
    cases = []
    for block in of_kind("launch"):
        program = [b for b in ALL if b.page == block.page and b.index < block.index
                   and b.kind == "program"][-1]
        cases += [(block, program, line) for line in block.code.splitlines() if line.strip()]
    return cases


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("block,program,line", _launch_cases(),
                         ids=lambda x: x.split()[0] if isinstance(x, str) else None)
def test_launch_line_runs_the_program_above_it(block: Block, program: Block, line: str,
                                               tmp_path: Path) -> None:
    launcher = line.split()[0]
    pattern = LAUNCH.get(launcher)
    match = pattern.fullmatch(line.strip()) if pattern else None
    assert match, (f"{block.id}: {line!r} is not a launch line this test knows; "
                   f"known forms: {[p.pattern for p in LAUNCH.values()]}")
    # The harness runs the same launcher with the same rank count, adding a
    # free port (torchrun) and the hosts (horovodrun) a test needs.
    result = run_workers(launcher, int(match[1]), _program(program.code, tmp_path), env=ENV,
                         timeout=600)
    assert all(c == 0 for c in result.returncodes), result.output
    for rank in range(int(match[1])):
        assert f"rank {rank} of {match[1]}" in result.output, result.output


def _shell_lines() -> list[tuple[Block, str]]:
    return [(b, line.split("#", 1)[0].strip()) for b in of_kind("shell")
            for line in b.code.splitlines() if line.split("#", 1)[0].strip()]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("block,line", _shell_lines(),
                         ids=lambda x: " ".join(x.split()[:2]) if isinstance(x, str) else None)
def test_shell_line_succeeds(block: Block, line: str, tmp_path: Path) -> None:
    argv = shlex.split(line)
    env = {**os.environ, "PATH": f"{BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=env)
    assert done.returncode == 0, f"{block.id}: {line}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"


@pytest.mark.parametrize("block", of_kind("refused"), ids=lambda b: b.id)
def test_refused_block_is_refused_by_keras(block: Block) -> None:
    prelude = ("import keras\n"
               "model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
               "opt = keras.optimizers.SGD(0.1)\n")
    done = subprocess.run([sys.executable, "-c", prelude + block.code], capture_output=True,
                          text=True, timeout=240, env={**os.environ, "KERAS_BACKEND": "torch"})
    assert done.returncode != 0, f"{block.id} ran, but the page says Keras 3 refuses it"
    assert "unexpected keyword argument 'experimental_run_tf_function'" in done.stderr, \
        done.stderr[-3000:]
