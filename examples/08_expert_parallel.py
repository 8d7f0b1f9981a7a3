"""Expert parallelism in 2 processes: each process holds half of the experts, tokens travel by
all-to-all, and the result equals the unsharded layer's.

    python examples/08_expert_parallel.py

Gloo on CPUs (or when fewer than 2 GPUs are visible), NCCL with one GPU per process otherwise.
moetrain.parallel.parallelize(model) shards every MoELayer's experts over the ranks; per call,
adaptive_r=0 switches to data parallelism (every rank gathers all experts) and
a2a_ffn_overlap_degree=n cuts the all-to-all into n chunks that overlap with the expert compute.
"""

import copy
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from moetrain import MoELayer
from moetrain.parallel import parallelize, spawn

WORLD_SIZE = 2


def worker(rank: int, world_size: int, out_dir: str, tokens: int, model_dim: int, num_experts: int, hidden_size: int):
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # spawn() set the GPU of this rank
    torch.manual_seed(0)  # the same full layer on every rank
    layer = MoELayer(model_dim=model_dim, num_experts=num_experts, hidden_size=hidden_size, top_k=2,
                     capacity_factor=1.0).to(device)
    reference = copy.deepcopy(layer)  # unsharded: every expert, run locally (the check)
    parallelize(layer)  # now this rank keeps experts [rank * E/W, (rank + 1) * E/W) only
    torch.manual_seed(100 + rank)  # every rank has its own tokens
    x_TD = torch.randn(tokens, model_dim, device=device)

    report = {"local_experts": layer.experts.w1.size(0)}
    for label, call in (("expert parallel (r=1)", {}),
                        ("data parallel (r=0)", {"adaptive_r": 0}),
                        ("a2a/FFN overlap, 2 chunks", {"a2a_ffn_overlap_degree": 2}),
                        ("dropless", {"capacity_factor": 0})):
        y_TD = layer(x_TD, **call)
        expected_TD = reference(x_TD, capacity_factor=call.get("capacity_factor"))
        report[label] = (y_TD - expected_TD).abs().max().item()

    # Gradients: a local expert's gradient is the sum over ALL ranks' tokens routed to it, so it
    # equals the all-reduced reference gradient of that expert. The gate is replicated: its
    # gradient here covers this rank's tokens only and still needs an all-reduce across ranks
    # (which the MoE-aware optimizer does, and skips for expert parameters).
    layer(x_TD).square().sum().backward()
    reference(x_TD).square().sum().backward()
    full_grad = reference.experts.w1.grad.clone()
    dist.all_reduce(full_grad)
    mine = slice(rank * report["local_experts"], (rank + 1) * report["local_experts"])
    report["expert grad vs all-reduced reference"] = (layer.experts.w1.grad - full_grad[mine]).abs().max().item()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


def main(tokens=64, model_dim=16, num_experts=4, hidden_size=32):
    backend = "nccl" if torch.cuda.device_count() >= WORLD_SIZE else "gloo"
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(worker, nprocs=WORLD_SIZE, args=(out_dir, tokens, model_dim, num_experts, hidden_size), backend=backend)
        reports = [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    print(f"{WORLD_SIZE} processes ({backend}), {num_experts} experts: {reports[0]['local_experts']} per process")
    for key in reports[0]:
        if key != "local_experts":
            print(f"  {key:38} max |difference| over ranks {max(r[key] for r in reports):.2e}")
    return {"backend": backend, "ranks": reports}


if __name__ == "__main__":
    main()
