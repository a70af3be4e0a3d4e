"""A recommender on sharded data: sparse embeddings + MLP, data parallel with dp_plugin.

Data: generated user-item interactions (users and items have hidden taste
vectors, items a long-tailed popularity; each user picks items with a
probability growing with taste match and popularity). They are written to
disk as one shard file per worker, ``interactions-RRRRR-of-NNNNN.npz``,
users split by ``user % workers``; each worker reads only its own shard.
Each user's last interaction is held out.

Model: NCF-style, a user and an item ``nn.Embedding(sparse=True)`` table and
an MLP over ``[u, v, u*v]``, trained with binary cross-entropy on the
interactions and ``--negatives`` random items per interaction, by Adagrad
(which takes sparse gradients). The embedding gradients are sparse:
``hvd.DistributedOptimizer(..., sparse_as_dense=False)`` (the default)
reduces them as Horovod does, by all-gathering their indices and values;
``--sparse-as-dense`` reduces them as dense tensors instead; both give the
same model within float rounding.

Evaluation: hit-rate@10 of the held-out item among all items the user has
not interacted with, against a popularity baseline (the 10 most popular such
items), each worker scoring its own users, summed with ``hvd.allreduce``.

    torchrun --nproc_per_node 2 examples/recommender.py
    python examples/recommender.py --prepare --workers 4   # only write 4 shards
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Embedding + MLP recommender trained on per-worker shard files, with "
                    "sparse gradient reduction (dp_plugin).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = ap.add_argument_group("data")
    g.add_argument("--data-dir", type=Path, default=Path("runs/recommender/data"),
                   help="where the shard files are (generated there if missing)")
    g.add_argument("--users", type=int, default=3000, help="users to generate")
    g.add_argument("--items", type=int, default=500, help="items to generate")
    g.add_argument("--per-user", type=int, default=20, help="interactions per user")
    g.add_argument("--prepare", action="store_true",
                   help="only write the shards (for --workers workers) and exit")
    g.add_argument("--workers", type=int, default=0, help="shards to write with --prepare")
    g = ap.add_argument_group("model and training")
    g.add_argument("--dim", type=int, default=32, help="embedding size")
    g.add_argument("--hidden", type=int, default=64, help="MLP hidden size")
    g.add_argument("--epochs", type=int, default=8, help="passes over each shard")
    g.add_argument("--batch", type=int, default=256, help="interactions per step per worker")
    g.add_argument("--negatives", type=int, default=4, help="random items per interaction")
    g.add_argument("--lr", type=float, default=0.1, help="Adagrad learning rate")
    g.add_argument("--sparse-as-dense", action="store_true",
                   help="reduce the embedding gradients as dense tensors")
    g.add_argument("--seed", type=int, default=0, help="data generation and training seed")
    g.add_argument("--threads", type=int, default=0,
                   help="torch threads per worker; 0 means cores / local workers")
    args = ap.parse_args(argv)
    for name in ("users", "items", "per_user", "dim", "hidden", "epochs", "batch"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if args.per_user < 2 or args.per_user >= args.items:
        ap.error("--per-user must be >= 2 and below --items")
    if args.prepare and args.workers <= 0:
        ap.error("--prepare needs --workers N (the number of shards to write)")
    return args


# -- data -----------------------------------------------------------------------------

def shard_path(data_dir: Path, rank: int, size: int) -> Path:
    return data_dir / f"interactions-{rank:05d}-of-{size:05d}.npz"


def generate(users: int, items: int, per_user: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Interactions as (users, per_user) item ids, in the order they happened."""
    rng = np.random.default_rng(seed)
    taste_u = rng.normal(size=(users, 8))
    taste_i = rng.normal(size=(items, 8))
    popularity = -0.7 * np.log(np.arange(1, items + 1))  # Zipf-like, shuffled over ids
    popularity = popularity[rng.permutation(items)]
    logits = 2.5 * taste_u @ taste_i.T / np.sqrt(8) + popularity
    # Gumbel top-k: a sample without replacement, proportional to exp(logits).
    picks = np.argsort(-(logits + rng.gumbel(size=logits.shape)), axis=1)[:, :per_user]
    order = rng.permuted(picks, axis=1)  # the time order of a user's interactions
    return np.arange(users), order


def prepare(data_dir: Path, size: int, args: argparse.Namespace) -> None:
    """Write ``size`` shard files (atomically: a reader never sees half a shard)."""
    users, picks = generate(args.users, args.items, args.per_user, args.seed)
    data_dir.mkdir(parents=True, exist_ok=True)
    for r in range(size):
        mine = users[users % size == r]
        path = shard_path(data_dir, r, size)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            np.savez(f, users=mine, train=picks[mine, :-1], test=picks[mine, -1],
                     items=np.array(args.items), total_users=np.array(args.users))
        os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.prepare:
        prepare(args.data_dir, args.workers, args)
        print(f"wrote {args.workers} shards to {args.data_dir}")
        return
    import torch
    import torch.nn.functional as F
    from torch import nn

    import dp_plugin.torch as hvd

    # Adagrad's sparse update builds COO tensors without checks; torch warns each time.
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // hvd.local_size()))
    if rank == 0 and not all(shard_path(args.data_dir, r, size).exists() for r in range(size)):
        prepare(args.data_dir, size, args)
        print(f"wrote {size} shards to {args.data_dir}", flush=True)
    hvd.barrier()

    shard = np.load(shard_path(args.data_dir, rank, size))  # this worker's shard only
    n_items, n_users = int(shard["items"]), int(shard["total_users"])
    my_users = torch.from_numpy(shard["users"]).long()
    train = torch.from_numpy(shard["train"]).long()
    test = torch.from_numpy(shard["test"]).long()
    pairs_u = my_users.repeat_interleave(train.shape[1])
    pairs_i = train.reshape(-1)

    class NCF(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user = nn.Embedding(n_users, args.dim, sparse=True)
            self.item = nn.Embedding(n_items, args.dim, sparse=True)
            nn.init.normal_(self.user.weight, std=0.1)
            nn.init.normal_(self.item.weight, std=0.1)
            self.mlp = nn.Sequential(nn.Linear(3 * args.dim, args.hidden), nn.ReLU(),
                                     nn.Linear(args.hidden, 1))

        def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
            eu, ei = self.user(u), self.item(i)
            return self.mlp(torch.cat([eu, ei, eu * ei], dim=-1)).squeeze(-1)

    torch.manual_seed(args.seed)
    model = NCF()
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   sparse_as_dense=args.sparse_as_dense)

    # Shards differ in size: every rank takes the smallest shard's number of steps.
    steps = hvd.allreduce(torch.tensor(len(pairs_u) // args.batch), op=hvd.Min,
                          name="steps").item()
    gen = torch.Generator().manual_seed(args.seed + 7919 * rank)
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(pairs_u), generator=gen)
        loss_sum = torch.zeros(())
        for step in range(steps):
            idx = order[step * args.batch:(step + 1) * args.batch]
            u = pairs_u[idx].repeat(1 + args.negatives)
            i = torch.cat([pairs_i[idx],
                           torch.randint(n_items, (len(idx) * args.negatives,), generator=gen)])
            label = torch.zeros(len(u))
            label[:len(idx)] = 1.0
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(model(u, i), label)
            loss.backward()
            opt.step()
            loss_sum += loss.detach()
        mean = hvd.allreduce(loss_sum / steps, op=hvd.Average, name="loss").item()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {mean:.6f} "
                  f"({time.perf_counter() - t0:.1f}s)", flush=True)

    # Popularity over all shards: per-shard item counts summed across workers.
    counts = hvd.allreduce(torch.bincount(pairs_i, minlength=n_items).double(), op=hvd.Sum,
                           name="popularity")
    hits = evaluate(model, my_users, train, test, counts)
    totals = hvd.allreduce(torch.tensor([*hits, float(len(my_users))], dtype=torch.float64),
                           op=hvd.Sum, name="hits")
    model_hr, pop_hr = (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()
    checksum = sum(p.detach().double().abs().sum().item() for p in model.parameters())
    if rank == 0:
        print(f"hit-rate@10 model {model_hr:.4f} popularity {pop_hr:.4f} "
              f"({int(totals[2].item())} users, {n_items} items, workers {size}, "
              f"sparse_as_dense={args.sparse_as_dense})", flush=True)
        print(f"parameter checksum {checksum:.8f}", flush=True)
    hvd.shutdown()


def evaluate(model: Any, users: Any, train: Any, test: Any, popularity: Any) -> tuple[float, float]:
    """Hits@10 of the model and of the popularity ranking, over ``users``;
    items a user already interacted with are never recommended."""
    import torch

    model.eval()
    n_items = popularity.numel()
    all_items = torch.arange(n_items)
    seen = torch.zeros(len(users), n_items, dtype=torch.bool)
    seen.scatter_(1, train, True)
    with torch.no_grad():
        scores = torch.stack([model(u.expand(n_items), all_items) for u in users])
    scores = scores.masked_fill(seen, float("-inf"))
    pop = popularity.expand(len(users), -1).masked_fill(seen, float("-inf"))
    model_hits = (scores.topk(10, dim=1).indices == test[:, None]).any(dim=1).sum().item()
    pop_hits = (pop.topk(10, dim=1).indices == test[:, None]).any(dim=1).sum().item()
    return float(model_hits), float(pop_hits)


if __name__ == "__main__":
    main()
