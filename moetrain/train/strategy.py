"""Where the trainer meets the parallel strategy.

The trainer asks its strategy for the optimizer and hands it the gradients after backward; this
one-process strategy builds the plain optimizer and has no gradients to reduce. A multi-process
strategy (moetrain.parallel) provides the same attributes and methods: it averages dense
gradients over ranks, leaves expert gradients to their owners, and builds an MoE-aware optimizer.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.config import OptimConfig
from moetrain.train.optim import build_optimizer


class SingleProcess:
    world_size = 1
    rank = 0
    is_main = True  # only the main process writes logs, TensorBoard and checkpoints

    def build_optimizer(self, model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
        return build_optimizer(model, cfg)

    def reduce_gradients(self, model: nn.Module) -> None:
        """One process holds every gradient already."""
