"""A typical Horovod PyTorch training script, unchanged except for its ``hvd`` import.

Usage: ``python typical_horovod_script.py CHECKPOINT_DIR [--epochs N]`` under
torchrun, mpirun or horovodrun. The tests run it as it is, and with the import
replaced by ``import horovod.torch as hvd`` under real Horovod: apart from that
line, nothing here may name the plugin.

Shaped like Horovod's own examples (pytorch_mnist.py, pytorch_imagenet_resnet50.py):
pin to the local rank, shard the data with DistributedSampler, scale the LR
by the number of workers, resume from rank 0's checkpoint, broadcast the
parameters and optimizer state, wrap the optimizer, average the metrics with
hvd.allreduce, and checkpoint on rank 0 only.
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import dp_plugin.torch as hvd

parser = argparse.ArgumentParser(description="Typical Horovod PyTorch training")
parser.add_argument("checkpoint_dir")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.02)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 4)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = self.dropout(F.relu(self.fc2(x)))
        return F.log_softmax(self.fc3(x), dim=1)


def make_dataset(n=2048, seed=1234):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    teacher = torch.randn(20, 4, generator=g)
    y = (x @ teacher).argmax(dim=1)
    return torch.utils.data.TensorDataset(x, y)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def main():
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(42)
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(42)
    torch.set_num_threads(1)

    train_dataset = make_dataset()
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler)

    model = Net()
    if use_cuda:
        model.cuda()
    lr_scaler = hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    checkpoint = os.path.join(args.checkpoint_dir, "checkpoint.pt")
    resume_from_epoch = 0
    if hvd.rank() == 0 and os.path.exists(checkpoint):
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        resume_from_epoch = state["epoch"]
    resume_from_epoch = hvd.broadcast_object(resume_from_epoch, root_rank=0,
                                             name="resume_from_epoch")
    if resume_from_epoch and hvd.rank() == 0:
        print(f"resumed from epoch {resume_from_epoch}", flush=True)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Average)

    for epoch in range(resume_from_epoch, args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for data, target in train_loader:
            if use_cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
        train_loss = metric_average(total / batches, "avg_loss")
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1} loss {train_loss:.4f}", flush=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch + 1}, checkpoint)


if __name__ == "__main__":
    main()
