"""Training: the loop, checkpoints, the data stream, optimizer and schedule, TensorBoard output."""

from moetrain.train.processes import SingleProcess
from moetrain.train.trainer import IGNORE_INDEX, NonFiniteLoss, Trainer, resolve_device, seed_everything, task_loss

__all__ = ["IGNORE_INDEX", "NonFiniteLoss", "SingleProcess", "Trainer", "resolve_device", "seed_everything", "task_loss"]
