"""ResNet-18 image classification, data parallel with dp_plugin (Horovod's recipe).

The images are real: scikit-learn's bundled handwritten digits (1797 scans,
8x8 grey levels, shipped inside the package: nothing is downloaded),
upsampled to ``--image-size`` pixels and repeated over 3 channels. The model
is the standard ResNet-18 (BasicBlock x [2, 2, 2, 2], He et al. 2015) in the
CIFAR layout (3x3 stem, no max-pool: the images are small), randomly
initialized; ``--width`` is the first stage's channel count (64 in the
paper; smaller keeps 2 CPU cores busy for seconds instead of minutes).

Horovod's recipe::

    hvd.init()
    per-worker batch = global batch / hvd.size()    # 256 = 8 x 32 in the reference setup
    lr = base_lr * global_batch / 256, linear warmup over the first epochs
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(...); hvd.broadcast_optimizer_state(...)
    accuracy = hvd.allreduce(correct) / hvd.allreduce(count)

With a fixed global batch the learning rate does not change with the number
of workers (Horovod's ``lr * hvd.size()`` is the same rule for a fixed
per-worker batch: pass ``--batch-per-worker 32`` to get it). Each global
batch is the same set of images whatever the number of workers (one
permutation per epoch, cut into global batches, each split over the
workers), so with ``--sync-bn`` 1, 2 or 3 workers follow the same
trajectory up to float rounding.

    torchrun --nproc_per_node 2 examples/resnet_digits.py --sync-bn
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

MISSING = "{pkg} is not installed; install it with `pip install '{req}'` (or `make install`)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="ResNet-18 on scikit-learn's handwritten digits, data parallel "
                    "with dp_plugin (torchrun / horovodrun / mpirun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--epochs", type=int, default=10, help="passes over the training images")
    batch = ap.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=int, default=256,
                       help="images per step over all workers (split evenly)")
    batch.add_argument("--batch-per-worker", type=int, default=0,
                       help="images per step per worker instead (global = this x workers)")
    ap.add_argument("--base-lr", type=float, default=0.1,
                    help="SGD learning rate for a global batch of 256 (linear scaling rule)")
    ap.add_argument("--warmup-epochs", type=float, default=2.0,
                    help="linear LR warmup from base-lr/10 (Goyal et al.); then cosine decay")
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    ap.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay")
    ap.add_argument("--width", type=int, default=16,
                    help="channels of the first ResNet stage (64 is the paper's ResNet-18)")
    ap.add_argument("--image-size", type=int, default=16, help="pixels per side after upsampling")
    ap.add_argument("--sync-bn", action="store_true",
                    help="hvd.SyncBatchNorm: batch statistics over the global batch")
    ap.add_argument("--double", action="store_true",
                    help="train in float64: runs with different numbers of workers then agree "
                         "to ~1e-12 instead of drifting apart from float32 rounding (early "
                         "training amplifies 1e-7 differences); for checking, not for speed")
    ap.add_argument("--test-fraction", type=float, default=0.2, help="held-out share")
    ap.add_argument("--seed", type=int, default=0, help="split, init and data order")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per worker; 0 means cores / local workers")
    args = ap.parse_args(argv)
    for name in ("epochs", "global_batch", "width", "image_size"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if args.batch_per_worker < 0:
        ap.error("--batch-per-worker must be > 0")
    return args


def resnet18(num_classes: int, width: int = 64, norm_layer: Any = None) -> Any:
    """ResNet-18: a 3x3 stem, four stages of two BasicBlocks (channels w, 2w,
    4w, 8w; stride 2 from the second stage, 1x1 projection shortcuts where the
    shape changes), global average pooling and a linear classifier.
    ``norm_layer`` (as torchvision's) defaults to ``nn.BatchNorm2d``; pass
    ``hvd.SyncBatchNorm`` for batch statistics over all workers."""
    from torch import nn

    norm = norm_layer or nn.BatchNorm2d

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = norm(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = norm(cout)
            self.relu = nn.ReLU(inplace=True)
            self.shortcut: nn.Module = nn.Identity()
            if stride != 1 or cin != cout:
                self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                              norm(cout))

        def forward(self, x):  # type: ignore[no-untyped-def]
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return self.relu(out + self.shortcut(x))

    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), norm(width),
                               nn.ReLU(inplace=True)]
    cin = width
    for stage, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
        for block in range(2):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(BasicBlock(cin, cout, stride))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    model = nn.Sequential(*layers)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return model


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit(MISSING.format(pkg="scikit-learn", req="scikit-learn==1.9.1")) from None
    import torch
    import torch.nn.functional as F

    import dp_plugin.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // hvd.local_size()))
    global_batch = args.batch_per_worker * size if args.batch_per_worker else args.global_batch
    if global_batch % size:
        raise SystemExit(f"--global-batch {global_batch} is not divisible by {size} workers; "
                         f"pick a multiple of {size}")
    per_worker = global_batch // size

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(args.image_size,) * 2, mode="bilinear", align_corners=False)
    x = ((x - 0.5) / 0.5).expand(-1, 3, -1, -1).contiguous()
    y = torch.tensor(digits.target, dtype=torch.long)
    dtype = torch.float64 if args.double else torch.float32
    x = x.to(dtype)
    split = torch.randperm(len(y), generator=torch.Generator().manual_seed(args.seed))
    n_test = int(len(y) * args.test_fraction)
    test_idx, train_idx = split[:n_test], split[n_test:]

    torch.manual_seed(args.seed)
    model = resnet18(10, args.width, norm_layer=hvd.SyncBatchNorm if args.sync_bn else None)
    model = model.to(dtype)
    lr = args.base_lr * global_batch / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                          weight_decay=args.weight_decay)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

    steps_per_epoch = len(train_idx) // global_batch
    if steps_per_epoch == 0:
        raise SystemExit(f"global batch {global_batch} exceeds the {len(train_idx)} "
                         "training images")
    total = steps_per_epoch * args.epochs
    warmup = max(1, int(args.warmup_epochs * steps_per_epoch))

    def lr_factor(step: int) -> float:
        if step < warmup:
            return 0.1 + 0.9 * step / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    if rank == 0:
        print(f"workers {size}: global batch {global_batch} = {size} x {per_worker}, "
              f"lr {lr:.4f}, {steps_per_epoch} steps/epoch, sync-bn {args.sync_bn}", flush=True)

    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        order = train_idx[torch.randperm(len(train_idx),
                                         generator=torch.Generator().manual_seed(
                                             args.seed * 1000 + epoch))]
        loss_sum = torch.zeros(())
        for step in range(steps_per_epoch):
            batch = order[step * global_batch:(step + 1) * global_batch]
            mine = batch[rank * per_worker:(rank + 1) * per_worker]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[mine]), y[mine])
            loss.backward()
            opt.step()
            schedule.step()
            loss_sum += loss.detach()
        mean_loss = hvd.allreduce(loss_sum / steps_per_epoch, op=hvd.Average, name="loss")
        acc = evaluate(model, x, y, test_idx, rank, size, hvd)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {mean_loss.item():.6f} "
                  f"held-out accuracy {acc:.4f} ({time.perf_counter() - t0:.1f}s)", flush=True)
    if rank == 0:
        print(f"final: workers {size} held-out accuracy {acc:.4f} "
              f"({n_test} images, chance 0.10)", flush=True)
    hvd.shutdown()


def evaluate(model, x, y, test_idx, rank, size, hvd) -> float:  # type: ignore[no-untyped-def]
    """Each rank scores its slice of the held-out set; the counts are summed
    with hvd.allreduce."""
    import torch

    model.eval()
    mine = test_idx[rank::size]
    with torch.no_grad():
        correct = (model(x[mine]).argmax(dim=1) == y[mine]).sum().float()
    counts = hvd.allreduce(torch.stack([correct.double(), torch.tensor(float(len(mine)),
                                                                         dtype=torch.float64)]),
                           op=hvd.Sum, name="accuracy")
    return (counts[0] / counts[1]).item()


if __name__ == "__main__":
    sys.exit(main())
