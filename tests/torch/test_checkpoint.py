"""dp_plugin.torch.save_checkpoint / load_checkpoint in one process.

Refusals (truncated, corrupted, foreign, missing, other version) and
atomicity: a writer killed in the middle of a save leaves the previous
checkpoint loadable. The multi-rank path (RNG states per rank, rank 0 reads
and broadcasts) is exercised by the BERT example's resume test.
"""

from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import dp_plugin.torch as hvd
from dp_plugin.torch import checkpoint


def _state(value: float) -> dict[str, object]:
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(value)
    return {"model": model.state_dict(), "step": int(value)}


def test_round_trip_restores_state_and_every_rng(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "ckpt.pt"
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    hvd.save_checkpoint(path, **_state(7.0))
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    state = hvd.load_checkpoint(path)
    assert state["step"] == 7 and torch.equal(state["model"]["weight"], torch.full((2, 3), 7.0))
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2]
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]  # no temporary left


def test_restore_rng_false_leaves_generators_alone(tmp_path: Path) -> None:
    hvd.save_checkpoint(tmp_path / "c.pt", step=1)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    hvd.load_checkpoint(tmp_path / "c.pt", restore_rng=False)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign", "torch_save", "version",
                                    "empty"])
def test_damaged_or_foreign_files_are_refused(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "ckpt.pt"
    hvd.save_checkpoint(path, **_state(1.0))
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(raw[:-10])
        match = "truncated"
    elif damage == "flip":
        raw[-5] ^= 0xFF
        path.write_bytes(raw)
        match = "checksum"
    elif damage == "foreign":
        path.write_text("not a checkpoint at all, just some text that is long enough")
        match = "not a dp_plugin checkpoint"
    elif damage == "torch_save":
        torch.save(_state(1.0), path)
        match = "not a dp_plugin checkpoint"
    elif damage == "version":
        raw[6] = 99
        path.write_bytes(raw)
        match = "format version 99"
    else:
        path.write_bytes(b"")
        match = "not a dp_plugin checkpoint"
    with pytest.raises(hvd.CheckpointError, match=match):
        hvd.load_checkpoint(path)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(hvd.CheckpointError, match="does not exist"):
        hvd.load_checkpoint(tmp_path / "nope.pt")


def test_a_writer_killed_during_the_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """A child process saves checkpoint 1, then starts checkpoint 2 and is
    SIGKILLed after half of its bytes reached the temporary file."""
    path = tmp_path / "ckpt.pt"
    script = textwrap.dedent(f"""
        import os, signal
        import torch
        import dp_plugin.torch as hvd
        from dp_plugin.torch import checkpoint

        hvd.save_checkpoint({str(path)!r}, weights=torch.ones(1000), step=1)
        real_fdopen = os.fdopen

        class Dying:
            def __init__(self, f):
                self.f = f
            def __enter__(self):
                return self
            def __exit__(self, *exc):
                return False
            def write(self, data):
                if len(data) < 100:  # the header: let it through
                    return self.f.write(data)
                self.f.write(data[: len(data) // 2])
                self.f.flush()
                os.kill(os.getpid(), signal.SIGKILL)

        checkpoint.os.fdopen = lambda fd, mode: Dying(real_fdopen(fd, mode))
        hvd.save_checkpoint({str(path)!r}, weights=torch.zeros(1000), step=2)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ckpt.pt"]
    assert leftovers and all(n.startswith(".ckpt.pt.") for n in leftovers), leftovers
    state = hvd.load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["weights"], torch.ones(1000))
    # A half-written temporary is refused too, if someone tries it.
    with pytest.raises(hvd.CheckpointError):
        checkpoint.read_verified(tmp_path / leftovers[0])


def test_numpy_scalars_and_arrays_load_back(tmp_path: Path) -> None:
    """What a save accepts, a load reads: ``np.float64(0.91)`` (a metric kept
    with numpy) failed every later load with ``Weights only load failed``."""
    path = tmp_path / "c.pt"
    hvd.save_checkpoint(path, best_acc=np.float64(0.91), epoch=np.int64(3),
                        flags=np.array([True, False]), hist=np.arange(4.0, dtype=np.float32))
    state = hvd.load_checkpoint(path)
    assert type(state["best_acc"]) is np.float64 and state["best_acc"] == 0.91
    assert type(state["epoch"]) is np.int64 and state["epoch"] == 3
    assert state["flags"].tolist() == [True, False]
    assert state["hist"].dtype == np.float32 and state["hist"].tolist() == [0.0, 1.0, 2.0, 3.0]


class _Opaque:
    """A class torch.load(weights_only=True) does not rebuild."""


def test_a_value_that_would_not_load_is_refused_at_save_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    hvd.save_checkpoint(path, step=1)
    with pytest.raises(hvd.CheckpointError, match=r"\['extra'\]\['opaque'\] = "
                                                  r".*_Opaque.*nothing was written.*float\(x\)"):
        hvd.save_checkpoint(path, step=2, extra={"fine": 1.0, "opaque": _Opaque()})
    with pytest.raises(hvd.CheckpointError, match=r"\['objs'\] = array\(\[1, 'x'\]"):
        hvd.save_checkpoint(path, step=3, objs=np.array([1, "x"], dtype=object))
    assert hvd.load_checkpoint(path)["step"] == 1  # the previous checkpoint is intact
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_the_file_mode_follows_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    old = os.umask(umask)
    try:
        hvd.save_checkpoint(tmp_path / "c.pt", step=1)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "c.pt").stat().st_mode) == mode


def test_an_unwritable_path_is_a_checkpoint_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(hvd.CheckpointError, match=r"rank 0 could not write the checkpoint .*"
                                                  r"NotADirectoryError|FileExistsError"):
        hvd.save_checkpoint(blocker / "sub" / "c.pt", step=1)
