"""An endless, resumable stream of training batches.

The order of an epoch depends only on (seed, epoch), and the stream's position is two integers,
so a checkpoint can say exactly where the data stopped and a resumed run continues with the very
next batch, without reading the skipped ones. The DataLoader gets its own generator so that
starting an epoch does not draw from torch's global generator (which dropout and router jitter
use): a resumed run then draws the same random numbers as an uninterrupted one.

With several ranks, each takes every world_size-th item of the epoch's order from its rank on (the
tail that does not split evenly is dropped, as DistributedSampler(drop_last=True) does), so the
ranks see disjoint data and the same number of batches.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from moetrain.config import SettingError


class BatchStream:
    def __init__(self, dataset: Dataset, batch_size: int, num_workers: int, seed: int, pin_memory: bool = False,
                 rank: int = 0, world_size: int = 1):
        if len(dataset) // world_size < batch_size:  # a setting the data cannot meet: one line, not a traceback
            raise SettingError(f"the training set has {len(dataset)} items, fewer than one batch of {batch_size}"
                               + (f" per rank ({world_size} ranks)" if world_size > 1 else "")
                               + ": lower the data's batch_size, or give it more data")
        self.rank, self.world_size = rank, world_size
        self.dataset, self.batch_size, self.num_workers = dataset, batch_size, num_workers
        self.seed, self.pin_memory = seed, pin_memory
        self.epoch = 0
        self.position = 0  # batches already taken from this epoch
        self._batches = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._batches is None:
            self._batches = self._epoch_batches()
        batch = next(self._batches, None)
        if batch is None:  # the epoch is over (an incomplete last batch is dropped)
            self.epoch, self.position = self.epoch + 1, 0
            self._batches = self._epoch_batches()
            batch = next(self._batches)
        self.position += 1
        return batch

    def _epoch_batches(self):
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(hash((self.seed, self.epoch))))
        if self.world_size > 1:
            order = order[self.rank : len(order) - len(order) % self.world_size : self.world_size]
        if hasattr(self.dataset, "set_epoch"):  # per-epoch augmentation (moetrain.data.SeededTransform)
            self.dataset.set_epoch(self.epoch)
        loader = DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=order[self.position * self.batch_size :].tolist(),
            drop_last=True,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            generator=torch.Generator(),
        )
        return iter(loader)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._batches = None
