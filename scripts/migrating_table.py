"""Write docs/migrating.md: every public name of Horovod 0.28.1's modules, and dp_plugin's answer.

    python scripts/migrating_table.py            # regenerate docs/migrating.md
    python scripts/migrating_table.py --check    # fail if the committed file is stale

For each pair (``horovod.torch`` / ``dp_plugin.torch``, ``horovod.tensorflow``
/ ``dp_plugin.tensorflow``, ``horovod.tensorflow.keras`` / ``dp_plugin.keras``)
the public names of the Horovod module are the names its ``__init__.py``
binds at top level (``def``, ``class``, assignments and ``from horovod... import``),
minus private ones and Horovod's internal utilities (``horovod.common.util``).
They are read with ``ast`` from the installed source, and the module is also
imported when it can be (under Keras 3 some cannot; the page says which).

Each name is *supported* when the dp_plugin module has it, *supported with a
difference* when ``NOTES`` says so, and *not supported* only with a reason in
``NOTES``. A Horovod name that dp_plugin lacks and ``NOTES`` does not explain
is an error: the script fails, so the page cannot silently go stale.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "migrating.md"

PAIRS = [
    ("horovod.torch", "dp_plugin.torch"),
    ("horovod.tensorflow", "dp_plugin.tensorflow"),
    ("horovod.tensorflow.keras", "dp_plugin.keras"),
    ("horovod.torch.elastic", "dp_plugin.torch.elastic"),
    ("horovod.tensorflow.elastic", "dp_plugin.tensorflow.elastic"),
    ("horovod.tensorflow.keras.elastic", "dp_plugin.keras.elastic"),
]

# Horovod helpers that its modules import for their own use, not API.
INTERNAL_SOURCES = ("horovod.common.util",)

DIFF, UNSUPPORTED = "difference", "unsupported"

# name (any module) or "module:name" (one module) -> (kind, text). Keep each
# text one sentence: what differs (or why it is missing) and what to do.
NOTES: dict[str, tuple[str, str]] = {
    "elastic": (UNSUPPORTED, "elastic training (hosts joining and leaving a running job) is "
                "out of scope; restart the job with the new size and resume from a checkpoint "
                "(`save_checkpoint`/`load_checkpoint`)"),
    "horovod.torch:elastic": (DIFF, "recovers by restarting processes under `torchrun "
                              "--max-restarts` (commits go to `commit_path` on disk), not by "
                              "re-forming the surviving workers in place; horovodrun's elastic "
                              "mode is refused (see docs/elastic.md)"),
    "horovod.torch.elastic:run": (DIFF, "a failure ends the process and the launcher "
                                  "(`torchrun --max-restarts`) restarts every worker; each "
                                  "start resumes from the last commit on disk"),
    "horovod.torch.elastic:TorchState": (DIFF, "takes `commit_path=` (optional: under "
                                         "torchrun commits default to a private file in the "
                                         "temp dir); also tracks LR schedulers "
                                         "and anything with `state_dict`, and every rank's RNG "
                                         "states"),
    "horovod.torch.elastic:run_fn": (UNSUPPORTED, "Horovod's internal retry loop behind `run`; "
                                     "use `run`"),
    "Adasum": (DIFF, "accepted as a name, but `op=Adasum` raises `NotImplementedError`; use "
               "`op=Average`"),
    "HorovodInternalError": (DIFF, "is dp_plugin's base error `DPPluginError`: every error "
                             "dp_plugin raises on purpose is one"),
    "Compression": (DIFF, "adds `Compression.bf16`; on `DistributedOptimizer` a compressor "
                    "sees a whole fusion bucket (1-D, several gradients) instead of each "
                    "gradient"),
    "DistributedOptimizer": (DIFF, "`op=Adasum` is not supported"),
    "horovod.torch:join": (DIFF, "Horovod 0.28.1's rule: answers `DistributedOptimizer` "
                           "steps, allreduce and barrier (grouped too); allgather, broadcast, "
                           "reducescatter, alltoall and the helpers built on them "
                           "(`broadcast_parameters`, `broadcast_object`, `SyncBatchNorm`) "
                           "raise on the ranks that call them, as dp_plugin's "
                           "`JoinedRankError` naming the joined ranks; returns the rank that "
                           "joined last"),
    "join": (DIFF, "a synchronization point that returns the rank that called it last; a "
             "joined rank does not answer the other ranks' collectives meanwhile (TensorFlow "
             "collectives run without the agreement step a joined rank listens to)"),
    "synchronize": (DIFF, "an unknown or already-synchronized handle raises `ValueError` "
                    "(Horovod returns None)"),
    "horovod.torch:broadcast_optimizer_state": (
        DIFF, "also works for LBFGS and optimizers whose state is created lazily, without "
        "Horovod's zero-gradient dummy step (the zero `.grad` that step leaves on a fresh "
        "optimizer's parameters is kept)"),
    "mpi_threads_supported": (DIFF, "answers for dp_plugin's MPI engine (mpi4py's thread "
                              "level), False without it"),
    "horovod.tensorflow:LocalGradientAggregationHelper": (
        UNSUPPORTED, "an internal class of Horovod's TF1 optimizer; use "
        "`backward_passes_per_step` of `DistributedOptimizer`/`DistributedGradientTape`"),
    "horovod.tensorflow:handle_average_backwards_compatibility": (
        UNSUPPORTED, "an internal helper of Horovod's `average=` deprecation; pass `op=`"),
    "horovod.tensorflow:check_num_rank_power_of_2": (
        UNSUPPORTED, "an Adasum helper, and Adasum is not supported"),
    "horovod.tensorflow:elastic": (DIFF, "recovers by restarting processes under `torchrun "
                                   "--max-restarts` (commits go to `commit_path` on disk), as "
                                   "`dp_plugin.torch.elastic` (see docs/elastic.md)"),
    "horovod.tensorflow.keras:elastic": (DIFF, "as `dp_plugin.tensorflow.elastic`: restarts "
                                         "under `torchrun --max-restarts`, commits on disk"),
    "horovod.tensorflow.elastic:run": (DIFF, "a failure ends the process and the launcher "
                                       "(`torchrun --max-restarts`) restarts every worker; each "
                                       "start resumes from the last commit on disk"),
    "horovod.tensorflow.elastic:TensorFlowKerasState": (
        DIFF, "takes `commit_path=` (required under `torchrun --max-restarts`); tracks the "
        "model's weights, the optimizer's variables and each rank's `random`/numpy states"),
    "horovod.tensorflow.elastic:TensorFlowState": (
        DIFF, "takes `commit_path=`; `session=` (TF1) is refused: pass TF2 variables"),
    "horovod.tensorflow.keras.elastic:KerasState": (
        DIFF, "is `TensorFlowKerasState`: takes `commit_path=` (required under `torchrun "
        "--max-restarts`)"),
    "horovod.tensorflow.elastic:run_fn": (UNSUPPORTED, "Horovod's internal retry loop behind "
                                          "`run`; use `run`"),
    "horovod.tensorflow.keras.elastic:run_fn": (UNSUPPORTED, "Horovod's internal retry loop "
                                                "behind `run`; use `run`"),
}

PROSE = """\
# Coming from Horovod

dp_plugin keeps Horovod 0.28.1's Python API: change the import and keep the
script.

| Horovod | dp_plugin |
|---|---|
| `import horovod.torch as hvd` | `import dp_plugin.torch as hvd` |
| `import horovod.tensorflow as hvd` | `import dp_plugin.tensorflow as hvd` |
| `import horovod.tensorflow.keras as hvd` | `import dp_plugin.keras as hvd` |

`from horovod.torch.compression import Compressor` becomes
`from dp_plugin.torch.compression import Compressor`.
Launch as before (`horovodrun`, `mpirun`, `torchrun`, `srun`). Horovod itself
is needed only for the `horovod` engine and for `horovodrun`; the gloo, nccl
and mpi engines run without it (see [horovod-build.md](horovod-build.md)).

## The one change Keras 3 forces

Horovod's Keras guide told every user to write

<!-- doc-test: refused -->
```python
model.compile(optimizer=opt, loss=..., experimental_run_tf_function=False)
```

Keras 3 (TensorFlow >= 2.16) removed that argument and `compile()` rejects
it. Delete it: `model.compile(optimizer=opt, loss=...)`. dp_plugin's
`DistributedOptimizer` works inside Keras 3's compiled train step, so
nothing replaces it. Likewise `opt.variables` is a property in Keras 3, not a
method: `opt.variables()` becomes `opt.variables`.

## What runs under `horovodrun`

A Horovod script launched by `horovodrun` as before does not run Horovod's
ring by default. On CPUs `auto` runs dp_plugin's `gloo` engine through
horovodrun's rendezvous (shared memory on one host, the hierarchical path
on several), measured faster than Horovod's ring
([BENCHMARKS.md](../BENCHMARKS.md#under-horovodrun)), and Horovod's library
is never loaded. On GPUs, where Horovod is built with NCCL, `auto` keeps
Horovod's own NCCL path; elsewhere it runs `nccl`. Every Horovod call
answers the same on either engine.

To get Horovod's ring back: `DP_PLUGIN_ENGINE=horovod horovodrun -np 2
python train.py`. Where a rank cannot run it, every rank stops at
`hvd.init()` with `EngineUnavailableError` naming that rank and the fix.
Rank 0 logs the engine chosen and why at `init()`.

## Remaining differences, and why

- **Errors at the call, on every rank.** Every tensor collective first checks
  that the ranks agree (names, shapes, dtypes, ops, roots); a mismatch raises
  the same error on every rank at the call, where Horovod raises at
  `synchronize` or stalls. Why: a mistake must never hang a job.
- **`synchronize(handle)` twice raises** `ValueError` (Horovod returns None):
  a second wait on the same handle is always a bug.
- **Names are released at `synchronize`**, not when the background thread
  finishes: program order, so every rank agrees on which names are in flight.
- **Compressors on `DistributedOptimizer` see fusion buckets.** A
  Horovod-style `Compressor` subclass works on both `hvd.allreduce` (per
  tensor, as Horovod) and `DistributedOptimizer`, where it receives the packed
  1-D buffer of several gradients: gradients are fused before they travel.
  Element-wise compressors (casts, quantisation) behave the same.
- **`groups` / `num_groups` of `DistributedOptimizer` (and TensorFlow's
  `DistributedGradientTape`, by keyword) make one bucket per group**, as
  Horovod's grouped all-reduce: `groups=N` cuts the parameters
  (variables), in order, into N groups of near-equal count; listed groups are
  fused as given, the parameters in none into buckets of
  `DP_PLUGIN_FUSION_THRESHOLD` bytes. A group is reduced once all of its
  gradients are ready; the results are those of the run without groups.
- **Adasum is not supported** (`op=Adasum` raises `NotImplementedError`): use
  `op=Average`, which converges the same for synchronous SGD.
- **`join()`** (PyTorch) follows Horovod 0.28.1: a joined rank answers the
  others' optimizer steps, `allreduce` (grouped too) and `barrier`;
  `allgather`, `broadcast`, `reducescatter`, `alltoall` and the helpers built
  on them (`broadcast_parameters`, `broadcast_object`, `SyncBatchNorm`) raise
  `JoinedRankError` on the ranks that call them, and those ranks call
  `join()` next, so a script written for Horovod behaves the same.
  `join()` returns the rank that joined last. In `dp_plugin.tensorflow` / `dp_plugin.keras`,
  `join()` is a synchronization point only: every rank must run the same
  collectives before joining.
- **`horovod.torch.elastic` restarts processes.** `hvd.elastic.TorchState`,
  `ElasticSampler` and `@hvd.elastic.run` keep Horovod's API, but recovery is
  torchrun's `--max-restarts`: every commit is also written to disk and each
  restart resumes from it (see [elastic.md](elastic.md)); horovodrun's elastic
  mode is refused. `horovod.tensorflow.elastic` and `horovod.tensorflow.keras.elastic`
  (`TensorFlowKerasState`, `KerasState`, `run`, the commit/batch/epoch
  callbacks) work the same way in `dp_plugin.tensorflow.elastic` /
  `dp_plugin.keras.elastic`.
- **TensorFlow graphs run dp_plugin's ops in the order they were built.** In
  a TF1 graph or a `tf.function`, each dp_plugin collective op has a control
  dependency on the previous one built in the same graph, so every rank runs
  them in the same order (Horovod matches them by name in a background
  thread instead). Consequence: fetching a collective in `Session.run` also
  runs the dp_plugin collectives built before it in that graph.
  `broadcast_global_variables` (and `BroadcastGlobalVariablesHook`) starts a
  new chain, so it runs alone without the training step; do not fetch it in
  the same `Session.run` as collectives built before it. A collective inside
  `tf.compat.v1.cond`/`while_loop` of a TF1 graph (which Horovod allows) is
  refused with `ValueError` when built: reduce before the construct, or
  build the step in a `tf.function`.
- **TensorFlow errors come at the call, on every rank, with Horovod's types,
  eagerly and inside graphs**: ranks that disagree raise
  `tf.errors.FailedPreconditionError`, a bad argument
  `tf.errors.InvalidArgumentError`, with dp_plugin's message. Inside graphs
  this needs a small TensorFlow kernel compiled on first use (about 10 s,
  cached in `~/.cache/dp_plugin/tf_ops`); without a C++ compiler a
  `RuntimeWarning` says so and graphs raise TensorFlow's own types.
- **`broadcast_optimizer_state`** sends the root's whole state (tensors fused
  as raw bytes, the rest pickled) and loads it on the others, so it needs no
  dummy step and works for every `torch.optim` optimizer, LBFGS included
  (Horovod refuses LBFGS).
- **`DistributedOptimizer` without `named_parameters`** names parameters
  `allreduce.noname.<group>.<index>`, as Horovod, and exposes them in
  `optimizer._parameter_names`.
- **Sparse gradients of the PyTorch `DistributedOptimizer` are decided at the
  wrap**, as DDP decides them: the weights of `nn.Embedding`/`nn.EmbeddingBag`
  with `sparse=True` are reduced as Horovod reduces sparse gradients
  (all-gather, then divide by the size), also in a step where their gradient
  is dense (it comes back dense). A sparse gradient of any other parameter
  raises on every rank at `synchronize()` (Horovod decides per step): pass
  `sparse_as_dense=True`. A non-Sum/Average `op` with sparse tables is refused
  at the wrap, not at the first step.
- **Process sets** can be added after `init()` without
  `hvd.init(process_sets="dynamic")` on the gloo, nccl and mpi engines (the
  horovod engine needs it, as Horovod does); sets built from an mpi4py
  communicator are not supported (pass the ranks).
- **`SyncBatchNorm`** also runs on CPU tensors and tolerates empty shards.
  TensorFlow's `SyncBatchNormalization` takes the Keras 2 arguments
  Horovod's layer took and Keras 3 removed: `fused=False` (Horovod's default,
  what Keras 3 computes; `fused=True`/`None` raise Horovod's `ValueError`),
  and `virtual_batch_size` / `adjustment`, which are ignored with one
  `UserWarning` per process (Keras 3 has no ghost batches).
- **Build flags** (`nccl_built()`, `mpi_enabled()` ...) answer for
  dp_plugin's engines, not for a Horovod build.
"""


def public_names(module: str) -> list[str]:
    """Sorted public names of a Horovod module, read from its source."""
    # Located without importing it: a parent package may not import (Keras 3).
    top = importlib.util.find_spec("horovod")
    if top is None or top.origin is None:
        raise SystemExit("horovod is not installed; run `make install` first")
    source = Path(top.origin).parent.joinpath(*module.split(".")[1:], "__init__.py")
    if not source.exists():  # a module file, not a package (horovod.tensorflow.elastic)
        source = source.parent.with_suffix(".py")
    tree = ast.parse(source.read_text(), filename=str(source))
    names: set[str] = set()
    for node in _top_level(tree.body):
        if isinstance(node, ast.ImportFrom):
            source = "." * node.level + (node.module or "")
            if source.startswith("horovod") and not source.startswith(INTERNAL_SOURCES):
                names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return sorted(n for n in names if not n.startswith("_"))


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements of the module body, with those inside top-level if/try blocks."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            out += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += _top_level(node.body) + _top_level(node.orelse)
            for handler in node.handlers:
                out += _top_level(handler.body)
        else:
            out.append(node)
    return out


def note_for(module: str, name: str) -> tuple[str, str] | None:
    return NOTES.get(f"{module}:{name}") or NOTES.get(name)


def table(horovod: str, ours: str, problems: list[str]) -> str:
    names = public_names(horovod)
    dp = importlib.import_module(ours)
    lines = [f"## `{horovod}` -> `{ours}`", "",
             f"{len(names)} public names of `{horovod}`.", "",
             "| Name | dp_plugin |", "|---|---|"]
    for name in names:
        note = note_for(horovod, name)
        if hasattr(dp, name):
            if note is not None and note[0] == UNSUPPORTED:
                problems.append(f"{ours}.{name} exists, but NOTES calls it unsupported")
            cell = "supported" if note is None else f"supported; difference: {note[1]}"
        elif note is not None and note[0] == UNSUPPORTED:
            cell = f"**not supported**: {note[1]}"
        else:
            problems.append(f"{horovod}.{name} is neither in {ours} nor explained in NOTES")
            continue
        lines.append(f"| `{name}` | {cell} |")
    return "\n".join(lines) + "\n"


def render() -> str:
    problems: list[str] = []
    sys.path.insert(0, str(ROOT))
    parts = [PROSE, "# Every public name\n",
             "Generated by `scripts/migrating_table.py` from the installed Horovod 0.28.1 "
             "and dp_plugin; do not edit by hand (a test fails when it is stale).\n"]
    parts += [table(horovod, ours, problems) for horovod, ours in PAIRS]
    if problems:
        raise SystemExit("migrating_table: the page would not be true:\n  " + "\n  ".join(problems)
                         + "\nadd the names to dp_plugin or explain them in NOTES")
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with docs/migrating.md instead of writing it")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run python scripts/migrating_table.py",
                  file=sys.stderr)
            return 1
        print(f"{DOC.relative_to(ROOT)} is up to date")
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
