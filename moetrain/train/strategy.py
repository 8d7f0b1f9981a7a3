"""Where the trainer meets the parallel strategy.

The trainer asks its strategy for the optimizer and hands it the gradients after backward; this
one-process strategy builds the plain optimizer and has no gradients to reduce. A multi-process
strategy (moetrain.parallel.training.Distributed) provides the same attributes and methods: it
averages dense gradients over ranks, leaves expert gradients to their owners, builds an MoE-aware
optimizer, clips by the norm over all ranks, and writes one checkpoint file per rank.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from moetrain.config import ConfigError, OptimConfig
from moetrain.train import checkpoint
from moetrain.train.optim import build_optimizer


class SingleProcess:
    world_size = 1
    rank = 0
    is_main = True  # only the main process writes logs, TensorBoard and checkpoints

    def build_optimizer(self, model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
        self.model, self.optimizer = model, build_optimizer(model, cfg)
        return self.optimizer

    def reduce_gradients(self, model: nn.Module) -> None:
        """One process holds every gradient already."""

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def mean_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def save_checkpoint(self, state: dict, run_dir: Path, step: int, keep: int) -> Path:
        return checkpoint.save(state, run_dir, step, keep)

    def load_checkpoint(self, path: Path) -> dict:
        if not Path(path).is_dir():
            return checkpoint.load(path)
        # A multi-process checkpoint: one file per rank; usable here once converted to one rank.
        from moetrain.parallel import checkpoint as shards

        single = Path(shards.shard_path(str(path), 0, 1))
        if not single.is_file():
            raise ConfigError(
                f"trainer.resume: {path} holds one file per rank of a multi-process run: resume with its "
                "parallel.nproc_per_node, or convert it with `python -m moetrain.parallel.checkpoint "
                f"{path} NEW_DIR --world-size 1` and resume from NEW_DIR"
            )
        state = checkpoint.load(single)  # on one rank, sharded experts are all the experts
        state["optimizer"] = shards.indexed_optimizer_state(state["optimizer"], self.optimizer, self.model)
        return state
