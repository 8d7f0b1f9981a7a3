"""The optimizer and its warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

from moetrain.config import OptimConfig, OptimizerName
from moetrain.moe import is_expert_param


def _decays(parameter: nn.Parameter) -> bool:
    """Weight decay shrinks weight matrices only: not biases, norm scales, or the per-expert
    biases of routed experts (b1 [E, H], b2 [E, D], vectors stacked along the expert dimension)."""
    return parameter.ndim >= 3 or (parameter.ndim == 2 and not is_expert_param(parameter))


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    parameters = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in parameters if _decays(p)], "weight_decay": cfg.weight_decay},
        {"params": [p for p in parameters if not _decays(p)], "weight_decay": 0.0},
    ]
    if cfg.name == OptimizerName.adamw:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
    """Linear warm-up over optim.warmup_steps, then cosine decay to lr * min_lr_ratio at max_steps."""
    warmup_steps = min(cfg.warmup_steps, max_steps - 1)
    cosine = CosineAnnealingLR(optimizer, T_max=max_steps - warmup_steps, eta_min=cfg.lr * cfg.min_lr_ratio)
    if warmup_steps == 0:
        return cosine
    warmup = LinearLR(optimizer, start_factor=1.0 / (warmup_steps + 1), total_iters=warmup_steps)
    return SequentialLR(optimizer, [warmup, cosine], milestones=[warmup_steps])
