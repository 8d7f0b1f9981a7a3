"""Expert-parallel training throughput: N GPUs against one, with and without all-to-all overlap,
and with tokens exchanged by NCCL's all-to-all or through peer memory.

    python benchmarks/expert_parallel.py --gpus 2
    python benchmarks/expert_parallel.py --gpus 2 --layers 4 --dim 2048 --hidden 8192 --experts 16
    python benchmarks/expert_parallel.py --gpus 2 --overlap 1 --exchange all_to_all
    python benchmarks/expert_parallel.py --gpus 2 --expert swiglu --capacity-factor 0   # dropless SwiGLU
    python benchmarks/expert_parallel.py --gpus 2 --expert swiglu --capacity-factor 0 --precision fp8

The model is a stack of pre-norm residual MoE blocks (x + MoE(LayerNorm(x))), so MoE layers are
nearly all of the work; bf16 weights and activations, fp32 router. The experts are two-matrix FFNs
in the padded layout (capacity factor 1) unless --expert swiglu and --capacity-factor 0 (dropless:
packed rows, exchanged unchunked by all-to-all) say otherwise. --precision fp8 or fp8_block runs
the expert GEMMs in FP8 (MoELayer(precision=...)); dropless, the tokens then travel as E4M3 rows
(moetrain.parallel.expert). --device cpu runs the same on CPU
processes over Gloo in fp32 (a check of the code path, not a figure). Every GPU processes --tokens
tokens per step (weak scaling): one GPU holds all experts, N GPUs hold experts/N each and exchange
tokens by all-to-all. A step is forward, backward and the optimizer step (SGD, through
DistributedOptimizer on N GPUs). Step time is the median of --steps timed steps after warm-up,
timed with CUDA events; throughput is tokens per second over all GPUs, and speedup is N-GPU
throughput over one-GPU throughput (N is ideal). The N-GPU rows: exchange="all_to_all" at every
--overlap degree, then exchange="peer_memory" (unchunked; see moetrain.parallel.expert). One
exchange of the benchmark's [E, C, D] buffer is also timed alone, by NCCL and through peer memory,
with a local copy of it for scale: the link's rate apart from whatever else a step does.

--profile adds one more step per setup under torch.profiler (rank 0's view) and prints where its
GPU time went: the forward / backward / optimizer spans (CUDA events), kernel time by kind (GEMMs, NCCL, of
which NCCL with no other kernel running, copies, the rest), GPU idle, the slowest kernels, and the
host syncs torch reports for that step (torch.cuda.set_sync_debug_mode) with where they came from.
A setup that fails prints its error in its row; the other rows still run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist
from torch import nn

from moetrain import MoELayer, collectives
from moetrain.parallel.expert import EXCHANGES, parallelize
from moetrain.parallel.launch import spawn
from moetrain.parallel.optimizer import DistributedOptimizer
from moetrain.precision.fp8_matmul import fp8_supported
from moetrain.precision.recipes import PRECISIONS
from moetrain.timing import median_ms


class MoEStack(nn.Module):
    def __init__(self, layers: int, dim: int, hidden: int, experts: int, top_k: int, impl: str,
                 expert: str = "ffn", capacity_factor: float = 1.0, precision: str = "bf16"):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.moes = nn.ModuleList(MoELayer(dim, experts, hidden, top_k=top_k, capacity_factor=capacity_factor,
                                           expert=expert, impl=impl, precision=precision)
                                  for _ in range(layers))

    def forward(self, x_TD: torch.Tensor, **kwargs) -> torch.Tensor:
        for norm, moe in zip(self.norms, self.moes):
            x_TD = x_TD + moe(norm(x_TD), **kwargs)
        return x_TD


def _dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.device == "cuda" else torch.float32


def _unit(args) -> str:
    """What a process runs on, for the printed rows."""
    return "GPU" if args.device == "cuda" else "rank"


def _build(args) -> MoEStack:
    torch.manual_seed(0)
    model = MoEStack(args.layers, args.dim, args.hidden, args.experts, args.top_k, args.impl, args.expert,
                     args.capacity_factor, args.precision)
    return model.to(args.device, _dtype(args))


def _tokens(args) -> torch.Tensor:
    gen = torch.Generator(device=args.device).manual_seed(1 + (dist.get_rank() if dist.is_initialized() else 0))
    return torch.randn(args.tokens, args.dim, device=args.device, dtype=_dtype(args), generator=gen)


def _time_steps(model, optimizer, args, **call) -> float:
    """Median seconds per training step (each step waited for: the ranks stay in step)."""
    x_TD = _tokens(args)

    def step():
        optimizer.zero_grad()
        model(x_TD, **call).float().square().mean().backward()
        optimizer.step()

    return median_ms(step, args.device, warmup=args.warmup, steps=args.steps, sync_each=True) / 1e3


# ---------------------------------------------------------------------- one profiled step


def _kind(name: str) -> str:
    lower = name.lower()
    if "nccl" in lower:
        return "nccl"
    if re.search(r"gemm|nvjet|cutlass|xmma|cublas", lower):
        return "gemm"
    if re.search(r"copy|memcpy|catarray", lower):
        return "copy"
    return "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _breakdown(events: list[dict]) -> dict:
    """Milliseconds of GPU time by kind from a chrome trace's events."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        return {"error": "the trace has no GPU kernels"}
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in kernels:
        by_kind[_kind(e["name"])] = by_kind.get(_kind(e["name"]), 0.0) + e["dur"]
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"]
    busy = _union_us(spans)
    busy_without_nccl = _union_us([span for span, e in zip(spans, kernels) if _kind(e["name"]) != "nccl"])
    top = sorted(by_name.items(), key=lambda item: -item[1])[:6]
    return {
        "span_ms": (max(end for _, end in spans) - min(start for start, _ in spans)) / 1e3,
        **{f"{kind}_ms": by_kind.get(kind, 0.0) / 1e3 for kind in ("gemm", "nccl", "copy", "other")},
        "nccl_alone_ms": (busy - busy_without_nccl) / 1e3,
        "idle_ms": (max(end for _, end in spans) - min(start for start, _ in spans) - busy) / 1e3,
        "top": [(name[:90], ms / 1e3) for name, ms in top],
    }


def _profile_step(model, optimizer, args, **call) -> dict:
    """One training step under torch.profiler, its phases timed by CUDA events (the backward runs
    on autograd's own thread, outside any range the main thread opens), and the host syncs torch
    reports during it."""
    x_TD = _tokens(args)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    # The timed steps leave their gradients behind; a backward onto them would add an
    # accumulation pass over every gradient that no timed step has.
    optimizer.zero_grad()
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profiler:
            torch.cuda.set_sync_debug_mode("warn")
            try:
                marks[0].record()
                loss = model(x_TD, **call).float().square().mean()
                marks[1].record()
                loss.backward()
                marks[2].record()
                optimizer.step()
                marks[3].record()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as file:
            summary = _breakdown(json.load(file)["traceEvents"])
    summary["phases_ms"] = {phase: start.elapsed_time(end) for phase, start, end
                            in zip(("forward", "backward", "optimizer"), marks, marks[1:])}
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    summary["syncs"] = len(syncs)
    summary["sync_sites"] = sorted({f"{os.path.relpath(w.filename)}:{w.lineno}" for w in syncs})
    return summary


def _run_row(measure) -> dict:
    """Time (and profile) one setup; an error is reported in the row instead of ending the run."""
    try:
        return measure()
    except Exception as error:  # noqa: BLE001 - any failure of a row is reported, the next row still runs
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc(limit=6)}


def _measure(model, optimizer, args, **call) -> dict:
    row = {"step_s": _time_steps(model, optimizer, args, **call)}
    if dist.is_initialized():  # the slowest rank sets the pace
        slowest = torch.tensor([row["step_s"]], device=args.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        row["step_s"] = slowest.item()
    if args.profile:
        row["profile"] = _profile_step(model, optimizer, args, **call)
    return row


def _median_ms(run, device: str, repeats: int = 20, warmup: int = 5) -> float:
    return median_ms(run, device, warmup=warmup, steps=repeats, sync_each=True)


def _time_exchange(args, peer_memory: bool) -> dict:
    """One [E, C, D] exchange of the benchmark's shape (each MoE layer makes 4 a step) on its own,
    median of 20: NCCL's all_to_all_single, a local copy of the buffer for scale, or (peer_memory)
    collectives.PeerMemoryExchange's expert-major regrouping exchange. With --precision fp8 or
    fp8_block and dropless experts also the same rows as the FP8 path sends them: E4M3 bytes and
    fp32 scales (D + 4 or D + 4 D/128 bytes a row)."""
    experts, capacity = args.experts, args.tokens * args.top_k // args.experts
    x = torch.randn(experts, capacity, args.dim, device=args.device, dtype=_dtype(args))
    mbytes = x.numel() * x.element_size() / 1e6
    if peer_memory:
        exchange = collectives.PeerMemoryExchange()
        return {"mbytes": mbytes, "peer_memory_ms": _median_ms(lambda: exchange.exchange(x, 0, 1), args.device)}
    out = torch.empty_like(x)
    timings = {"mbytes": mbytes, "all_to_all_ms": _median_ms(lambda: dist.all_to_all_single(out, x), args.device),
               "copy_ms": _median_ms(lambda: out.copy_(x), args.device)}
    # Each rank keeps 1/W of the buffer and sends the rest, (W-1)/W of it, to the other ranks.
    world = dist.get_world_size()
    timings["sent_gb_per_s"] = mbytes * (world - 1) / world / timings["all_to_all_ms"]
    if args.precision != "bf16" and args.capacity_factor == 0:  # FP8 rows travel in the dropless layout only
        scales = 1 if args.precision == "fp8" else -(-args.dim // 128)
        packed = torch.zeros(experts * capacity, args.dim + 4 * scales, device=args.device, dtype=torch.uint8)
        arrived = torch.empty_like(packed)
        timings["fp8_mbytes"] = packed.numel() / 1e6
        timings["fp8_all_to_all_ms"] = _median_ms(lambda: dist.all_to_all_single(arrived, packed), args.device)
    return timings


def _single_gpu(args) -> dict:
    model = _build(args)
    return _measure(model, torch.optim.SGD(model.parameters(), lr=1e-6), args)


def _setups(args) -> list[tuple[str, int]]:
    """(exchange, overlap degree) of each N-GPU row: the all-to-all at every degree, then peer
    memory unchunked (it has no chunked form) last, so that a failure there costs no other row."""
    setups = [("all_to_all", degree) for degree in args.overlap] if "all_to_all" in args.exchange else []
    return setups + ([("peer_memory", 1)] if "peer_memory" in args.exchange else [])


def _multi_gpu(rank: int, world: int, args, out_path: str) -> None:
    model = _build(args)
    expert_parallel_layers = parallelize(model, adaptive_r=1)  # each MoE layer's ExpertParallel
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-6), model)
    results = {}

    def record(key, row):  # rank 0 writes (and prints) every row at once: rows done survive a crash or hang
        results[key] = row
        if rank == 0:
            with open(out_path, "w") as file:
                json.dump(results, file)
            done = f"{row['step_s'] * 1e3:.2f} ms a step" if "step_s" in row else row.get("error") or json.dumps(row)
            print(f"  {world} {_unit(args)}s, {key}: {done}", flush=True)

    record("exchange", _run_row(lambda: _time_exchange(args, peer_memory=False)))
    for exchange, degree in _setups(args):
        for expert_parallel in expert_parallel_layers:
            expert_parallel.exchange = exchange
        row = _run_row(lambda: _measure(model, optimizer, args, a2a_ffn_overlap_degree=degree))
        record(f"{exchange}:{degree}", row)
    if "peer_memory" in args.exchange:
        record("peer exchange", _run_row(lambda: _time_exchange(args, peer_memory=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/expert_parallel.py", description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per GPU per step")
    parser.add_argument("--expert", choices=("ffn", "swiglu"), default="ffn",
                        help="two-matrix ReLU FFN experts, or SwiGLU experts (three matrices, no biases)")
    parser.add_argument("--capacity-factor", type=float, default=1.0,
                        help="the padded layout's capacity factor; 0 = dropless (packed rows)")
    parser.add_argument("--overlap", type=lambda text: [int(v) for v in text.split(",")], default=None,
                        help="a2a_ffn_overlap_degree values, comma-separated (1 = no overlap; default 1,2,4, "
                             "dropless 1)")
    parser.add_argument("--exchange", type=lambda text: text.split(","), default=None,
                        help="how tokens travel, comma-separated: all_to_all (NCCL, at every --overlap degree) "
                             "and/or peer_memory (symmetric memory over NVLink, unchunked; padded layout on "
                             "GPUs only); default both, dropless or --device cpu all_to_all")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16",
                        help="the expert GEMMs' precision (MoELayer(precision=...); fp8 needs sm90+ on GPUs)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--impl", choices=("kernel", "torch"), default="kernel", help="dispatch/combine implementation")
    parser.add_argument("--profile", action="store_true", help="also profile one step per setup (see above)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: --gpus CPU processes over Gloo, fp32 (checks the code path; no figures)")
    args = parser.parse_args(argv)
    dropless = args.capacity_factor == 0
    if args.capacity_factor < 0:
        parser.error(f"--capacity-factor must be >= 0 (0 = dropless), got {args.capacity_factor:g}")
    args.overlap = args.overlap or ([1] if dropless else [1, 2, 4])
    args.exchange = args.exchange or (["all_to_all"] if dropless or args.device == "cpu" else ["all_to_all",
                                                                                               "peer_memory"])
    unknown = sorted(set(args.exchange) - set(EXCHANGES))
    if unknown:
        parser.error(f"--exchange takes {', '.join(EXCHANGES)}; got {', '.join(unknown)}")
    if dropless and (max(args.overlap) > 1 or "peer_memory" in args.exchange):
        parser.error("--capacity-factor 0 (dropless) is exchanged unchunked by all_to_all: use --overlap 1 and "
                     "--exchange all_to_all")
    if args.device == "cpu" and ("peer_memory" in args.exchange or args.profile):
        parser.error("--device cpu runs over Gloo: --exchange peer_memory and --profile need GPUs")
    if args.device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < args.gpus):
        parser.error(f"needs {args.gpus} CUDA GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}"
                     " (--device cpu runs the code path on CPU processes)")
    if args.precision != "bf16":
        supported, where = fp8_supported(torch.device(args.device), args.precision)
        if not supported:
            parser.error(f"--precision {args.precision} cannot run on {where}: use --precision bf16")

    single = _run_row(lambda: _single_gpu(args))
    unit = _unit(args)
    print(f"  1 {unit}: {single['step_s'] * 1e3:.2f} ms a step" if "step_s" in single else f"  1 {unit}: {single['error']}",
          flush=True)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as folder:
        out_path = os.path.join(folder, "multi.json")
        crash = None
        try:
            spawn(_multi_gpu, args.gpus, args=(args, out_path), backend="nccl" if args.device == "cuda" else "gloo")
        except Exception as error:  # noqa: BLE001 - still print the rows finished before it
            crash = {"error": f"workers failed: {type(error).__name__}: {str(error)[-400:]}"}
        multi = {}
        if os.path.exists(out_path):
            with open(out_path) as file:
                multi = json.load(file)
    missing = crash or {"error": "the workers wrote no result for it"}
    exchange, peer_exchange = multi.pop("exchange", missing), multi.pop("peer exchange", missing)
    labels = {"all_to_all": "EP a2a", "peer_memory": "EP peer"}
    rows = [(f"1 {unit}", 1, None, single)] + [(f"{args.gpus} {unit}s {labels[name]}", args.gpus, degree,
                                            multi.get(f"{name}:{degree}", missing))
                                           for name, degree in _setups(args)]
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"device": device_name, "torch": torch.__version__, "config": vars(args), "runs": []}
    _print_table(rows, args, report)
    peer = peer_exchange if "peer_memory" in args.exchange else {}
    report["exchange"] = {**exchange, **{f"peer {key}": value for key, value in peer.items()}}
    if "all_to_all_ms" in exchange:
        print(f"one exchange alone ({exchange['mbytes']:.0f} MB all_to_all_single, median of 20): "
              f"{exchange['all_to_all_ms']:.3f} ms, {exchange['sent_gb_per_s']:.0f} GB/s sent to the other ranks; "
              f"a local copy of it {exchange['copy_ms']:.3f} ms")
    else:
        print(f"one exchange alone: FAILED {exchange.get('error')}")
    if "fp8_all_to_all_ms" in exchange:
        print(f"the same rows as {args.precision} sends them ({exchange['fp8_mbytes']:.0f} MB of E4M3 values and "
              f"scales): {exchange['fp8_all_to_all_ms']:.3f} ms")
    if "peer_memory" in args.exchange:
        if "peer_memory_ms" in peer_exchange:
            print(f"the same through peer memory, regrouped expert-major: {peer_exchange['peer_memory_ms']:.3f} ms")
        else:
            print(f"the same through peer memory: FAILED {peer_exchange.get('error')}")
    if args.profile:
        _print_profiles(rows)
    print(json.dumps(report))
    return 0


def _print_table(rows, args, report) -> None:
    matmuls = 3 if args.expert == "swiglu" else 2
    flop_per_token = args.layers * args.top_k * args.dim * args.hidden * matmuls * 2 * 3
    base = args.tokens / rows[0][3]["step_s"] if "step_s" in rows[0][3] else None
    print(f"{'setup':14s} {'overlap':>7s} {'step ms':>9s} {'tokens/s':>12s} {'expert TFLOP/s/GPU':>19s} {'speedup':>8s}")
    for name, gpus, degree, row in rows:
        label = f"{name:14s} {degree if degree else '-':>7}"
        if "step_s" not in row:
            print(f"{label} FAILED {row['error']}")
            print("".join(f"    {line}\n" for line in row.get("traceback", "").splitlines()[-6:]), end="")
            report["runs"].append({"setup": name, "gpus": gpus, "overlap": degree, **row})
            continue
        seconds = row["step_s"]
        throughput = args.tokens * gpus / seconds
        tflops = args.tokens * flop_per_token / seconds / 1e12
        speedup = throughput / base if base else float("nan")
        print(f"{label} {seconds * 1e3:9.2f} {throughput:12.0f} {tflops:19.1f} {speedup:8.2f}")
        report["runs"].append({"setup": name, "gpus": gpus, "overlap": degree, "step_s": seconds,
                               "tokens_per_s": throughput, "expert_tflops_per_gpu": tflops, "speedup": speedup,
                               "profile": row.get("profile")})


def _print_profiles(rows) -> None:
    print("\none profiled step, rank 0, GPU milliseconds (NCCL alone: no other kernel running; syncs: host syncs)")
    columns = ("span", "fwd", "bwd", "optim", "GEMM", "NCCL", "alone", "copies", "other", "idle", "syncs")
    print(f"{'setup':14s} {'overlap':>7s} " + " ".join(f"{column:>7s}" for column in columns))
    for name, _, degree, row in rows:
        profile = row.get("profile") or {}
        label = f"{name:14s} {degree if degree else '-':>7}"
        if "span_ms" not in profile:
            print(f"{label} no profile: {profile.get('error') or row.get('error')}")
            continue
        phases = profile.get("phases_ms", {})
        values = [profile["span_ms"], phases.get("forward", float("nan")), phases.get("backward", float("nan")),
                  phases.get("optimizer", float("nan")), profile["gemm_ms"], profile["nccl_ms"],
                  profile["nccl_alone_ms"], profile["copy_ms"], profile["other_ms"], profile["idle_ms"]]
        print(f"{label} " + " ".join(f"{value:7.2f}" for value in values) + f" {profile['syncs']:7d}")
    for name, _, degree, row in rows:
        profile = row.get("profile") or {}
        if "top" in profile:
            print(f"{name}, overlap {degree or '-'}: syncs at {profile['sync_sites'] or 'none'}")
            for kernel, ms in profile["top"]:
                print(f"    {ms:7.2f} ms  {kernel}")


if __name__ == "__main__":
    sys.exit(main())
