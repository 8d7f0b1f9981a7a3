"""Data sets and the DataModule the trainer consumes (see base.py for the contract)."""

from moetrain.data.base import TASKS, DataModule, SeededTransform, unpack_batch
from moetrain.data.folder import image_folder
from moetrain.data.images import cifar10, mnist
from moetrain.data.synthetic import synthetic

__all__ = ["TASKS", "DataModule", "SeededTransform", "cifar10", "image_folder", "mnist", "synthetic", "unpack_batch"]
