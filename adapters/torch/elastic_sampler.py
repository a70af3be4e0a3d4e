"""``ElasticSampler``: a ``DistributedSampler`` that remembers how far the epoch got.

Same constructor and methods as Horovod 0.28.1's ``horovod.torch.elastic.ElasticSampler``.
Tracked by a ``TorchState``, its position (epoch and samples done) is part of
every commit; after a restart, possibly with another number of workers, the
samples not yet processed this epoch are split anew among the ranks.

    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=B, sampler=sampler)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, commit_path=...)
    ... for i, batch in enumerate(loader): step(batch); sampler.record_batch(i, B)
    ... sampler.set_epoch(epoch + 1) at the END of each epoch
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data
from dp_plugin.torch import basics


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Indices of ``dataset`` for this rank, skipping those already processed this epoch.

    ``shuffle``: a permutation seeded by ``seed + epoch`` (the same on every
    rank). The remainder is padded by repetition so that every rank gets
    the same number of samples.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first sample. Call it at the end of an
        epoch, so that a commit inside an epoch keeps its position."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one processed batch of ``batch_size`` samples per rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Split the epoch's remaining samples among the current ranks."""
        initialized = basics.is_initialized()
        self.num_replicas = basics.size() if initialized else 1
        self.rank = basics.rank() if initialized else 0
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = list(self.remaining_indices)
        while indices and len(indices) < self.total_size:
            indices += indices[: self.total_size - len(indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
