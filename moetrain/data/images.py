"""CIFAR-10 and MNIST through torchvision: its download code, its on-disk formats, our checks.

With `download=False` a missing data set is a configuration error naming data.root and the fix.
`verify_checksums=True` (the default) checks every file against torchvision's published MD5s;
turn it off only for files you made yourself (the tests fabricate small data sets this way).
"""

from __future__ import annotations

import os

from torchvision import datasets, transforms
from torchvision.datasets.utils import check_integrity

from moetrain.config import ConfigError
from moetrain.data.base import DataModule, SeededTransform

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)


class _UnverifiedCIFAR10(datasets.CIFAR10):
    """torchvision's CIFAR10 with its MD5s removed: it then checks only that each file exists."""

    tgz_md5 = None
    train_list = [[name, None] for name, _ in datasets.CIFAR10.train_list]
    test_list = [[name, None] for name, _ in datasets.CIFAR10.test_list]
    meta = {**datasets.CIFAR10.meta, "md5": None}


def _root(root: str) -> str:
    return os.path.abspath(os.path.expanduser(root))


def _download_failed(name: str, root: str, folder: str, error: Exception) -> ConfigError:
    return ConfigError(
        f"downloading {name} to data.root={root} failed ({type(error).__name__}: {error}): check the network, "
        f"or copy {folder} there yourself and set data.download=false"
    )


def cifar10(
    root: str = "data",
    download: bool = True,
    verify_checksums: bool = True,
    augment: bool = True,
    seed: int = 0,
    batch_size: int = 128,
    eval_batch_size: int = 256,
    num_workers: int = 2,
) -> DataModule:
    """CIFAR-10 (root/cifar-10-batches-py): 50k training and 10k test images, 32x32 RGB, 10 classes.

    Training images get the standard augmentation (random crop with 4-pixel padding, horizontal
    flip) when `augment`, seeded per image by `seed` and the epoch.
    """
    root = _root(root)
    dataset_class = datasets.CIFAR10 if verify_checksums else _UnverifiedCIFAR10
    try:
        train = dataset_class(root, train=True, download=download)
        test = dataset_class(root, train=False, download=False)
    except OSError as error:  # urllib's errors are OSErrors
        raise _download_failed("CIFAR-10", root, "cifar-10-batches-py", error) from None
    except RuntimeError:
        found = os.path.isdir(os.path.join(root, datasets.CIFAR10.base_folder))
        raise ConfigError(
            f"CIFAR-10 {'is incomplete or fails its checksums' if found else 'not found'} under data.root={root}: "
            + (
                "re-download it, or set data.verify_checksums=false for files you made yourself"
                if found
                else "set data.download=true, or point data.root at the folder holding cifar-10-batches-py"
            )
        ) from None
    normalize = [transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    augmentation = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if augment else []
    test.transform = transforms.Compose(normalize)
    return DataModule(
        task="classification",
        train_set=SeededTransform(train, transforms.Compose(augmentation + normalize), seed),
        eval_set=test,
        batch_size=batch_size,
        eval_batch_size=eval_batch_size,
        num_workers=num_workers,
        model_inputs={"image_size": 32, "in_channels": 3, "num_classes": 10},
    )


def _verify_mnist(raw_folder: str) -> None:
    """torchvision checks MNIST's MD5s only while downloading; check the archives it kept."""
    for filename, md5 in datasets.MNIST.resources:
        path = os.path.join(raw_folder, filename)
        if not check_integrity(path, md5):
            problem = "is missing" if not os.path.exists(path) else "fails its MD5 check"
            raise ConfigError(
                f"MNIST archive {path} {problem}, so the data cannot be verified: delete {raw_folder} and "
                "download again (data.download=true), or set data.verify_checksums=false for files you made yourself"
            )


def mnist(
    root: str = "data",
    download: bool = True,
    verify_checksums: bool = True,
    batch_size: int = 128,
    eval_batch_size: int = 256,
    num_workers: int = 2,
) -> DataModule:
    """MNIST (root/MNIST/raw, idx files): 60k training and 10k test digits, 28x28 grey, 10 classes."""
    root = _root(root)
    normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MNIST_MEAN, MNIST_STD)])
    try:
        train = datasets.MNIST(root, train=True, download=download, transform=normalize)
        test = datasets.MNIST(root, train=False, download=False, transform=normalize)
    except OSError as error:
        raise _download_failed("MNIST", root, "MNIST/raw", error) from None
    except RuntimeError as error:
        if download:  # torchvision raises RuntimeError when every download mirror failed
            raise _download_failed("MNIST", root, "MNIST/raw", error) from None
        raise ConfigError(
            f"MNIST not found under data.root={root}: set data.download=true, "
            "or point data.root at the folder holding MNIST/raw"
        ) from None
    if verify_checksums:
        _verify_mnist(train.raw_folder)
    return DataModule(
        task="classification",
        train_set=train,
        eval_set=test,
        batch_size=batch_size,
        eval_batch_size=eval_batch_size,
        num_workers=num_workers,
        model_inputs={"image_size": 28, "in_channels": 1, "num_classes": 10},
    )
