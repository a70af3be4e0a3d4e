"""Worker: Lightning's ``Trainer`` on ``strategy="horovod"`` (dp_plugin.lightning).

Run under any launcher (see tests/multiproc/harness.py)::

    python lightning_strategy.py --case fit --strategy horovod --out DIR

Cases:

- ``fit``: ``Trainer.fit`` of a tiny regression model, once per entry of
  ``FITS`` (plain; ``accumulate_grad_batches=4`` over 6 batches, so the
  epoch ends inside a window; clipping by value and by norm to bounds the
  gradients exceed; ``bf16-mixed``), with ``--strategy`` ``horovod`` or
  ``ddp``. Each rank writes its final weights to ``DIR/fit.STRATEGY.rankR.json``;
  the test compares them across ranks and strategies.
- ``features`` (horovod only): ``self.log("rank", rank, sync_dist=True)`` in
  ``validate`` gives the mean rank on every rank; ``predict`` over 7 samples
  covers every sample exactly once, each predicted with the same weights;
  manual optimization with two optimizers equals plain torch trained on
  the global batches (1e-6); a run stopped after 2 epochs and
  resumed from its last checkpoint ends bitwise equal to a run of 4 epochs.
- ``uneven``: rank 0 has 3 batches per epoch and rank 1 has 4, from loaders
  of their own (``use_distributed_sampler=False``), with ``sync_dist``
  logging per step and per epoch and a validation each epoch: no rank hangs,
  the ranks end bitwise equal, at the weights of DDP's ``Join`` computed in
  one process (a step's gradient is the sum of the ranks' that have a batch,
  divided by 2).
- ``fabric``: ``Fabric(strategy="horovod")``, rank 1 starting from other
  weights: two epochs of a loop with ``fabric.backward``,
  ``fabric.clip_gradients`` (by norm, to a bound the gradients exceed) and
  ``optimizer.step()`` over ``fabric.setup_dataloaders``'s shards end
  bitwise equal on the ranks and within 1e-6 of one process on the global
  batches, clipping the global batch's gradient; ``fabric.all_reduce`` of
  the rank is its mean.
- ``raise``: rank 1 raises in its third ``training_step``; the exception is
  left to end the interpreter as in a user's script (not ``run_cases``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _fail_fast import run_cases
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dp_plugin.lightning  # noqa: F401 - registers strategy="horovod"
import dp_plugin.torch as hvd

SAMPLES, BATCH = 24, 2
DDP_DEVICES = int(os.environ.get("WORLD_SIZE", "1"))
"""The ``ddp`` reference's ``devices``, read before Lightning's ``LightningEnvironment``
removes ``WORLD_SIZE`` from the environment at the end of its first fit."""
FITS: dict[str, dict[str, Any]] = {
    "plain": {},
    "accumulate": {"accumulate_grad_batches": 4},
    "clip_value": {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
    "clip_norm": {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"},
    "bf16": {"precision": "bf16-mixed"},
}


def data(n: int = SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if os.environ.get("RAISE_ON_RANK") == str(self.global_rank) and batch_idx == 2:
            raise RuntimeError(f"a deliberate failure on rank {self.global_rank}")
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("rank", float(self.global_rank), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        index, x = batch
        return index, self(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def trainer(strategy: str, epochs: int = 2, **options: Any) -> L.Trainer:
    devices = DDP_DEVICES if strategy == "ddp" else "auto"
    options.setdefault("enable_checkpointing", False)
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=epochs,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, **options)


def weights(module: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in module.parameters()]).double().tolist()


def fit(args: argparse.Namespace) -> None:
    results = {}
    for name, options in FITS.items():
        L.seed_everything(0, verbose=False)
        model = Regression()
        t = trainer(args.strategy, **options)
        t.fit(model, DataLoader(data(), batch_size=BATCH))
        results[name] = weights(model)
        rank = t.global_rank
    Path(args.out, f"fit.{args.strategy}.rank{rank}.json").write_text(json.dumps(results))


# -- features ---------------------------------------------------------------------

def check_sync_dist() -> None:
    metrics = trainer("horovod").validate(Regression(), DataLoader(data(), batch_size=BATCH),
                                          verbose=False)
    expected = (hvd.size() - 1) / 2
    assert metrics == [{"rank": expected}], (metrics, expected)


def check_predict() -> None:
    model = Regression()
    xs = data(7).tensors[0]
    loader = DataLoader(TensorDataset(torch.arange(7), xs), batch_size=2)
    out = trainer("horovod").predict(model, loader)
    with torch.no_grad():  # batch by batch, as predict ran: the same arithmetic
        assert all(torch.equal(y, model(xs[i])) for i, y in out), "prediction is not the model's"
    index = torch.cat([i for i, _ in out])
    seen = sorted(i for chunk in hvd.allgather_object(index.tolist()) for i in chunk)
    assert seen == list(range(7)), seen  # Lightning's predict sampler repeats none


class TwoOptimizers(L.LightningModule):
    """A manual step per optimizer, each on its own half of the network."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 1)
        self.batches: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.batches.append(batch)
        body_opt, head_opt = self.optimizers()
        for opt in (body_opt, head_opt):
            opt.zero_grad()
            self.manual_backward(manual_loss(self.body, self.head, batch, opt is body_opt))
            opt.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.body.parameters(), lr=0.1, momentum=0.9),
                torch.optim.Adam(self.head.parameters(), lr=0.01)]


def manual_loss(body: nn.Module, head: nn.Module, batch: Any, first: bool) -> torch.Tensor:
    """The body's loss reaches the body only, the head's the head only: a
    backward into the other optimizer's parameters would leave them pending,
    and its ``zero_grad()`` would raise (Horovod's rule)."""
    x, y = batch
    h = torch.tanh(body(x))
    if first:
        return nn.functional.mse_loss(h.mean(dim=1, keepdim=True), y)
    return nn.functional.mse_loss(head(h.detach()), y)


def check_manual() -> None:
    L.seed_everything(0, verbose=False)
    model = TwoOptimizers()
    body, head = nn.Linear(4, 8), nn.Linear(8, 1)
    body.load_state_dict(model.body.state_dict())
    head.load_state_dict(model.head.state_dict())
    trainer("horovod", epochs=1).fit(model, DataLoader(data(), batch_size=BATCH))
    # Plain torch on the global batches: step i's batches of every rank, concatenated.
    opts = [torch.optim.SGD(body.parameters(), lr=0.1, momentum=0.9),
            torch.optim.Adam(head.parameters(), lr=0.01)]
    per_rank = hvd.allgather_object(model.batches)
    for step in zip(*per_rank, strict=True):
        batch = [torch.cat(parts) for parts in zip(*step, strict=True)]
        for first, opt in zip((True, False), opts, strict=True):
            opt.zero_grad()
            manual_loss(body, head, batch, first).backward()
            opt.step()
    got = weights(nn.Sequential(model.body, model.head))
    want = weights(nn.Sequential(body, head))
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst <= 1e-6, f"manual optimization is {worst:g} from the global-batch run"


def check_resume(out: Path) -> None:
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    L.seed_everything(0, verbose=False)
    whole = Regression()
    trainer("horovod", epochs=4).fit(whole, loader)

    L.seed_everything(0, verbose=False)
    stopped = Regression()
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "ckpt", save_last=True)
    trainer("horovod", epochs=2, enable_checkpointing=True, callbacks=[ckpt]).fit(stopped, loader)
    last = out / "ckpt" / "last.ckpt"
    assert last.exists(), sorted(p.name for p in out.iterdir())
    resumed = Regression()  # zeros: everything must come from the file
    for p in resumed.parameters():
        nn.init.zeros_(p)
    trainer("horovod", epochs=4).fit(resumed, loader, ckpt_path=str(last))
    assert weights(resumed) == weights(whole), "the resumed run differs from the whole run"


def features(args: argparse.Namespace) -> None:
    check_sync_dist()
    check_predict()
    check_manual()
    check_resume(Path(args.out))


# -- uneven ----------------------------------------------------------------------

UNEVEN = (3, 4)
"""Batches per epoch of rank 0 and rank 1."""


class LoggingRegression(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss


def uneven_shards() -> list[TensorDataset]:
    x, y = data().tensors
    start = UNEVEN[0] * BATCH
    return [TensorDataset(x[:start], y[:start]),
            TensorDataset(x[start:start + UNEVEN[1] * BATCH], y[start:start + UNEVEN[1] * BATCH])]


def check_uneven(args: argparse.Namespace) -> None:
    epochs = 2
    L.seed_everything(0, verbose=False)
    model = LoggingRegression()
    reference = net()
    reference.load_state_dict(model.net.state_dict())
    shards = uneven_shards()
    t = trainer("horovod", epochs=epochs, use_distributed_sampler=False)
    t.fit(model, DataLoader(shards[hvd.rank()], batch_size=BATCH),
          DataLoader(data(4), batch_size=BATCH))
    got = weights(model)
    assert all(g == got for g in hvd.allgather_object(got)), "the ranks' weights differ"

    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(epochs):
        for step in range(max(UNEVEN)):
            opt.zero_grad()
            losses = [nn.functional.mse_loss(reference(s.tensors[0][step * BATCH:][:BATCH]),
                                             s.tensors[1][step * BATCH:][:BATCH])
                      for s, n in zip(shards, UNEVEN, strict=True) if step < n]
            (sum(losses) / len(UNEVEN)).backward()
            opt.step()
    worst = max(abs(a - b) for a, b in zip(got, weights(reference), strict=True))
    assert worst <= 1e-6, f"uneven batches are {worst:g} from DDP's Join"


# -- fabric ----------------------------------------------------------------------

def check_fabric(args: argparse.Namespace) -> None:
    from lightning.fabric import Fabric

    epochs, max_norm = 2, 0.05
    torch.manual_seed(0)
    model = net()
    reference = net()
    reference.load_state_dict(model.state_dict())
    fabric = Fabric(strategy="horovod", accelerator="cpu")
    fabric.launch()
    if fabric.global_rank == 1:  # setup must send rank 0's weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loader = fabric.setup_dataloaders(DataLoader(data(), batch_size=BATCH))
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            fabric.backward(nn.functional.mse_loss(model(x), y))
            fabric.clip_gradients(model, opt, max_norm=max_norm)
            opt.step()
    got = weights(model)
    assert all(g == got for g in hvd.allgather_object(got)), "the ranks' weights differ"
    mean_rank = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="mean")
    assert mean_rank.item() == (fabric.world_size - 1) / 2, mean_rank

    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    clipped = False
    for _ in range(epochs):  # the ranks' batches i, together: rows 4i .. 4i+3
        for x, y in DataLoader(data(), batch_size=BATCH * fabric.world_size):
            ref_opt.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
            clipped |= bool(norm > max_norm)
            ref_opt.step()
    assert clipped, "the bound clipped nothing"
    worst = max(abs(a - b) for a, b in zip(got, weights(reference), strict=True))
    assert worst <= 1e-6, f"Fabric is {worst:g} from one process on the global batches"


def raise_in_training_step(args: argparse.Namespace) -> None:
    os.environ["RAISE_ON_RANK"] = "1"
    trainer("horovod", epochs=1).fit(Regression(), DataLoader(data(), batch_size=BATCH))


CASES = {"fit": fit, "features": features, "uneven": check_uneven,
         "fabric": check_fabric}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["horovod", "ddp"], default="horovod")
    parser.add_argument("--out", default=".")
    if "--case" in sys.argv and sys.argv[sys.argv.index("--case") + 1] == "raise":
        raise_in_training_step(parser.parse_known_args()[0])
    else:
        run_cases(CASES, parser=parser)
