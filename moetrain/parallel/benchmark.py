"""Expert-parallel training throughput: N GPUs against one, with and without all-to-all overlap.

    python -m moetrain.parallel.benchmark --gpus 2
    python -m moetrain.parallel.benchmark --gpus 2 --layers 4 --dim 2048 --hidden 8192 --experts 16

The model is a stack of pre-norm residual MoE blocks (x + MoE(LayerNorm(x))), so MoE layers are
nearly all of the work; bf16 weights and activations, fp32 router. Every GPU processes --tokens
tokens per step (weak scaling): one GPU holds all experts, N GPUs hold experts/N each and exchange
tokens by all-to-all. A step is forward, backward and the optimizer step (SGD, through
DistributedOptimizer on N GPUs). Step time is the median of --steps timed steps after warm-up,
timed with CUDA events; throughput is tokens per second over all GPUs, and speedup is N-GPU
throughput over one-GPU throughput (N is ideal).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from moetrain import MoELayer
from moetrain.parallel.expert import parallelize
from moetrain.parallel.launch import spawn
from moetrain.parallel.optimizer import DistributedOptimizer


class MoEStack(nn.Module):
    def __init__(self, layers: int, dim: int, hidden: int, experts: int, top_k: int, impl: str):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.moes = nn.ModuleList(MoELayer(dim, experts, hidden, top_k=top_k, capacity_factor=1.0, impl=impl)
                                  for _ in range(layers))

    def forward(self, x_TD: torch.Tensor, **kwargs) -> torch.Tensor:
        for norm, moe in zip(self.norms, self.moes):
            x_TD = x_TD + moe(norm(x_TD), **kwargs)
        return x_TD


def _build(args) -> MoEStack:
    torch.manual_seed(0)
    return MoEStack(args.layers, args.dim, args.hidden, args.experts, args.top_k, args.impl).cuda().to(torch.bfloat16)


def _time_steps(model, optimizer, args, **call) -> float:
    """Median seconds per training step."""
    gen = torch.Generator(device="cuda").manual_seed(1 + (dist.get_rank() if dist.is_initialized() else 0))
    x_TD = torch.randn(args.tokens, args.dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    times = []
    for step in range(args.warmup + args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        optimizer.zero_grad()
        model(x_TD, **call).float().square().mean().backward()
        optimizer.step()
        end.record()
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _multi_gpu(rank: int, world: int, args, out_path: str) -> None:
    model = _build(args)
    parallelize(model, adaptive_r=1)
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-6), model)
    results = {}
    for degree in args.overlap:
        seconds = _time_steps(model, optimizer, args, a2a_ffn_overlap_degree=degree)
        # The slowest rank sets the pace.
        slowest = torch.tensor([seconds], device="cuda")
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        results[degree] = slowest.item()
    if rank == 0:
        with open(out_path, "w") as file:
            json.dump(results, file)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moetrain.parallel.benchmark", description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per GPU per step")
    parser.add_argument("--overlap", type=lambda text: [int(v) for v in text.split(",")], default=[1, 2, 4],
                        help="a2a_ffn_overlap_degree values, comma-separated (1 = no overlap)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--impl", choices=("kernel", "torch"), default="kernel", help="dispatch/combine implementation")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.gpus:
        parser.error(f"needs {args.gpus} CUDA GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}")

    model = _build(args)
    single = _time_steps(model, torch.optim.SGD(model.parameters(), lr=1e-6), args)
    del model
    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as folder:
        out_path = os.path.join(folder, "multi.json")
        spawn(_multi_gpu, args.gpus, args=(args, out_path), backend="nccl")
        with open(out_path) as file:
            multi = {int(degree): seconds for degree, seconds in json.load(file).items()}

    flop_per_token = args.layers * args.top_k * args.dim * args.hidden * 2 * 2 * 3
    rows = [("1 GPU", 1, None, single)] + [(f"{args.gpus} GPUs EP", args.gpus, degree, seconds)
                                           for degree, seconds in multi.items()]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": vars(args), "runs": []}
    print(f"{'setup':14s} {'overlap':>7s} {'step ms':>9s} {'tokens/s':>12s} {'expert TFLOP/s/GPU':>19s} {'speedup':>8s}")
    base = args.tokens / single
    for name, gpus, degree, seconds in rows:
        throughput = args.tokens * gpus / seconds
        tflops = args.tokens * flop_per_token / seconds / 1e12
        print(f"{name:14s} {degree if degree else '-':>7} {seconds * 1e3:9.2f} {throughput:12.0f} {tflops:19.1f} "
              f"{throughput / base:8.2f}")
        report["runs"].append({"setup": name, "gpus": gpus, "overlap": degree, "step_s": seconds,
                               "tokens_per_s": throughput, "speedup": throughput / base})
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
