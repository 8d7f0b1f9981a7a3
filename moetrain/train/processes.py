"""The processes the trainer runs on: the seam between the training loop and parallelism.

The trainer asks its processes object for the optimizer and hands it the gradients after
backward; SingleProcess builds the plain optimizer and has no gradients to reduce. Its
multi-process counterpart (moetrain.parallel.processes.Distributed, which lays the model out by a
parallel strategy: data, expert, fsdp or fsdp_expert) provides the same attributes and methods: it
averages dense gradients over ranks, leaves expert gradients to their owners, builds an MoE-aware
optimizer, clips by the norm over all ranks, and writes one checkpoint file per rank.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from moetrain.config import OptimConfig, SettingError
from moetrain.train import checkpoint
from moetrain.train.optim import build_optimizer


class SingleProcess:
    world_size = 1
    rank = 0
    is_main = True  # only the main process writes logs, TensorBoard and checkpoints

    def build_optimizer(self, model: nn.Module, cfg: OptimConfig, seed: int = 0) -> torch.optim.Optimizer:
        self.model, self.optimizer = model, build_optimizer(model, cfg, seed)
        return self.optimizer

    def reduce_gradients(self, model: nn.Module) -> None:
        """One process holds every gradient already."""

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The global gradient norm; scales the gradients to at most max_norm (inf: only measures:
        torch's clip_grad_norm_ would still multiply every gradient by 1, a pass over all of them)."""
        grads = [param.grad for param in model.parameters() if param.grad is not None]
        # In fp32 whatever the gradients' dtype (torch's get_total_norm returns bf16 for bf16 gradients),
        # one _foreach_norm per dtype and device: given a list of mixed dtypes (bf16 gradients, the
        # routers' fp32 ones) torch takes its slow path, one reduction kernel per tensor.
        groups: dict[tuple, list[torch.Tensor]] = {}
        for grad in grads:
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        norms = [norm for group in groups.values() for norm in torch._foreach_norm(group, 2.0, dtype=torch.float32)]
        total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        if max_norm != float("inf"):
            torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None], max_norm, total)
        return total

    def clip_grads_with_norm_(self, model: nn.Module, max_norm: float, total_norm: torch.Tensor) -> None:
        """Scales the gradients by max_norm / (total_norm + 1e-6), clamped to 1, as clip_grad_norm_."""
        torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None], max_norm, total_norm)

    def mean_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def enable_async_checkpoints(self) -> None:
        raise SettingError("TrainerConfig.async_checkpoint writes sharded checkpoints of several ranks: use "
                           "ParallelConfig.strategy='fsdp'|'fsdp_expert' with ParallelConfig.nproc_per_node > 1, "
                           "or drop it")

    def save_checkpoint(self, state: dict, run_dir: Path, step: int, keep: int) -> Path:
        return checkpoint.save(state, run_dir, step, keep)

    def finish_checkpoints(self) -> None:
        """Checkpoints are written synchronously here."""

    def load_checkpoint(self, path: Path) -> dict:
        if not Path(path).is_dir():
            return checkpoint.load(path)
        # A multi-process checkpoint: sharded (DCP), or one file per rank of any number of ranks.
        from moetrain.parallel import checkpoint as shards
        from moetrain.parallel import sharded_checkpoint as sharded

        if sharded.is_sharded_checkpoint(path):
            return self._load_sharded(Path(path))
        state = shards.consolidate(shards.load_shards(str(path)))  # on one rank, every expert is local
        state["optimizer"] = shards.indexed_optimizer_state(state["optimizer"], self.optimizer, self.model)
        return state

    def _load_sharded(self, path: Path) -> dict:
        from moetrain.parallel import checkpoint as shards
        from moetrain.parallel import sharded_checkpoint as sharded

        sharded.verify(path)
        named = {"model": self.model.state_dict(),
                 "optimizer": sharded.named_optimizer_state(self.optimizer, self.model)}
        request = {**named, "trainer": sharded.blob(None), sharded.rng_key(0): sharded.blob(None)}
        loaded = sharded.load(request, path, distributed=False)  # into named's tensors, in place
        optimizer = shards.indexed_optimizer_state(
            {"state": named["optimizer"]["state"], "param_groups": loaded["optimizer"]["param_groups"]},
            self.optimizer, self.model)
        return {**loaded["trainer"], "rng": loaded[sharded.rng_key(0)],
                "model": named["model"], "optimizer": optimizer}
