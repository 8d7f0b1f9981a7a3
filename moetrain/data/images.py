"""CIFAR-10 and MNIST through torchvision: its download code, its on-disk formats, our checks.

With `download=False` a missing data set is a SettingError naming `root` and the fix.
`verify_checksums=True` (the default) checks every file against torchvision's published MD5s
(the archive's while downloading, then every batch file's) before reading it; turn it off only
for files you made yourself (the tests fabricate small data sets this way).

CIFAR-10's batches are Python pickles, which can run code when unpickled. Beyond the checksums,
they are read by an unpickler that builds only NumPy arrays, lists, dicts, strings and numbers
(_BatchUnpickler), so a file that is not CIFAR-10's, checked or not, cannot run anything.
"""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np

from moetrain.config import SettingError
from moetrain.data.base import DataModule, SeededTransform

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)


def _torchvision():
    """torchvision's datasets and transforms, imported when an image data set is built: importing
    it takes seconds, which every other command (--help, a language model, a config error) is spared."""
    from torchvision import datasets, transforms

    return datasets, transforms


def _array_globals() -> dict[tuple[str, str], object]:
    """The functions and types a pickled NumPy array names (found from an array's own pickling, so
    under NumPy 1's module names and NumPy 2's), and the bytes helper of protocol-2 pickles."""
    import codecs

    allowed = {("_codecs", "encode"): codecs.encode, ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for protocol in (2, 5):
        function = np.zeros(1).__reduce_ex__(protocol)[0]
        for module in {function.__module__, function.__module__.replace("numpy._core", "numpy.core"),
                       function.__module__.replace("numpy.core", "numpy._core")}:
            allowed[(module, function.__name__)] = function
    return allowed


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles what a CIFAR-10 batch holds and nothing else: dicts, lists, strings and numbers (no
    globals needed) and NumPy arrays; any other global (a function a crafted file would call) is refused."""

    allowed: dict | None = None

    def find_class(self, module: str, name: str):
        if _BatchUnpickler.allowed is None:
            _BatchUnpickler.allowed = _array_globals()
        found = self.allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR-10 batch does not hold")
        return found


def _read_batch(path: str):
    with open(path, "rb") as file:
        return _BatchUnpickler(file, encoding="latin1").load()


def _cifar10_class(datasets, verify_checksums: bool):
    """torchvision's CIFAR10 (its download, its checksums when verify_checksums), reading its
    pickled batches with _read_batch only."""
    from torchvision.datasets.utils import check_integrity
    from torchvision.datasets.vision import VisionDataset

    base = datasets.CIFAR10 if verify_checksums else _unverified_cifar10(datasets)

    class CIFAR10(base):
        def __init__(self, root: str, train: bool = True, download: bool = False):
            VisionDataset.__init__(self, root)
            self.train = train
            if download:
                self.download()
            if not self._check_integrity():  # each file's published MD5 (only its presence, unverified)
                raise RuntimeError("Dataset not found or corrupted")
            batches = [_read_batch(os.path.join(self.root, self.base_folder, name))
                       for name, _ in (self.train_list if train else self.test_list)]
            self.data = np.vstack([batch["data"] for batch in batches]).reshape(-1, 3, 32, 32).transpose((0, 2, 3, 1))
            self.targets = [label for batch in batches for label in batch["labels"]]
            self._load_meta()

        def _load_meta(self) -> None:
            path = os.path.join(self.root, self.base_folder, self.meta["filename"])
            if not check_integrity(path, self.meta["md5"]):
                raise RuntimeError("Dataset metadata file not found or corrupted")
            self.classes = _read_batch(path)[self.meta["key"]]
            self.class_to_idx = {name: index for index, name in enumerate(self.classes)}

    return CIFAR10


def _unverified_cifar10(datasets):
    class UnverifiedCIFAR10(datasets.CIFAR10):
        """torchvision's CIFAR10 with its MD5s removed: it then checks only that each file exists."""

        tgz_md5 = None
        train_list = [[name, None] for name, _ in datasets.CIFAR10.train_list]
        test_list = [[name, None] for name, _ in datasets.CIFAR10.test_list]
        meta = {**datasets.CIFAR10.meta, "md5": None}

    return UnverifiedCIFAR10


def _root(root: str) -> str:
    return os.path.abspath(os.path.expanduser(root))


def _download_failed(name: str, root: str, folder: str, error: Exception) -> SettingError:
    return SettingError(
        f"downloading {name} to root={root!r} failed ({type(error).__name__}: {error}): check the network, "
        f"or copy {folder} there yourself and set download=False"
    )


def _cifar_file_problem(path: str, meta: bool) -> str | None:
    """What is wrong with one file of cifar-10-batches-py, or None (run only after a failure)."""
    try:
        entry = _read_batch(path)
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    except Exception as error:  # pickle raises many kinds on garbage bytes
        return f"is not a pickled CIFAR-10 batch ({type(error).__name__}: {error})"
    if not isinstance(entry, dict):
        return f"holds a {type(entry).__name__}, not a CIFAR-10 batch (a dict)"
    if meta:
        names = entry.get("label_names")
        return None if isinstance(names, list) and len(names) == 10 else "has no list of 10 label_names"
    data, labels = entry.get("data"), entry.get("labels")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        return f"has no 'data' array of N x 3072 bytes (got {getattr(data, 'shape', type(data).__name__)})"
    if not isinstance(labels, list) or len(labels) != len(data):
        return f"has {len(labels) if isinstance(labels, list) else 'no'} labels for {len(data)} images"
    bad = [(index, label) for index, label in enumerate(labels) if not (isinstance(label, int) and 0 <= label < 10)]
    if bad:
        index, label = bad[0]
        return (f"has {len(bad)} labels outside the 10 classes 0..9 (the first: {label!r} of image {index})")
    return None


def _cifar_error(root: str, dataset_class, fallback: str) -> SettingError:
    """A SettingError naming the first broken file of cifar-10-batches-py and what is wrong with it."""
    folder = os.path.join(root, dataset_class.base_folder)
    files = [name for name, _ in dataset_class.train_list + dataset_class.test_list]
    for name in files + [dataset_class.meta["filename"]]:
        problem = _cifar_file_problem(os.path.join(folder, name), meta=name not in files)
        if problem:
            fallback = f"CIFAR-10 file {os.path.join(folder, name)} {problem}"
            break
    return SettingError(f"{fallback}: these are not CIFAR-10's files; delete {folder} and download again "
                        "(download=True), or fix the file")


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
    datasets, transforms = _torchvision()
    dataset_class = _cifar10_class(datasets, verify_checksums)
    try:
        train = dataset_class(root, train=True, download=download)
        test = dataset_class(root, train=False, download=False)
    except OSError as error:  # urllib's errors are OSErrors
        raise _download_failed("CIFAR-10", root, "cifar-10-batches-py", error) from None
    except RuntimeError:
        found = os.path.isdir(os.path.join(root, datasets.CIFAR10.base_folder))
        raise SettingError(
            f"CIFAR-10 {'is incomplete or fails its checksums' if found else 'not found'} under root={root!r}: "
            + (
                "re-download it, or set verify_checksums=False for files you made yourself"
                if found
                else "set download=True, or give root=FOLDER, the folder holding cifar-10-batches-py"
            )
        ) from None
    except Exception as error:  # files that exist but are not CIFAR-10 batches
        raise _cifar_error(root, dataset_class, f"CIFAR-10 under root={root!r} does not load ({error})") from None
    for split in (train, test):
        if not all(isinstance(label, int) and 0 <= label < 10 for label in split.targets):
            raise _cifar_error(root, dataset_class, f"CIFAR-10 under root={root!r} has labels outside 0..9")
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
    from torchvision.datasets import MNIST
    from torchvision.datasets.utils import check_integrity

    for filename, md5 in MNIST.resources:
        path = os.path.join(raw_folder, filename)
        if not check_integrity(path, md5):
            problem = "is missing" if not os.path.exists(path) else "fails its MD5 check"
            raise SettingError(
                f"MNIST archive {path} {problem}, so the data cannot be verified: delete {raw_folder} and "
                "download again (download=True), or set verify_checksums=False for files you made yourself"
            )


MNIST_FILES = {  # name -> dimensions after the count (idx format, unsigned bytes)
    "train-images-idx3-ubyte": (28, 28), "train-labels-idx1-ubyte": (),
    "t10k-images-idx3-ubyte": (28, 28), "t10k-labels-idx1-ubyte": (),
}


def _idx_problem(path: str, tail: tuple[int, ...]) -> tuple[str | None, int]:
    """(what is wrong with one MNIST idx file or None, how many items it holds)."""
    with open(path, "rb") as file:
        content = file.read()
    ndim = 1 + len(tail)
    header = 4 + 4 * ndim
    if len(content) < header:
        return f"is {len(content)} bytes, shorter than an idx header ({header} bytes)", 0
    if content[0] != 0 or content[1] != 0 or content[2] != 0x08 or content[3] != ndim:
        return (f"starts with bytes {content[:4].hex(' ')}, not the idx magic 00 00 08 0{ndim} "
                f"({ndim}-dimensional unsigned bytes)"), 0
    dims = struct.unpack(f">{ndim}I", content[4:header])
    if dims[1:] != tail:
        return f"holds items of {'x'.join(map(str, dims[1:]))}, not {'x'.join(map(str, tail))}", 0
    expected = header + int(np.prod(dims))
    if len(content) != expected:
        return f"is {len(content)} bytes, but its header promises {dims[0]} items ({expected} bytes)", 0
    if not tail:
        labels = np.frombuffer(content, dtype=np.uint8, offset=header)
        if labels.size and int(labels.max()) > 9:
            return f"has labels outside the 10 classes 0..9 (the largest: {int(labels.max())})", 0
    return None, dims[0]


def _check_mnist_files(raw_folder: str) -> None:
    """The four idx files are what torchvision expects (it fails on others with empty messages)."""
    counts = {}
    for name, tail in MNIST_FILES.items():
        path = os.path.join(raw_folder, name)
        if not os.path.exists(path):
            return  # torchvision reports missing files (or downloads them)
        try:
            problem, counts[name] = _idx_problem(path, tail)
        except OSError as error:
            problem = f"cannot be read ({error.strerror})"
        if problem:
            raise SettingError(f"MNIST file {path} {problem}: it is not MNIST's; delete {raw_folder} and download "
                               "again (download=True), or fix the file")
    for split in ("train", "t10k"):
        images, labels = counts[f"{split}-images-idx3-ubyte"], counts[f"{split}-labels-idx1-ubyte"]
        if images != labels:
            raise SettingError(f"MNIST files {split}-images-idx3-ubyte and {split}-labels-idx1-ubyte in {raw_folder} "
                               f"hold {images} images but {labels} labels: delete {raw_folder} and download again")


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
    datasets, transforms = _torchvision()
    normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MNIST_MEAN, MNIST_STD)])
    _check_mnist_files(os.path.join(root, "MNIST", "raw"))
    try:
        train = datasets.MNIST(root, train=True, download=download, transform=normalize)
        test = datasets.MNIST(root, train=False, download=False, transform=normalize)
    except OSError as error:
        raise _download_failed("MNIST", root, "MNIST/raw", error) from None
    except RuntimeError as error:
        if download:  # torchvision raises RuntimeError when every download mirror failed
            raise _download_failed("MNIST", root, "MNIST/raw", error) from None
        raise SettingError(
            f"MNIST not found under root={root!r}: set download=True, "
            "or give root=FOLDER, the folder holding MNIST/raw"
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
