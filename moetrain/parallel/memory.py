"""Training-state bytes per rank under each parallel strategy, and peak memory of a step.

    python -m moetrain.parallel.memory                                   # qwen3_moe_tiny, W = 1, 2, 4, CPU/Gloo
    python -m moetrain.parallel.memory --preset moe_1b5 --world-sizes 1 2 4 8 --strategies fsdp fsdp_expert
    python -m moetrain.parallel.memory --preset moe_1b5 --world-sizes 1 --strategies fsdp --cpu-offload --mixed-precision

For each world size W and parallel strategy, W processes (Gloo on CPUs, NCCL when there are W GPUs)
build the model, lay it out (moetrain.parallel.processes.Distributed), take --steps training steps (forward,
backward, AdamW) on random tokens and report, per rank (the largest over ranks):

  params      bytes of the parameters this rank stores (its shards: DTensor local tensors);
  grads       bytes of their gradients after the step's backward;
  optimizer   bytes of the optimizer state (AdamW: two moments and a step count per parameter);
  total       their sum: under fsdp it falls as 1/W (plus the padding of uneven shards);
  peak        the peak memory of one step: torch.cuda.max_memory_allocated on a GPU, the growth
              of the process's peak resident set during the steps on a CPU (allocator-dependent:
              a rough figure, reported as such).

--cpu-offload and --mixed-precision (fsdp and fsdp_expert only) are parallel.cpu_offload and
parallel.mixed_precision: with the first, the state counted above lives in host memory and the peak
is what the GPU still needs.

W = 1 rows run the same strategy code on one rank. A strategy that cannot run at some W (experts
that do not divide over the ranks) prints its error in its row.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moetrain.config import ParallelStrategy

STRATEGIES = tuple(strategy.value for strategy in ParallelStrategy)


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state (its shards only)."""
    params = list(model.parameters())
    inner = getattr(optimizer, "optimizer", optimizer)  # DistributedOptimizer wraps the torch optimizer
    moments = sum(_local_bytes(value) for entry in inner.state.values() for value in entry.values()
                  if isinstance(value, torch.Tensor))
    return {"params": sum(_local_bytes(p) for p in params), "grads": sum(_local_bytes(p.grad) for p in params),
            "optimizer": moments}


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure(strategy: str, preset: str, batch: int, seq_len: int, steps: int, device: torch.device,
            overrides: dict | None = None, settings: dict | None = None) -> dict:
    """One rank's figures (call on every rank of an initialised process group). settings: more
    ParallelConfig fields (cpu_offload, mixed_precision)."""
    from moetrain.config import OptimConfig, ParallelConfig
    from moetrain.models import build_lm
    from moetrain.moe import moe_layers
    from moetrain.parallel.processes import Distributed

    torch.manual_seed(0)
    with device:  # built where it trains: no host copy of the whole model first
        model = build_lm(preset, max_seq_len=seq_len, **(overrides or {}))
    vocab = model.config.vocab_size
    processes = Distributed(ParallelConfig(nproc_per_node=dist.get_world_size(), strategy=strategy, **(settings or {})))
    optimizer = processes.build_optimizer(model, OptimConfig(lr=1e-4))
    generator = torch.Generator().manual_seed(dist.get_rank())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = _peak_rss_bytes()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator).to(device)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss = loss + sum(layer.aux_loss for layer in moe_layers(model))
        loss.backward()
        processes.reduce_gradients(model)
        processes.clip_grad_norm_(model, 1.0)
        optimizer.step()
    figures = state_bytes(model, optimizer)
    figures["total"] = sum(figures.values())
    if device.type == "cuda":
        figures["peak"], figures["peak_kind"] = torch.cuda.max_memory_allocated(device), "cuda max allocated"
    else:
        figures["peak"], figures["peak_kind"] = _peak_rss_bytes() - rss_before, "CPU peak RSS growth"
    return figures


def worker(rank: int, world_size: int, out_dir: str, strategies: list[str], preset: str, batch: int, seq_len: int,
           steps: int, overrides: dict, settings: dict) -> None:
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    rows = {}
    for strategy in strategies:
        try:
            figures = measure(strategy, preset, batch, seq_len, steps, device, overrides, settings)
        except Exception as error:  # a strategy this W cannot run: its row says why, the others still run
            figures = {"error": f"{type(error).__name__}: {' '.join(str(error).split())[:120]}"}
        everyone = [None] * world_size
        dist.all_gather_object(everyone, figures)
        rows[strategy] = everyone
    if rank == 0:
        torch.save(rows, os.path.join(out_dir, "memory.pt"))


def run(world_sizes: list[int], strategies: list[str], preset: str = "qwen3_moe_tiny", batch: int = 2,
        seq_len: int = 32, steps: int = 2, overrides: dict | None = None, backend: str | None = None,
        settings: dict | None = None) -> dict:
    """{(W, strategy): largest figures over the ranks (or {"error": ...})}. settings: ParallelConfig
    fields for every strategy (cpu_offload, mixed_precision: fsdp strategies only)."""
    from moetrain.parallel.launch import spawn

    table = {}
    for world in world_sizes:
        with tempfile.TemporaryDirectory() as out_dir:
            spawn(worker, world, args=(out_dir, list(strategies), preset, batch, seq_len, steps, overrides or {},
                                       settings or {}), backend=backend)
            rows = torch.load(os.path.join(out_dir, "memory.pt"), weights_only=False)
        for strategy, ranks in rows.items():
            failed = next((figures for figures in ranks if "error" in figures), None)
            table[(world, strategy)] = failed or {key: max(figures[key] for figures in ranks) if key != "peak_kind"
                                                else ranks[0][key] for key in ranks[0]}
    return table


def format_table(table: dict) -> str:
    mib = 2.0 ** 20
    lines = ["| strategy | W | params MiB/rank | grads MiB/rank | optimizer MiB/rank | total MiB/rank | peak MiB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    order = sorted(table.items(), key=lambda item: (STRATEGIES.index(item[0][1]), item[0][0]))
    for (world, strategy), figures in order:
        if "error" in figures:
            lines.append(f"| {strategy} | {world} | {figures['error']} | | | | |")
            continue
        lines.append(f"| {strategy} | {world} | {figures['params'] / mib:.2f} | {figures['grads'] / mib:.2f} | "
                     f"{figures['optimizer'] / mib:.2f} | {figures['total'] / mib:.2f} | {figures['peak'] / mib:.1f} |")
    kinds = {figures["peak_kind"] for figures in table.values() if "peak_kind" in figures}
    return "\n".join(lines + [f"peak: {', '.join(sorted(kinds))}"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moetrain.parallel.memory", description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--preset", default="qwen3_moe_tiny", help="a model preset (moetrain.models.PRESETS)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: NCCL with GPUs, else Gloo")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="parallel.cpu_offload: the state waits in host memory (fsdp strategies)")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="parallel.mixed_precision: bf16 compute, fp32 state and reductions (fsdp strategies)")
    args = parser.parse_args(argv)
    settings = {name: True for name in ("cpu_offload", "mixed_precision") if getattr(args, name)}
    not_fsdp = [name for name in args.strategies if name not in ("fsdp", "fsdp_expert")]
    if settings and not_fsdp:
        flags = " ".join("--" + name.replace("_", "-") for name in settings)
        parser.error(f"{flags} applies to the fsdp strategies, not {' '.join(not_fsdp)}: "
                     "add --strategies fsdp fsdp_expert")
    for name in ("batch", "seq_len", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(world < 1 for world in args.world_sizes):
        parser.error(f"--world-sizes must be >= 1, got {args.world_sizes}")
    from moetrain.models import PRESETS

    if args.preset not in PRESETS:
        parser.error(f"--preset must be one of {', '.join(sorted(PRESETS))}, got {args.preset}")
    from moetrain.parallel.launch import WorkerFailed

    try:
        table = run(args.world_sizes, args.strategies, args.preset, args.batch, args.seq_len, args.steps,
                    backend=args.backend, settings=settings)
    except WorkerFailed as failure:  # a worker killed (host memory) or hung: one line, not a traceback
        sys.exit(f"python -m moetrain.parallel.memory: {failure.failed.describe()}")
    print(format_table(table))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
