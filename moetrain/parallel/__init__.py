"""Distributed training: expert / adaptive parallelism, FSDP2, the MoE-aware optimizer, launch, resharding."""

from moetrain.parallel.expert import ExpertParallel, parallelize, set_adaptive_r
from moetrain.parallel.launch import choose_backend, free_port, init_distributed, init_from_torchrun, spawn
from moetrain.parallel.layout import ExpertLayout
from moetrain.parallel.optimizer import DistributedOptimizer

__all__ = [
    "DistributedOptimizer", "ExpertLayout", "ExpertParallel", "choose_backend", "free_port", "init_distributed",
    "init_from_torchrun", "parallelize", "set_adaptive_r", "shard_model", "spawn",
]


def __getattr__(name: str):
    # shard_model brings in torch's FSDP (about a second to import): imported on first use, so that
    # the launcher and the command start without it.
    if name == "shard_model":
        from moetrain.parallel.fsdp import shard_model

        return shard_model
    raise AttributeError(f"module 'moetrain.parallel' has no attribute {name!r}")
