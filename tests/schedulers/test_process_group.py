"""Adopting a process group the program made itself, with no launcher variables.

``init_process_group("gloo", init_method="tcp://...")`` by hand, as a user
(or a library like Accelerate) does, then ``hvd.init()``: dp_plugin takes
rank, size and the local topology from the group, all-reduces in it, leaves
it initialized at ``shutdown()``, and the BERT example run inside it logs
the same losses as a torchrun-style run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multiproc.harness import free_port
from tests.schedulers import proc

WORKER = Path(__file__).resolve().parent / "workers" / "adopt.py"


def _run_ranks(world: int, args: list[str], timeout: float) -> tuple[list[int], str]:
    method = f"tcp://127.0.0.1:{free_port()}"
    env = proc.clean_env(DP_PLUGIN_TIMEOUT="60")
    assert not any(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")), "launcher variables"
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), method, *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=proc.ROOT, start_new_session=True)
             for r in range(world)]
    deadline = time.monotonic() + timeout
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            raise AssertionError(f"HANG: the ranks did not finish within {timeout:g} s") from None
        outputs.append(out)
    return [p.returncode for p in procs], "\n".join(outputs)


def test_hvd_init_adopts_the_programs_group_and_leaves_it() -> None:
    codes, out = _run_ranks(3, [], timeout=180)  # 3: an odd size catches pairing bugs
    assert codes == [0, 0, 0], out
    lines = re.findall(r"rank (\d) of (\d) local (\d)/(\d) cross (\d)/(\d) launcher (\S+) "
                       r"sum (\S+)", out)
    assert sorted(int(r[0]) for r in lines) == [0, 1, 2], out
    for rank, size, local, local_size, cross, cross_size, launcher, total in lines:
        assert (size, local, local_size) == ("3", rank, "3"), out  # one host
        assert (cross, cross_size, launcher, total) == ("0", "1", "process_group", "3"), out
    assert out.count("group kept after shutdown: True") == 3, out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_bert_example_in_an_adopted_group_trains_like_torchrun(
        bert_reference: tuple[dict[int, float], Path], tmp_path: Path) -> None:
    want, vocabulary = bert_reference
    codes, out = _run_ranks(2, [*proc.TINY, "--tokenizer", str(vocabulary),
                                "--output-dir", str(tmp_path)], timeout=600)
    assert codes == [0, 0], out
    assert out.count("group kept after the example: True") == 2, out
    proc.assert_same_losses(proc.losses(out), want, out)
