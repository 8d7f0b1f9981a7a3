"""Distributed training in 2 processes: expert parallelism plus the MoE-aware optimizer, checked
against one process training on both processes' data.

    python examples/08_distributed_training.py

Gloo on CPUs (or when fewer than 2 GPUs are visible), NCCL with one GPU per process otherwise.
  parallelize(model)          each process keeps half of every MoE layer's experts; tokens reach
                              their expert by all-to-all. Per call, adaptive_r=0 switches to data
                              parallelism and a2a_ffn_overlap_degree=n overlaps the all-to-all
                              with the expert compute in n chunks.
  DistributedOptimizer(...)   wraps any torch optimizer: averages shared gradients over the
                              processes, leaves the experts' (already complete) gradients alone,
                              clips by the global norm, and with zero=True keeps each shared
                              parameter's optimizer state on one process only (ZeRO-1).
"""

import copy
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moetrain import MoELayer
from moetrain.moe import is_expert_param, moe_layers
from moetrain.parallel import DistributedOptimizer, parallelize, spawn

WORLD_SIZE = 2


class TinyMoENet(nn.Module):
    def __init__(self, model_dim: int, num_experts: int, hidden_size: int):
        super().__init__()
        self.embed = nn.Linear(model_dim, model_dim)
        self.moe = MoELayer(model_dim=model_dim, num_experts=num_experts, hidden_size=hidden_size, top_k=2,
                            capacity_factor=1.0, balance_loss_weight=0.01)
        self.head = nn.Linear(model_dim, 1)

    def forward(self, x_TD: torch.Tensor, **moe_call) -> torch.Tensor:
        h_TD = self.embed(x_TD)
        return self.head(h_TD + self.moe(h_TD, **moe_call)).squeeze(-1)


def loss_on(model: nn.Module, x_TD: torch.Tensor) -> torch.Tensor:
    target_T = torch.tanh(x_TD[:, 0] - x_TD[:, 1])  # something to learn
    return F.mse_loss(model(x_TD), target_T) + sum(layer.aux_loss for layer in moe_layers(model))


def batch_of(rank: int, step: int, tokens: int, model_dim: int, device: str) -> torch.Tensor:
    """Each process's own data, reproducible anywhere (the reference rebuilds every process's batch)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(tokens, model_dim, generator=generator).to(device)


def worker(rank: int, world_size: int, out_dir: str, steps: int, tokens: int, model_dim: int, num_experts: int,
           hidden_size: int):
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # spawn() set this process's GPU
    torch.manual_seed(0)  # the same full model on every process
    model = TinyMoENet(model_dim, num_experts, hidden_size).to(device)
    reference = copy.deepcopy(model)  # one process, every expert, both processes' data (the check)
    parallelize(model)  # this process now keeps experts [rank * E/W, (rank + 1) * E/W) only
    local = model.moe.experts.w1.size(0)
    mine = slice(rank * local, (rank + 1) * local)
    report = {"local_experts": local, "forward": {}}

    # 1. Forward: every way of running the experts gives the unsharded layer's output.
    x_TD = batch_of(rank, 0, tokens, model_dim, device)
    with torch.no_grad():
        for label, call in (("expert parallel (r=1)", {}), ("data parallel (r=0)", {"adaptive_r": 0}),
                            ("a2a/FFN overlap, 2 chunks", {"a2a_ffn_overlap_degree": 2}),
                            ("dropless", {"capacity_factor": 0})):
            expected_T = reference(x_TD, capacity_factor=call.get("capacity_factor"))
            report["forward"][label] = (model(x_TD, **call) - expected_T).abs().max().item()

    # 2. Training: each process's loss is the mean over its own batch; the optimizer makes the
    # update equal to one process's update on the mean of all processes' losses.
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), model, max_grad_norm=1.0,
                                     zero=True)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        loss = loss_on(model, batch_of(rank, step, tokens, model_dim, device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        reference_loss = sum(loss_on(reference, batch_of(r, step, tokens, model_dim, device))
                             for r in range(world_size)) / world_size
        reference_optimizer.zero_grad()
        reference_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        reference_optimizer.step()
        losses.append(reference_loss.item())

    reference_params = dict(reference.named_parameters())
    report["max_param_diff"] = max(
        (param - (reference_params[name][mine] if is_expert_param(param) else reference_params[name])).abs().max().item()
        for name, param in model.named_parameters())
    report["losses"] = losses
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


def main(steps=30, tokens=64, model_dim=16, num_experts=4, hidden_size=32):
    backend = "nccl" if torch.cuda.device_count() >= WORLD_SIZE else "gloo"
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(worker, nprocs=WORLD_SIZE, args=(out_dir, steps, tokens, model_dim, num_experts, hidden_size),
              backend=backend)
        reports = [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    print(f"{WORLD_SIZE} processes ({backend}), {num_experts} experts: {reports[0]['local_experts']} per process")
    for label in reports[0]["forward"]:
        print(f"  forward, {label:28} max |difference| from the unsharded layer "
              f"{max(r['forward'][label] for r in reports):.1e}")
    losses = reports[0]["losses"]
    print(f"  training loss {losses[0]:.4f} -> {losses[-1]:.4f} over {steps} steps; parameters differ from "
          f"single-process training by at most {max(r['max_param_diff'] for r in reports):.1e}")
    return {"backend": backend, "ranks": reports}


if __name__ == "__main__":
    main()
