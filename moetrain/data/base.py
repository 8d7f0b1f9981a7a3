"""What the trainer needs from a data set, and the pieces every image data set shares.

A data preset (conf/data/*.yaml) names a builder with `_target_`; the builder returns a
`DataModule`. The module says which task it serves, so one trainer fits both image
classification and language modelling: batches are `(inputs, targets)`, and the loss is
cross-entropy of the model's logits `[..., C]` against integer targets `[...]` (one class per
image, or the next token per position). A batch may carry a third element, a dict of keyword
arguments for the model (a language model's `document_ids`), which the trainer passes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

TASKS = ("classification", "language_modeling")


@dataclass
class DataModule:
    task: str  # one of TASKS: classification reports accuracy; language modelling adds perplexity
    train_set: Dataset  # items (inputs, targets)
    eval_set: Dataset
    batch_size: int  # per micro-batch
    eval_batch_size: int
    num_workers: int
    model_inputs: dict  # model arguments the data fixes, e.g. image_size, in_channels, num_classes
    # The text's tokenizer (moetrain.data.tokenizer), which a run directory records; None for data
    # given as token ids without one, and for images.
    tokenizer: Any = None

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"DataModule.task must be one of {TASKS}, got {self.task!r}")
        # Named by their config keys (data.*): a data preset passes them through unchanged.
        for key, smallest in (("batch_size", 1), ("eval_batch_size", 1), ("num_workers", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < smallest:
                raise ValueError(f"data.{key} must be an integer >= {smallest}, got {value!r}")


def unpack_batch(batch, device: torch.device, non_blocking: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(inputs, targets, model keyword arguments) of a batch, on `device` (the contract above)."""
    inputs, targets, *extra = batch
    arguments = {key: value.to(device, non_blocking=non_blocking) for key, value in (extra[0] if extra else {}).items()}
    return inputs.to(device, non_blocking=non_blocking), targets.to(device, non_blocking=non_blocking), arguments


def forward_batch(model: torch.nn.Module, batch, device: torch.device):
    """The model on a batch's inputs, with the keyword arguments the batch carries (document ids)."""
    inputs, _, arguments = unpack_batch(batch, device)
    return model(inputs, **arguments)


class SeededTransform(Dataset):
    """Applies a random transform whose randomness depends only on (seed, epoch, index).

    torchvision's augmentations draw from torch's global generator, so their result would depend
    on how many samples were drawn before, in which worker. Seeding each sample on its own makes
    an epoch's augmented images the same whatever the worker count, and lets a resumed run see the
    exact images an uninterrupted run would have seen. The trainer calls set_epoch each epoch.
    """

    def __init__(self, dataset: Dataset, transform, seed: int):
        self.dataset, self.transform, self.seed, self.epoch = dataset, transform, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        image, target = self.dataset[index]
        with torch.random.fork_rng(devices=[]):
            # Python hashes tuples of ints the same way in every process (no hash randomisation).
            torch.manual_seed(hash((self.seed, self.epoch, index)))
            return self.transform(image), target
