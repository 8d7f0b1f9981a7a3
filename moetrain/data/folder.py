"""Your own images: one subfolder per class (torchvision's ImageFolder layout), classified by the
MoE ViT like CIFAR-10.

    photos/cat/001.png  photos/cat/002.jpg ...  photos/dog/001.png ...
    moetrain +recipe=quickstart data=folder data.path=photos data.image_size=32 data.horizontal_flip=true

Classes are the subfolder names in sorted order (class i = the i-th name). Every image is decoded
once when the data set is built: converted to RGB (channels=3) or grey (channels=1), its shorter
side resized to image_size and the centre cropped to image_size x image_size, and kept in memory as
bytes (N x channels x image_size^2 bytes). Normalisation uses the per-channel mean and standard
deviation of the training images (after resizing), never of the evaluation images.

Evaluation images: a separate folder with the same class names (eval_path; it may lack some
classes), or a held-out eval_fraction of each class, drawn with `seed` (at least one image of every
class with two or more, so each class is scored). Training images can be augmented: a random crop
of image_size after padding every side with crop_padding black pixels, and a horizontal flip with
probability 1/2; each image's draw depends on (seed, epoch, index) only (base.SeededTransform).
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset

from moetrain.data.base import DataModule, SeededTransform


class FolderImages(Dataset):
    """Decoded images as uint8 [N, C, S, S] with their class indices; items are (image, class) with
    `transform` applied to the uint8 image."""

    def __init__(self, images_NCSS: torch.Tensor, labels_N: torch.Tensor, classes: list[str], paths: list[str],
                 transform=None):
        self.images_NCSS, self.labels_N, self.classes, self.paths = images_NCSS, labels_N, classes, paths
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels_N)

    def __getitem__(self, index: int):
        image = self.images_NCSS[index]
        return (self.transform(image) if self.transform is not None else image), int(self.labels_N[index])


def _scan(root: str, key: str):
    """torchvision's ImageFolder over `root`: its classes and (path, class index) samples."""
    from torchvision import datasets  # seconds to import: only when an image data set is built

    if not os.path.isdir(root):
        raise ValueError(f"{key}={root!r} is not a folder: give a folder with one subfolder of images per class")
    try:
        folder = datasets.ImageFolder(root)
    except FileNotFoundError as error:  # no class subfolder, or a class without any image file
        problem = " ".join(str(error).split()).rstrip(".")
        raise ValueError(f"{key}={root!r}: {problem}; the layout is FOLDER/CLASS_NAME/IMAGE (.png, .jpg, ...)") from None
    return folder.classes, folder.samples


def _decode(path: str, image_size: int, channels: int) -> torch.Tensor:
    """One image file -> uint8 [C, S, S]: shorter side resized to S, centre cropped."""
    from PIL import Image, UnidentifiedImageError
    from torchvision.transforms import functional

    try:
        with Image.open(path) as opened:
            image = opened.convert("RGB" if channels == 3 else "L")
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"{path} is not a readable image ({type(error).__name__}: {' '.join(str(error).split())}): "
                         "remove or replace it") from None
    image = functional.center_crop(functional.resize(image, image_size), [image_size, image_size])
    return functional.pil_to_tensor(image)


def _decode_all(samples, image_size: int, channels: int, class_of: list[int]):
    images = torch.stack([_decode(path, image_size, channels) for path, _ in samples]) if samples else None
    labels = torch.tensor([class_of[index] for _, index in samples], dtype=torch.long)
    return images, labels, [path for path, _ in samples]


def channel_statistics(images_NCSS: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per-channel mean and standard deviation (population) of uint8 images, on the 0..1 scale."""
    pixels_CP = images_NCSS.transpose(0, 1).reshape(images_NCSS.size(1), -1).double() / 255
    mean_C = pixels_CP.mean(dim=1)
    std_C = pixels_CP.std(dim=1, correction=0)
    return mean_C.tolist(), std_C.tolist()


class Normalize:
    """uint8 [C, S, S] -> float32 (x / 255 - mean) / std per channel."""

    def __init__(self, mean: list[float], std: list[float]):
        self.mean_C11 = torch.tensor(mean, dtype=torch.float32)[:, None, None]
        # A channel without any variation (a constant colour) keeps a scale of 1, not a division by 0.
        self.std_C11 = torch.tensor([s if s > 0 else 1.0 for s in std], dtype=torch.float32)[:, None, None]

    def __call__(self, image_CSS: torch.Tensor) -> torch.Tensor:
        return (image_CSS.float() / 255 - self.mean_C11) / self.std_C11


def _held_out(labels_N: torch.Tensor, eval_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training indices, evaluation indices): round(eval_fraction * n) of each class's n images,
    at least one when n >= 2 and never all of them, drawn with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    train, held = [], []
    for label in torch.unique(labels_N).tolist():
        members = (labels_N == label).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        count = min(max(round(eval_fraction * len(members)), 1 if len(members) >= 2 else 0), len(members) - 1)
        held.append(members[:count])
        train.append(members[count:])
    return torch.cat(train).sort().values, torch.cat(held).sort().values


def image_folder(
    path: str | None,
    eval_path: str | None = None,
    eval_fraction: float = 0.1,
    image_size: int = 32,
    channels: int = 3,
    crop_padding: int = 0,
    horizontal_flip: bool = False,
    seed: int = 0,
    batch_size: int = 64,
    eval_batch_size: int = 256,
    num_workers: int = 0,
) -> DataModule:
    """Images in class subfolders of `path` (see the module doc) as a classification DataModule."""
    if path is None:
        raise ValueError("path=None: give the folder of class subfolders (path=FOLDER)")
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"image_size={image_size!r}: must be an integer >= 1")
    if channels not in (1, 3):
        raise ValueError(f"channels={channels!r}: must be 3 (RGB) or 1 (grey)")
    if isinstance(crop_padding, bool) or not isinstance(crop_padding, int) or crop_padding < 0:
        raise ValueError(f"crop_padding={crop_padding!r}: must be an integer >= 0 (0 = no random crop)")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be an integer >= 1")
    if eval_path is None and not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction={eval_fraction}: must be in (0, 1) when eval_path=None")
    root = os.path.abspath(os.path.expanduser(path))
    classes, samples = _scan(root, "path")
    images, labels, paths = _decode_all(samples, image_size, channels, list(range(len(classes))))
    if eval_path is None:
        train_index, eval_index = _held_out(labels, eval_fraction, seed)
        if len(eval_index) == 0:
            raise ValueError(f"path={root!r} has no class with two images or more, so nothing can be held out for "
                             "evaluation: add images, or give eval_path=FOLDER")
        eval_images, eval_labels = images[eval_index], labels[eval_index]
        eval_paths = [paths[i] for i in eval_index]
        images, labels, paths = images[train_index], labels[train_index], [paths[i] for i in train_index]
    else:
        eval_root = os.path.abspath(os.path.expanduser(eval_path))
        eval_classes, eval_samples = _scan(eval_root, "eval_path")
        unknown = sorted(set(eval_classes) - set(classes))
        if unknown:
            raise ValueError(f"eval_path={eval_root!r} has classes the training folder lacks: {', '.join(unknown)} "
                             f"(training classes: {', '.join(classes)}): the subfolder names must match")
        eval_images, eval_labels, eval_paths = _decode_all(eval_samples, image_size, channels,
                                                           [classes.index(name) for name in eval_classes])
    from torchvision import transforms

    mean, std = channel_statistics(images)
    normalize = Normalize(mean, std)
    augmentation = ([transforms.RandomCrop(image_size, padding=crop_padding)] if crop_padding else []) + \
        ([transforms.RandomHorizontalFlip()] if horizontal_flip else [])
    train_set = FolderImages(images, labels, classes, paths)
    eval_set = FolderImages(eval_images, eval_labels, classes, eval_paths, transform=normalize)
    train_transform = transforms.Compose(augmentation + [normalize])
    return DataModule(
        task="classification",
        train_set=SeededTransform(train_set, train_transform, seed) if augmentation else
        FolderImages(images, labels, classes, paths, transform=normalize),
        eval_set=eval_set,
        batch_size=batch_size,
        eval_batch_size=eval_batch_size,
        num_workers=num_workers,
        model_inputs={"image_size": image_size, "in_channels": channels, "num_classes": len(classes)},
    )
