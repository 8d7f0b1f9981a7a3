"""Data sets on fabricated files in the real formats, the synthetic task, and the resumable stream."""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest
import torch
from torchvision import transforms

from moetrain.config import SettingError
from moetrain.data import SeededTransform, cifar10, mnist, synthetic
from moetrain.data.images import CIFAR10_MEAN, CIFAR10_STD, MNIST_MEAN, MNIST_STD
from moetrain.train.stream import BatchStream


def test_cifar10_reads_the_pickled_batches(cifar10_root):
    data = cifar10(str(cifar10_root), download=False, verify_checksums=False, augment=False, num_workers=0)
    assert len(data.train_set) == 80 and len(data.eval_set) == 16
    assert data.model_inputs == {"image_size": 32, "in_channels": 3, "num_classes": 10}
    with open(cifar10_root / "cifar-10-batches-py" / "test_batch", "rb") as f:
        batch = pickle.load(f)
    for index in (0, 7):
        image, label = data.eval_set[index]
        pixels = torch.from_numpy(batch["data"][index].reshape(3, 32, 32)).float() / 255
        expected = (pixels - torch.tensor(CIFAR10_MEAN)[:, None, None]) / torch.tensor(CIFAR10_STD)[:, None, None]
        torch.testing.assert_close(image, expected)
        assert label == batch["labels"][index]


def test_cifar10_checks_checksums_and_presence(cifar10_root, tmp_path):
    with pytest.raises(SettingError, match="verify_checksums=False"):
        cifar10(str(cifar10_root), download=False, verify_checksums=True)
    with pytest.raises(SettingError, match="download=True"):
        cifar10(str(tmp_path / "empty"), download=False, verify_checksums=False)


def test_cifar10_augmentation_depends_only_on_seed_epoch_and_index(cifar10_root):
    train = cifar10(str(cifar10_root), download=False, verify_checksums=False, seed=3).train_set
    first = train[5][0]
    torch.manual_seed(123)  # the global generator must not matter
    torch.testing.assert_close(train[5][0], first, rtol=0, atol=0)
    differs = False
    for epoch in range(1, 6):  # a crop offset or a flip changes with the epoch
        train.set_epoch(epoch)
        differs |= not torch.equal(train[5][0], first)
    assert differs


def test_seeded_transform_matches_the_transform_under_that_seed():
    flip = transforms.RandomHorizontalFlip()
    images = torch.randn(6, 1, 4, 4)
    dataset = SeededTransform(list(zip(images, range(6))), flip, seed=9)
    dataset.set_epoch(2)
    for index in range(6):
        torch.manual_seed(hash((9, 2, index)))
        expected = flip(images[index])
        torch.manual_seed(0)
        torch.testing.assert_close(dataset[index][0], expected, rtol=0, atol=0)


def test_mnist_reads_the_idx_files(mnist_root):
    data = mnist(str(mnist_root), download=False, verify_checksums=False, num_workers=0)
    assert len(data.train_set) == 64 and len(data.eval_set) == 16
    assert data.model_inputs == {"image_size": 28, "in_channels": 1, "num_classes": 10}
    raw = (mnist_root / "MNIST" / "raw" / "t10k-images-idx3-ubyte").read_bytes()
    labels = (mnist_root / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").read_bytes()
    image, label = data.eval_set[3]
    pixels = torch.from_numpy(np.frombuffer(raw[16:], dtype=np.uint8).reshape(16, 28, 28)[3].copy()).float() / 255
    torch.testing.assert_close(image[0], (pixels - MNIST_MEAN[0]) / MNIST_STD[0])
    assert label == labels[8 + 3]


def test_mnist_checks_checksums_and_presence(mnist_root, tmp_path):
    with pytest.raises(SettingError, match="verify_checksums=False"):
        mnist(str(mnist_root), download=False, verify_checksums=True)
    with pytest.raises(SettingError, match="download=True"):
        mnist(str(tmp_path / "empty"), download=False)


def test_synthetic_task_is_fixed_by_its_seed():
    a = synthetic(train_size=50, eval_size=20, seed=1)
    b = synthetic(train_size=50, eval_size=20, seed=1)
    c = synthetic(train_size=50, eval_size=20, seed=2)
    torch.testing.assert_close(a.train_set.tensors[0], b.train_set.tensors[0], rtol=0, atol=0)
    assert not torch.equal(a.train_set.tensors[0], c.train_set.tensors[0])
    assert a.train_set.tensors[0].shape == (50, 3, 16, 16)
    assert set(a.train_set.tensors[1].tolist()) <= set(range(10))
    with pytest.raises(ValueError, match="num_classes"):
        synthetic(num_classes=1)


def test_synthetic_classes_are_separable_by_their_prototypes():
    """The label is recoverable: the nearest class mean (over all shifts) beats chance by far."""
    data = synthetic(train_size=2000, eval_size=500, noise=1.0, seed=4)
    images, labels = data.train_set.tensors
    means = torch.stack([images[labels == c].mean(0) for c in range(10)])
    eval_images, eval_labels = data.eval_set.tensors
    predicted = torch.cdist(eval_images.flatten(1), means.flatten(1)).argmin(1)
    assert (predicted == eval_labels).float().mean() > 0.3  # chance is 0.1


def test_stream_resumes_mid_epoch_with_the_same_batches():
    dataset = torch.utils.data.TensorDataset(torch.arange(20.0), torch.arange(20))
    uninterrupted = BatchStream(dataset, batch_size=3, num_workers=0, seed=5)
    reference = [next(uninterrupted)[1] for _ in range(15)]  # 6 batches per epoch: crosses 2 epochs
    first = BatchStream(dataset, batch_size=3, num_workers=0, seed=5)
    for _ in range(8):
        next(first)
    resumed = BatchStream(dataset, batch_size=3, num_workers=0, seed=5)
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == {"epoch": 1, "position": 2}
    for expected in reference[8:]:
        assert torch.equal(next(resumed)[1], expected)
    epoch = torch.cat(reference[:6])
    assert len(set(epoch.tolist())) == 18  # an epoch sees distinct items; the last 2 are dropped
    assert not torch.equal(torch.cat(reference[6:12]), epoch)  # each epoch reshuffles


def _copy(root, tmp_path):
    import shutil

    shutil.copytree(root, tmp_path / "copy")
    return tmp_path / "copy"


@pytest.mark.parametrize("damage", ["garbage", "truncated", "label 10", "fewer labels"])
def test_mnist_files_that_are_not_mnist_are_named_with_the_fault(damage, mnist_root, tmp_path):
    root = _copy(mnist_root, tmp_path)
    raw = root / "MNIST" / "raw"
    rng = np.random.default_rng()
    images, labels = raw / "t10k-images-idx3-ubyte", raw / "t10k-labels-idx1-ubyte"
    if damage == "garbage":
        images.write_bytes(bytes([1, 2, 3, 4]) + rng.integers(0, 256, 900, dtype=np.uint8).tobytes())
        expected = re.escape("t10k-images-idx3-ubyte starts with bytes 01 02 03 04, not the idx magic 00 00 08 03")
    elif damage == "truncated":
        cut = int(rng.integers(17, len(images.read_bytes())))
        images.write_bytes(images.read_bytes()[:cut])
        expected = re.escape(f"t10k-images-idx3-ubyte is {cut} bytes, but its header promises 16 items "
                             f"({16 + 16 * 28 * 28} bytes)")
    elif damage == "label 10":
        content = bytearray(labels.read_bytes())
        content[8 + int(rng.integers(0, 16))] = 10
        labels.write_bytes(bytes(content))
        expected = re.escape("t10k-labels-idx1-ubyte has labels outside the 10 classes 0..9 (the largest: 10)")
    else:
        content = labels.read_bytes()
        labels.write_bytes(content[:4] + (15).to_bytes(4, "big") + content[8:-1])
        expected = "t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte in .* hold 16 images but 15 labels"
    with pytest.raises(SettingError, match=expected):
        mnist(str(root), download=False, verify_checksums=False)


def test_cifar10_files_that_are_not_cifar10_are_named(cifar10_root, tmp_path):
    root = _copy(cifar10_root, tmp_path)
    folder = root / "cifar-10-batches-py"
    (folder / "data_batch_4").write_bytes(np.random.default_rng().integers(0, 256, 500, dtype=np.uint8).tobytes())
    with pytest.raises(SettingError, match="cifar-10-batches-py/data_batch_4 is not a pickled CIFAR-10 batch"):
        cifar10(str(root), download=False, verify_checksums=False)
    (folder / "data_batch_4").write_bytes((cifar10_root / "cifar-10-batches-py" / "data_batch_4").read_bytes())
    with open(folder / "test_batch", "rb") as f:
        batch = pickle.load(f)
    index = int(np.random.default_rng().integers(0, 16))
    batch["labels"][index] = -1
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(batch, f)
    with pytest.raises(SettingError, match=rf"test_batch has 1 labels outside the 10 classes 0..9 \(the first: -1 of image {index}\)"):
        cifar10(str(root), download=False, verify_checksums=False)
