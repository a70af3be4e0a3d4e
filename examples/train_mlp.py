"""Data-parallel training of a small MLP classifier with dp_plugin's core.

The main job of the README: every worker holds a replica of the model, takes
its slice of each global batch, and averages gradients through dp_plugin's
GradientScheduler — fused buckets all-reduced while backward is still
running. The data set is generated here (a fixed random "teacher" network
labels Gaussian inputs), so nothing is downloaded.

Run (2 workers on this machine)::

    torchrun --nproc_per_node 2 examples/train_mlp.py
    mpiexec -n 2 python examples/train_mlp.py
    horovodrun --gloo -np 2 -H localhost:2 python examples/train_mlp.py

At the end every rank checks that its parameters are bitwise identical to
rank 0's, and rank 0 prints the held-out accuracy.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import dp_plugin
from dp_plugin.fusion import TensorSpec
from dp_plugin.scheduler import GradientScheduler


def make_data(n: int, dim: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels from a fixed random teacher MLP (same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(dim, 64, generator=g) / dim**0.5
    w2 = torch.randn(64, classes, generator=g) / 8.0
    x = torch.randn(n, dim, generator=g)
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return x, y


def build_model(dim: int, hidden: int, classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(dim, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def attach(model: nn.Module, sched: GradientScheduler) -> None:
    """Report each gradient to the scheduler as soon as backward has produced it."""
    for index, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(
            lambda param, index=index: sched.mark_ready(index, param.grad)
        )


def broadcast_parameters(model: nn.Module, engine: dp_plugin.engines.base.Engine) -> None:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            flat = p.data.view(-1)
            engine.broadcast(flat, root=0, name=f"param.{i}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--samples", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.05, help="per-worker LR, scaled by size")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(1)
    engine = dp_plugin.init()
    rank, size = engine.rank, engine.size
    if args.global_batch % size:
        raise SystemExit(
            f"--global-batch {args.global_batch} is not divisible by {size} workers; "
            f"pick a multiple of {size}"
        )

    x, y = make_data(args.samples + 2048, args.dim, args.classes, seed=1234)
    x_train, y_train, x_test, y_test = x[:-2048], y[:-2048], x[-2048:], y[-2048:]

    torch.manual_seed(args.seed + rank)  # different on purpose: broadcast fixes it
    model = build_model(args.dim, args.hidden, args.classes)
    broadcast_parameters(model, engine)

    specs = [TensorSpec.of(f"param.{i}", p) for i, p in enumerate(model.parameters())]
    sched = GradientScheduler(specs, engine=engine, op="average")
    attach(model, sched)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    per_worker = args.global_batch // size
    steps = args.samples // args.global_batch
    for epoch in range(args.epochs):
        order = torch.randperm(args.samples, generator=torch.Generator().manual_seed(epoch))
        t0, total = time.perf_counter(), 0.0
        for step in range(steps):
            batch = order[step * args.global_batch:(step + 1) * args.global_batch]
            mine = batch[rank * per_worker:(rank + 1) * per_worker]  # this worker's shard
            opt.zero_grad(set_to_none=False)
            loss = loss_fn(model(x_train[mine]), y_train[mine])
            loss.backward()
            sched.synchronize()
            opt.step()
            total += loss.item()
        mean = torch.tensor([total / steps], dtype=torch.float64)
        engine.allreduce_async(mean, "average", name="loss").wait()
        if rank == 0:
            stats = sched.stats.last
            print(
                f"epoch {epoch + 1}/{args.epochs}  loss {mean.item():.4f}  "
                f"{steps} steps in {time.perf_counter() - t0:.2f}s  "
                f"({len(sched.plan)} bucket(s), {stats.bytes_reduced / 2**20:.2f} MiB/step, "
                f"exposed comm {stats.exposed_s * 1e3:.2f} ms)",
                flush=True,
            )

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reference = flat.clone()
    engine.broadcast(reference, root=0, name="final-check")
    if not torch.equal(flat, reference):
        raise SystemExit(f"rank {rank}: parameters differ from rank 0's after training")
    with torch.no_grad():
        acc = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
    if rank == 0:
        print(f"workers {size}: parameters identical on all ranks; held-out accuracy {acc:.3f}")
    sched.close()
    dp_plugin.shutdown()


if __name__ == "__main__":
    main()
