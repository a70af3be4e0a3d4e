"""Worker: DistributedOptimizer with a ``torch.compile``d model, and with AMP.

Run under any launcher (see tests/multiproc/harness.py)::

    python torch_compile_amp.py --case compile [--backend aot_eager]  # "rank R OK"
    python torch_compile_amp.py --case amp                            # "rank R OK"

``compile``: every rank starts from other random weights, broadcasts rank
0's, compiles the model with ``torch.compile(model, backend=...)`` and
trains it for a few SGD-with-momentum steps on its shard of each global
batch, with ``DistributedOptimizer(named_parameters=compiled.named_parameters())``
(names carry the ``_orig_mod.`` prefix). At the end the parameters must be
bitwise identical on all ranks and within 1e-5 of an uncompiled
single-process run on the concatenated global batches.

``amp``: forward under ``torch.autocast('cpu', dtype=torch.bfloat16)`` and
``torch.amp.GradScaler('cpu')``, with Horovod's AMP pattern::

    scaler.scale(loss).backward()
    optimizer.synchronize()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    with optimizer.skip_synchronize():
        scaler.step(optimizer)
    scaler.update()

One step gets an infinite loss on the last rank only: the all-reduce makes
every rank's gradients non-finite, so every rank must skip that step and
halve its scale. Checked: parameters and scale bitwise identical on all
ranks after every step, the skipped step left parameters unchanged, and the
result close to a single-process AMP run on the global batches.

Any failure prints a traceback and exits 1 at once (``os._exit``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from _fail_fast import run_cases
from torch import nn

import dp_plugin.torch as hvd

STEPS = 4
PER_RANK = 4
IN, OUT = 8, 3
INF_STEP = 2
"""AMP: the step at which the last rank's loss is infinite."""


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, 16), nn.LayerNorm(16), nn.ReLU(),
        nn.Linear(16, OUT),
    )


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size * PER_RANK, IN, generator=g), torch.randn(size * PER_RANK, OUT,
                                                                      generator=g)


def shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * PER_RANK:(rank + 1) * PER_RANK]


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def check_identical_across_ranks(what: str, t: torch.Tensor) -> None:
    table = hvd.allgather_object(t.detach().clone())
    for r in range(1, len(table)):
        if not torch.equal(table[r], table[0]):
            diff = (table[r] - table[0]).abs().max().item()
            raise AssertionError(f"{what}: rank {r} differs from rank 0 (max |diff| {diff:.3g})")


def check_close(what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    err = (got - want).abs().max().item()
    if not err <= tol:
        raise AssertionError(f"{what}: max abs error {err:.3g} > {tol:g}")


def run_compile(backend: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    model = build_model(seed=100 + rank)  # different on purpose: broadcast fixes it
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=compiled.named_parameters())

    # The optimizer overlaps communication with backward through
    # post-accumulate-grad hooks; they must fire for a compiled model too
    # (otherwise step() would still reduce, but only after backward).
    fired: list[int] = []
    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: fired.append(i))
    n_params = len(list(model.parameters()))

    reference = build_model(seed=100)  # rank 0's initial weights, never compiled
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.MSELoss()
    for step in range(STEPS):
        x, y = global_batch(step, size)
        opt.zero_grad()
        fired.clear()
        loss_fn(compiled(shard(x, rank)), shard(y, rank)).backward()
        if sorted(fired) != list(range(n_params)):
            raise AssertionError(f"step {step}: gradient hooks fired for {sorted(fired)}, "
                                 f"expected every one of {n_params} parameters once")
        opt.step()
        ref_opt.zero_grad()
        loss_fn(reference(x), y).backward()  # mean over the global batch = average of shards
        ref_opt.step()
    check_identical_across_ranks("compiled model parameters", flat_params(model))
    check_close("compiled model vs single-process reference", flat_params(model),
                flat_params(reference), 1e-5)


def amp_step(model: nn.Module, opt: Any, scaler: Any, x: torch.Tensor, y: torch.Tensor,
             loss_scale: float, synchronize: Callable[[], None]) -> None:
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x).float(), y) * loss_scale
    scaler.scale(loss).backward()
    synchronize()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    if hasattr(opt, "skip_synchronize"):
        with opt.skip_synchronize():
            scaler.step(opt)
    else:
        scaler.step(opt)
    scaler.update()


def run_amp() -> None:
    rank, size = hvd.rank(), hvd.size()
    model = build_model(seed=100 + rank)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

    reference = build_model(seed=100)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(STEPS):
        x, y = global_batch(step, size)
        inf = step == INF_STEP
        before = flat_params(model)
        scale = float("inf") if inf and rank == size - 1 else 1.0
        amp_step(model, opt, scaler, shard(x, rank), shard(y, rank), scale, opt.synchronize)
        amp_step(reference, ref_opt, ref_scaler, x, y, float("inf") if inf else 1.0,
                 lambda: None)
        check_identical_across_ranks(f"AMP parameters after step {step}", flat_params(model))
        check_identical_across_ranks(f"AMP scale after step {step}", scaler.get_scale() *
                                     torch.ones(1))
        if inf:
            if not torch.equal(flat_params(model), before):
                raise AssertionError("a step with non-finite gradients changed the parameters")
            if scaler.get_scale() != 2.0**9:
                raise AssertionError(f"scale after the skipped step is {scaler.get_scale()}, "
                                     "expected 512 (halved)")
    if scaler.get_scale() != ref_scaler.get_scale():
        raise AssertionError(f"scale {scaler.get_scale()} != reference {ref_scaler.get_scale()}")
    # bfloat16 matmuls over a shard and over the global batch may round
    # differently; the tolerance is bfloat16's, not float32's.
    check_close("AMP model vs single-process AMP reference", flat_params(model),
                flat_params(reference), 2e-2)


CASES = {
    "compile": lambda args: run_compile(args.backend),
    "amp": lambda args: run_amp(),
}


def start(args: argparse.Namespace) -> argparse.Namespace:
    torch.set_num_threads(1)
    hvd.init()
    return args


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="aot_eager", help="torch.compile backend")
    run_cases(CASES, parser=parser, setup=start, teardown=lambda _: hvd.shutdown())
