"""A learnable synthetic image task that needs no download: smoke tests, quickstart, benchmarks.

Each class owns a smooth random prototype image; a sample is its class prototype at a random
contrast, shifted by a few pixels, under Gaussian noise. A linear classifier cannot reach full
accuracy (the shifts), chance is 1 / num_classes, and a small MoE transformer passes 90% within a
few hundred steps on a CPU. The whole set is generated from `seed`, so it is the same on every
machine and every run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from moetrain.data.base import DataModule


def _make_split(prototypes_CKHW: torch.Tensor, size: int, noise: float, max_shift: int, generator) -> TensorDataset:
    num_classes = prototypes_CKHW.size(0)
    # Every shifted copy of every prototype, S = (2 * max_shift + 1) ** 2 shifts per class.
    offsets = range(-max_shift, max_shift + 1)
    shifted_CSKHW = torch.stack(
        [torch.roll(prototypes_CKHW, shifts=(dy, dx), dims=(2, 3)) for dy in offsets for dx in offsets], dim=1
    )
    labels_N = torch.randint(num_classes, (size,), generator=generator)
    shift_N = torch.randint(shifted_CSKHW.size(1), (size,), generator=generator)
    contrast_N = torch.empty(size).uniform_(0.5, 1.5, generator=generator)
    images_NKHW = shifted_CSKHW[labels_N, shift_N] * contrast_N[:, None, None, None]
    images_NKHW += noise * torch.randn(images_NKHW.shape, generator=generator)
    return TensorDataset(images_NKHW, labels_N)


def synthetic(
    num_classes: int = 10,
    image_size: int = 16,
    in_channels: int = 3,
    train_size: int = 20000,
    eval_size: int = 2000,
    noise: float = 2.0,
    max_shift: int = 2,
    seed: int = 0,
    batch_size: int = 64,
    eval_batch_size: int = 256,
    num_workers: int = 0,
) -> DataModule:
    """Images [in_channels, image_size, image_size] in num_classes classes (see the module doc)."""
    if num_classes < 2 or image_size < 4 or train_size < 1 or eval_size < 1:
        raise ValueError(
            "synthetic data needs num_classes >= 2, image_size >= 4, train_size >= 1 and eval_size >= 1, got "
            f"{num_classes}, {image_size}, {train_size}, {eval_size}"
        )
    generator = torch.Generator().manual_seed(seed)
    # Smooth prototypes: random 4x4 patterns upsampled, scaled to unit standard deviation.
    coarse_CK44 = torch.randn(num_classes, in_channels, 4, 4, generator=generator)
    prototypes_CKHW = F.interpolate(coarse_CK44, size=(image_size, image_size), mode="bilinear", align_corners=False)
    prototypes_CKHW = prototypes_CKHW / prototypes_CKHW.std(dim=(1, 2, 3), keepdim=True)
    return DataModule(
        task="classification",
        train_set=_make_split(prototypes_CKHW, train_size, noise, max_shift, generator),
        eval_set=_make_split(prototypes_CKHW, eval_size, noise, max_shift, generator),
        batch_size=batch_size,
        eval_batch_size=eval_batch_size,
        num_workers=num_workers,
        model_inputs={"image_size": image_size, "in_channels": in_channels, "num_classes": num_classes},
    )
