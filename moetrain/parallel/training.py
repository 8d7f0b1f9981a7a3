"""The multi-process strategy for moetrain's Trainer (the counterpart of train.strategy.SingleProcess).

    strategy = Distributed(ParallelConfig(nproc_per_node=4, strategy="expert"))  # after init_distributed
    Trainer(model, data, ..., strategy=strategy).fit()

It shards the experts (strategy "expert", with the adaptive degree and overlap of the config) or
keeps them replicated (strategy "data"), wraps the configured optimizer in DistributedOptimizer
(ZeRO-1 optional), clips by the global gradient norm, and writes checkpoints as one directory per
step with one file per rank (checkpoint.py's format, convertible to another world size).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config import ConfigError, OptimConfig, ParallelConfig
from moetrain.parallel import checkpoint as shards
from moetrain.parallel.expert import parallelize
from moetrain.parallel.optimizer import DistributedOptimizer
from moetrain.train import checkpoint
from moetrain.train.optim import build_optimizer


class Distributed:
    def __init__(self, cfg: ParallelConfig):
        if not dist.is_initialized():
            raise RuntimeError("the Distributed strategy needs torch.distributed initialised (moetrain.parallel.launch)")
        self.cfg = cfg
        self.expert_parallel = getattr(cfg.strategy, "value", cfg.strategy) == "expert"
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.is_main = self.rank == 0  # only the main process writes logs and TensorBoard
        self.model: nn.Module | None = None
        self.optimizer: DistributedOptimizer | None = None

    def build_optimizer(self, model: nn.Module, cfg: OptimConfig) -> DistributedOptimizer:
        if self.expert_parallel:
            try:
                parallelize(model, self.cfg.adaptive_r, self.cfg.a2a_ffn_overlap_degree)
            except ValueError as error:  # experts vs ranks, or the degree: a setup mistake
                raise ConfigError(f"parallel: {error}") from None
        self.model = model
        self.optimizer = DistributedOptimizer(build_optimizer(model, cfg), model, zero=self.cfg.zero)
        return self.optimizer

    def reduce_gradients(self, model: nn.Module) -> None:
        self.optimizer.reduce_gradients()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The global norm (each expert counted once), the same on every rank; clips to max_norm."""
        return self.optimizer.clip_grad_norm_(max_norm)

    def mean_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        total = values.detach().clone()
        dist.all_reduce(total)
        return total / self.world_size

    # ---- checkpoints: checkpoints/step_<step>/rank<r>-of-<world>.pt ------------------------------
    def save_checkpoint(self, state: dict, run_dir: Path, step: int, keep: int) -> Path:
        directory = Path(run_dir) / checkpoint.CHECKPOINT_DIR / f"step_{step:08d}"
        directory.mkdir(parents=True, exist_ok=True)
        state = {**state, "moe_parallel": shards.parallel_metadata(self.model, self.world_size, self.rank)}
        shards.save_shard(state, str(directory))  # returns once every rank's file and SHA256SUMS are written
        if self.is_main:
            checkpoint.prune(directory.parent, keep)
        return directory

    def load_checkpoint(self, path: Path) -> dict:
        path = Path(path)
        if not path.is_dir():
            raise ConfigError(
                f"trainer.resume: {path} is a one-process checkpoint and this run has {self.world_size} ranks: "
                f"resume with parallel.nproc_per_node=1, or start from its weights in a new run")
        names = sorted(name.name for name in path.glob("rank*-of-*.pt"))
        saved_world = int(names[0].split("-of-")[1][:-3]) if names else 0
        if saved_world != self.world_size:
            raise ConfigError(
                f"trainer.resume: {path} was written by {saved_world} ranks but this run has {self.world_size}: "
                f"convert it first with `python -m moetrain.parallel.checkpoint {path} NEW_DIR "
                f"--world-size {self.world_size}` and resume from NEW_DIR")
        state = checkpoint.load(Path(shards.shard_path(str(path), self.rank, self.world_size)))
        sharded = bool(state["moe_parallel"]["expert_parallel"])
        if sharded != self.expert_parallel:
            raise ConfigError(
                f"trainer.resume: {path} was written with {'expert' if sharded else 'data'} parallelism; set "
                f"parallel.strategy={'expert' if sharded else 'data'}, or convert it with --expert-parallel "
                f"{'no' if sharded else 'yes'}")
        return state
