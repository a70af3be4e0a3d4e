"""Driver of the Ray tests: runs inside the Ray head's host (RAY_ADDRESS set).

    python ray_driver.py VOCAB OUTDIR [PART...]

One driver, one Ray session, the parts in this order (default: all):

- ``executor``: RayExecutor: API calls, then BERT;
- ``trainer``: Ray Train's TorchTrainer: BERT;
- ``kill``: RayExecutor, rank 1 SIGKILLed mid-run;
- ``train_v2``: the three Ray Train v2 fits of workers/ray_train_v2.py
  (dp_plugin's backend, DDP, the killed and resumed fit).

Each worker of ``executor`` and ``trainer`` runs the BERT example
(examples/bert_pretrain.py, the flags of tests/schedulers/proc.TINY) with its
stdout captured and returned, so the losses reach the driver whole; the
driver prints them with each worker's node address.

A part's output starts with the line ``=== PART`` and ends with ``=== PART
ok``, or with its traceback and ``=== PART failed``; the next part runs
either way, and the driver exits 1 if any part failed. The parts share one
driver because each driver costs an interpreter, ``import ray`` and torch,
and a Ray job of its own, several seconds each time on two cores.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import ray

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from tests.schedulers.proc import BERT, TINY  # noqa: E402


def bert(args: list[str]) -> tuple[str, str]:
    """Run the example in this process; (this node's address, its stdout)."""
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [str(BERT), *args]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(BERT), run_name="__main__")
    finally:
        sys.argv = argv
    return ray.util.get_node_ip_address(), out.getvalue()


class Tag:
    """An executable_cls for execute()/execute_single()."""

    def __init__(self, word: str) -> None:
        self.word = word


def where(_: Any) -> tuple[str, str, str]:
    return ray.util.get_node_ip_address(), os.environ["RANK"], os.environ["LOCAL_RANK"]


def allreduce_ranks(scale: float = 1.0) -> float:
    import torch

    import dp_plugin.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="ranks").item()
    hvd.shutdown()
    return total * scale


def executor(vocab: str, outdir: Path) -> None:
    from dp_plugin.ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=60)
    ex = RayExecutor(settings, num_hosts=2, num_workers_per_host=1, cpus_per_worker=1)
    ex.start(executable_cls=Tag, executable_args=["hi"])
    try:
        print("where", ex.execute(where), flush=True)
        print("execute", ex.execute(lambda t: t.word), flush=True)
        print("execute_single", ex.execute_single(lambda t: t.word + "!"), flush=True)
        print("run", ex.run(allreduce_ranks, kwargs={"scale": 10.0}), flush=True)
        args = [*TINY, "--tokenizer", vocab, "--output-dir", str(outdir)]
        for node, text in ex.run(bert, args=[args]):
            print(f"--- worker on {node}\n{text}", flush=True)
    finally:
        ex.shutdown()


def trainer(vocab: str, outdir: Path) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    args = [*TINY, "--tokenizer", vocab, "--output-dir", str(outdir)]
    logs = outdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def loop(config: dict[str, Any]) -> None:
        node, text = bert(config["args"])
        rank = os.environ.get("RANK", "?")
        (Path(config["logs"]) / f"rank{rank}.txt").write_text(f"--- worker on {node}\n{text}")

    result = TorchTrainer(
        loop, train_loop_config={"args": args, "logs": str(logs)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                     resources_per_worker={"CPU": 1},
                                     placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(storage_path=str(outdir / "ray_results"), name="bert"),
    ).fit()
    print("trainer error:", result.error, flush=True)
    for f in sorted(logs.glob("rank*.txt")):
        print(f.read_text(), flush=True)


def die_at_step_two() -> None:
    import torch

    import dp_plugin.torch as hvd

    hvd.init()
    for step in range(20):
        if step == 2 and hvd.rank() == 1:
            print("rank 1 FAULT", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.allreduce(torch.ones(4), name=f"step{step}")
    hvd.shutdown()


def kill(_vocab: str, _outdir: Path) -> None:
    from dp_plugin.errors import DPPluginError
    from dp_plugin.ray import RayExecutor

    ex = RayExecutor(RayExecutor.create_settings(timeout_s=4), num_hosts=2,
                     num_workers_per_host=1)
    ex.start()
    try:
        ex.run(die_at_step_two)
    except DPPluginError as exc:
        notes = "\n".join(getattr(exc, "__notes__", []))
        print(f"raised {type(exc).__name__}: {exc}\nnotes: {notes}", flush=True)
    else:
        print("run returned although rank 1 died", flush=True)
        sys.exit(1)
    finally:
        ex.shutdown()


def train_v2(_vocab: str, outdir: Path) -> None:
    import ray_train_v2  # beside this script, on the workers' path too (Ray adds it)

    ray_train_v2.main(outdir, list(ray_train_v2.KINDS))


PARTS = {"executor": executor, "trainer": trainer, "kill": kill, "train_v2": train_v2}


def main(vocab: str, outdir: Path, parts: list[str]) -> int:
    failed = []
    for name in parts:
        print(f"=== {name}", flush=True)
        where = outdir / name
        where.mkdir(parents=True, exist_ok=True)
        try:
            PARTS[name](vocab, where)
        except BaseException:  # a part's failure is reported, and the next part runs
            traceback.print_exc(file=sys.stdout)
            print(f"=== {name} failed", flush=True)
            failed.append(name)
        else:
            print(f"=== {name} ok", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    ray.init(logging_level="ERROR")
    chosen = [a for a in sys.argv[3:] if a in PARTS] or list(PARTS)
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), chosen))
