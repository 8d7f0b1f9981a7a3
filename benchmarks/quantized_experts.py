"""Quantized MoE inference benchmark: one MoE layer per format, decode- and prefill-style batches.

    python benchmarks/quantized_experts.py                       # GPU: mixtral and fine-grained shapes
    python benchmarks/quantized_experts.py --shapes small --device cpu --iters 2    # a quick CPU smoke run
    python benchmarks/quantized_experts.py --json results.json
    python benchmarks/quantized_experts.py --kernels             # GPU: one weight's GEMM on every path
    python benchmarks/quantized_experts.py --training-quantizers # each FP8 training quantizer alone
    python benchmarks/quantized_experts.py --training-gemms      # each expert GEMM in bf16, fp8, fp8_block, torchao

For every format (bf16 = the float MoELayer in bf16, the baseline) it prints the expert-weight
memory, the GEMM path taken for decode and for prefill (moetrain.quant.matmul.cuda_path), the
forward time of the whole layer and of the experts alone (median of --iters calls after warm-up,
timed with CUDA events; no grad), the output's relative error against bf16, and the largest
relative difference of the device paths against the fp32 emulation on one expert matrix (with
decode- and prefill-sized row counts).
Dispatch and combine use the pure-torch path so that no compiled extension is needed.

--training-quantizers instead times each quantizer of FP8 training (moetrain.precision.fp8_quantize) alone
on the expert rows of the LM benchmark shapes (x [R, D] and dy [R, 2H] bf16, w [E, D, 2H] fp32, and
the gate-up and down weights in bf16 as `trainer.param_dtype=bfloat16` trains them, equal rows per
expert), and the gather of the FP8 token rows into the expert layout (top-2): milliseconds, and
GB/s of the bytes each must move at least (reads and writes; the per-expert column quantizers and
the forward's transposing weight quantizer read their input twice, once for the maxima), beside a
copy of x for scale. Each is timed on the GPU alone (moetrain.timing.graph_median_ms: 20 calls in one
CUDA graph, replayed), as a training step runs them, its host ahead of the GPU: timed call by call,
these kernels, shorter than their launch from Python, would count the host's time too.

--training-gemms instead times each expert GEMM of those shapes (gate-up and down, forward and both
backward GEMMs, equal rows per expert) on every training path: bf16 (torch._grouped_mm), moetrain's
fp8 and fp8_block with their quantization, and torchao's FP8 row-wise MoE recipe
(torchao.prototype.moe_training) where torchao is installed: a peer measured beside ours, not a
dependency.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from moetrain import MoELayer, ops, timing
from moetrain.moe.routing import make_plan
from moetrain.quant.experts import QuantizedExperts
from moetrain.quant.export import expert_memory
from moetrain.precision import kernels
from moetrain.precision.formats import get_format, quantize_fp8_groups
from moetrain.precision.recipes import FP8_PRECISIONS
from moetrain.quant.experts import QuantizedWeight
from moetrain.quant.matmul import ExpertInput, ExpertRows, cuda_matmul, cuda_path, emulated_matmul

# name: (model_dim, hidden_size, num_experts, top_k)
SHAPES = {
    "mixtral": (4096, 14336, 8, 2),
    "fine_grained": (2048, 1536, 64, 6),  # DeepSeekMoE-like; H a multiple of 512 for fp8_block
    "small": (256, 512, 8, 2),
}
FORMAT_NAMES = ("bf16", "fp8", "fp8_block", "mxfp4", "nvfp4")


def median_ms(fn, iters: int, device: torch.device) -> float:
    """Median ms of `iters` calls after 3 warm-up calls, each call waited for (moetrain.timing)."""
    return timing.median_ms(fn, device, warmup=3, steps=iters, sync_each=True)


def paths(layer: MoELayer, num_rows: int, device: torch.device) -> str:
    """The path the layer's expert GEMMs take for a buffer of num_rows rows."""
    if device.type != "cuda":
        return "emulated"
    if not isinstance(layer.experts, QuantizedExperts):
        return "torch"  # the float layer's own expert GEMMs
    return layer.experts.cuda_paths(num_rows)


@torch.no_grad()
def bench_shape(name: str, args, device: torch.device) -> list[dict]:
    model_dim, hidden, experts, top_k = SHAPES[name]
    torch.manual_seed(0)
    with device:  # initialise the weights where they will live: a large layer takes long on a CPU
        base = MoELayer(model_dim, experts, hidden, top_k=top_k, expert=args.expert, capacity_factor=0.0, impl="torch")
    base = base.to(dtype=torch.bfloat16).eval()
    inputs = {phase: torch.randn(tokens, model_dim, device=device, dtype=torch.bfloat16)
              for phase, tokens in (("decode", args.decode_tokens), ("prefill", args.prefill_tokens))}
    # The same routing for every format: the experts-only timing runs on this fixed buffer.
    buffers = {}
    for phase, x in inputs.items():
        routed = base.gate(x, top_k)
        plan = make_plan(routed.topk_idx_TK, None, experts, 0.0, False, "torch")
        buffers[phase] = (ops.dispatch(x, plan.dest_TK, plan.num_rows, impl="torch"), plan)
    reference = {phase: base(x).float() for phase, x in inputs.items()}

    rows = []
    float_experts = base.experts
    for fmt in args.formats:
        # Same layer and gate for every format; only the experts are swapped.
        try:
            rows.append(bench_format(name, base, float_experts, fmt, inputs, buffers, reference, args, device))
        except Exception as error:  # one format failing (an old torch, no Triton) must not hide the others
            rows.append({"shape": name, "format": fmt, "error": f"{type(error).__name__}: {error}"[:400]})
        print_row(rows[-1], rows[0])
        base.experts = float_experts
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def kernel_error(experts: QuantizedExperts, device: torch.device) -> float:
    """Largest relative difference between the device path and the fp32 emulation on the first
    weight of every expert, for decode-sized (3 to 40) and prefill-sized (100 to 400) row counts
    per expert; one expert gets no rows."""
    name, weight = next(iter(experts.weights.items()))
    stack = next(iter(weight.stacks.values()))
    q_G = stack.stored()
    worst = 0.0
    for low, span in ((3, 38), (100, 301)):
        counts = [low + (7 * g) % span if g != 1 else 0 for g in range(len(stack.experts))]
        starts = [sum(counts[:g]) for g in range(len(counts))]
        x = torch.randn(sum(counts), stack.k, device=device, dtype=torch.bfloat16)
        if device.type == "cuda":
            as_int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
            y = weight.cuda_forward(ExpertInput(x), as_int32(starts), as_int32(counts), x.size(0), packed=True)
        else:
            y = weight(x, starts, counts)
        reference = torch.cat([emulated_matmul(x[s : s + c], stack.format, {key: t[g] for key, t in q_G.items()}, stack.k)
                               for g, (s, c) in enumerate(zip(starts, counts))])
        worst = max(worst, ((y.float() - reference).norm() / reference.norm()).item())
    return worst


def bench_format(name: str, layer: MoELayer, float_experts, fmt: str, inputs, buffers, reference, args, device) -> dict:
    if fmt != "bf16":
        layer.experts = QuantizedExperts.from_experts(float_experts, [get_format(fmt).name] * layer.num_experts)
    memory = expert_memory(layer)
    row = {"shape": name, "format": fmt,
           "path": " / ".join(paths(layer, buffers[phase][1].num_rows, device) for phase in ("decode", "prefill")),
           "expert_weight_bytes": sum(m.bytes for m in memory.values()),
           "bits_per_weight": 8 * sum(m.bytes for m in memory.values()) / sum(m.elements for m in memory.values())}
    if fmt != "bf16":
        row["kernel_vs_emulation"] = kernel_error(layer.experts, device)
    for phase, x in inputs.items():
        buf, plan = buffers[phase]
        row[f"{phase}_tokens"] = x.size(0)
        row[f"{phase}_layer_ms"] = median_ms(lambda: layer(x), args.iters, device)
        row[f"{phase}_experts_ms"] = median_ms(lambda: layer.experts(buf, plan.counts_E, None), args.iters, device)
        out = layer(x).float()
        row[f"{phase}_rel_error"] = ((out - reference[phase]).norm() / reference[phase].norm()).item()
    return row


HEADER = (f"{'shape':<13}{'format':<11}{'path (decode / prefill)':<36}{'GiB':>7}{'bits/w':>7} | {'decode layer':>12}{'experts':>9}"
          f"{'x bf16':>7} | {'prefill layer':>13}{'experts':>9}{'x bf16':>7} | {'err dec':>8}{'err pre':>8}{'vs emul':>9}")


def print_row(row: dict, baseline: dict) -> None:
    """One line per format as soon as it is measured (x bf16: experts-only speed-up over bf16)."""
    if "error" in row:
        print(f"{row['shape']:<13}{row['format']:<11}FAILED: {row['error']}", flush=True)
        return
    print(f"{row['shape']:<13}{row['format']:<11}{row['path']:<36}{row['expert_weight_bytes'] / 2**30:>7.3f}"
          f"{row['bits_per_weight']:>7.2f} | {row['decode_layer_ms']:>12.3f}{row['decode_experts_ms']:>9.3f}"
          f"{baseline['decode_experts_ms'] / row['decode_experts_ms']:>7.2f} | {row['prefill_layer_ms']:>13.3f}"
          f"{row['prefill_experts_ms']:>9.3f}{baseline['prefill_experts_ms'] / row['prefill_experts_ms']:>7.2f} | "
          f"{row['decode_rel_error']:>8.4f}{row['prefill_rel_error']:>8.4f}{row.get('kernel_vs_emulation', 0):>9.5f}",
          flush=True)


@torch.no_grad()
def kernel_timings(args, device: torch.device) -> None:
    """One weight (each shape's gate projection, [H, D]) of every format through each CUDA path at
    several rows per expert, timed alone; the path cuda_path picks is marked with *. Then, on the
    first shape, the FP8 activation quantization and the FP4 -> bf16 decode on their own, and a
    tile sweep of the Triton GEMM."""
    print(f"kernel timings, ms (median of {args.iters}); weight GB/s = stored weight bytes / time, "
          "TFLOP/s = 2 R N K / time; * = the path taken")
    weights = path_timings(args.shapes[0], args, device)
    model_dim, hidden, experts, _ = SHAPES[args.shapes[0]]
    for rows, width, group, swiglu in ((16384, model_dim, None, False), (16384, model_dim, 128, False),
                                       (16384, hidden, None, True), (16384, hidden, 128, True)):
        x = torch.randn(rows, width, device=device, dtype=torch.bfloat16)
        up = torch.randn_like(x) if swiglu else None
        ms = median_ms(lambda: kernels.quantize_fp8(x, group or width, up), args.iters, device)
        torch_ms = median_ms(lambda: quantize_fp8_groups(F.silu(x) * up if swiglu else x, group or width), args.iters, device)
        moved = x.numel() * (5 if swiglu else 3)  # bf16 in (twice for SwiGLU), FP8 out
        print(f"  quantize_fp8 [{rows}, {width}] group {group or 'row'}{' swiglu' if swiglu else ''}: "
              f"{ms:.3f} ms, {moved / ms / 1e6:.0f} GB/s (torch ops: {torch_ms:.3f} ms)", flush=True)
    for name in ("mxfp4", "nvfp4"):
        if name in weights:
            stack = weights[name].stacks[name]
            ms = median_ms(lambda: kernels.dequantize_fp4(stack.format, stack.stored(), model_dim), args.iters, device)
            moved = experts * hidden * model_dim * 2.5  # half a byte in, two bytes out
            print(f"  dequantize_fp4 {name} [{experts}, {hidden}, {model_dim}]: {ms:.3f} ms, {moved / ms / 1e6:.0f} GB/s",
                  flush=True)
    del weights
    for shape in args.shapes[1:]:
        path_timings(shape, args, device)
    tile_sweep(model_dim, hidden, experts, args, device)


def path_timings(shape: str, args, device: torch.device) -> dict[str, QuantizedWeight]:
    model_dim, hidden, experts, _ = SHAPES[shape]
    torch.manual_seed(0)
    w_EKN = torch.randn(experts, model_dim, hidden, device=device) * model_dim**-0.5
    weights = {name: QuantizedWeight([name] * experts, hidden, model_dim, device) for name in args.formats}
    for weight in weights.values():
        weight.quantize(w_EKN)
    del w_EKN
    print(f"{shape}: [{hidden}, {model_dim}] weight of {experts} experts")
    for rows_per_expert in KERNEL_ROWS_PER_EXPERT:
        num_rows = rows_per_expert * experts
        counts_G = torch.full((experts,), rows_per_expert, dtype=torch.int32, device=device)
        rows = ExpertRows(torch.cumsum(counts_G, 0, dtype=torch.int32) - counts_G, counts_G, rows_per_expert, True)
        x_RK = torch.randn(num_rows, model_dim, device=device, dtype=torch.bfloat16)
        for name, weight in weights.items():
            stack = weight.stacks[name]
            fmt, q_G = stack.format, stack.stored()
            weight_bytes = sum(t.numel() * t.element_size() for t in q_G.values())
            chosen = cuda_path(fmt, hidden, model_dim, rows_per_expert, True)
            # "torch" for FP8: one cuBLAS _scaled_mm per expert, the alternative without Triton.
            candidates = {"triton", chosen} | ({"scaled_grouped_mm", "torch"} if name == "fp8" else set()) | (
                {"torch"} if name == "fp8_block" else set()) | (
                {"dequant+grouped_mm"} if name in ("mxfp4", "nvfp4") else set()) | ({"grouped_mm"} if name == "bf16" else set())
            for path in sorted(candidates):
                try:
                    # The FP8 quantization of x is part of each call, as in the layer.
                    ms = median_ms(lambda: cuda_matmul(ExpertInput(x_RK), fmt, q_G, hidden, model_dim, rows, None, path),
                                   args.iters, device)
                    figures = f"{ms:8.3f} ms {weight_bytes / ms / 1e6:8.0f} GB/s {2 * num_rows * hidden * model_dim / ms / 1e9:7.1f} TFLOP/s"
                except Exception as error:  # one path failing must not hide the others
                    figures = f"FAILED: {type(error).__name__}: {error}"[:300]
                mark = "*" if path == chosen else " "
                print(f"  rows/expert {rows_per_expert:>5} {name:<10}{mark}{path:<20}{figures}", flush=True)
    return weights


KERNEL_ROWS_PER_EXPERT = (1, 4, 16, 64, 128, 512, 2048)
# (rows per expert, formats, tiles (BLOCK_R, BLOCK_N, BLOCK_K, num_warps, num_stages)) to try.
TILE_SWEEP = (
    (4, ("fp8", "mxfp4", "nvfp4"), ((16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 3),
                                    (16, 128, 256, 8, 3), (16, 256, 128, 8, 3))),
    (512, ("fp8_block",), ((128, 128, 128, 8, 3), (128, 128, 128, 4, 3), (128, 256, 128, 8, 3), (64, 128, 128, 4, 4))),
)


def tile_sweep(model_dim: int, hidden: int, experts: int, args, device: torch.device) -> None:
    """The Triton GEMM alone (activations already quantized) with other tiles than its defaults,
    on the gate-shaped [H, D] and the down-shaped [D, H] weight."""
    for rows_per_expert, names, candidates in TILE_SWEEP:
        for name in names:
            for n, k in ((hidden, model_dim), (model_dim, hidden)):
                weight = QuantizedWeight([name] * experts, n, k, device)
                weight.quantize(torch.randn(experts, k, n, device=device) * k**-0.5)
                fmt, q_G = weight.stacks[name].format, weight.stacks[name].stored()
                counts_G = torch.full((experts,), rows_per_expert, dtype=torch.int32, device=device)
                starts_G = torch.cumsum(counts_G, 0, dtype=torch.int32) - counts_G
                x_RK = torch.randn(rows_per_expert * experts, k, device=device, dtype=torch.bfloat16)
                inputs = ExpertInput(x_RK).fp8(k if name == "fp8" else 128) if "fp8" in name else (x_RK, None)
                y_RN = x_RK.new_empty(x_RK.size(0), n)
                timings = []
                for tiles in (None,) + candidates:
                    try:
                        ms = median_ms(lambda: kernels.grouped_gemm(*inputs, fmt, q_G, k, starts_G, counts_G, y_RN, tiles),
                                       args.iters, device)
                        timings.append(f"{ms:.3f}")
                    except Exception as error:  # a tile that does not fit must not hide the others
                        timings.append(type(error).__name__)
                labels = ["default " + "x".join(map(str, kernels.default_tiles(fmt, rows_per_expert)))]
                labels += ["x".join(map(str, tiles)) for tiles in candidates]
                print(f"  tiles rows/expert {rows_per_expert} {name} [{n}, {k}]: "
                      + ", ".join(f"{label} {t}" for label, t in zip(labels, timings)), flush=True)


# Expert rows R (tokens x k), D, H, E of the LM benchmark shapes (moetrain.bench).
TRAINING_SHAPES = {"moe_1b5": (65536, 2048, 2048, 8), "qwen3_30b": (131072, 2048, 768, 128),
                   "mixtral_lm": (16384, 4096, 14336, 8), "dsv3": (65536, 7168, 2048, 256)}


def training_quantizer_rows(name: str, rows: int, dim: int, hidden: int, experts: int, device: torch.device,
                            iters: int) -> list[dict]:
    """Each FP8 training quantizer alone on one shape: {shape, quantizer, ms, gb_per_s}."""
    from moetrain.precision import fp8_matmul, fp8_quantize  # noqa: PLC0415 - Triton kernels, imported when asked for

    counts_E = torch.full((experts,), rows // experts, device=device, dtype=torch.int64)
    counts_E[-1] += rows - int(counts_E.sum())
    x = torch.randn(rows, dim, device=device, dtype=torch.bfloat16)
    dy = torch.randn(rows, 2 * hidden, device=device, dtype=torch.bfloat16)
    w = torch.randn(experts, dim, 2 * hidden, device=device)
    w_up, w_down = w.bfloat16(), torch.randn(experts, hidden, dim, device=device, dtype=torch.bfloat16)
    places = fp8_matmul._padded_rows(counts_E, rows)
    # top-2 copies of rows // 2 tokens, expert-major, as the first GEMM gathers them in FP8
    tokens = x[: rows // 2]
    dest_TK = torch.randperm(rows, device=device).view(-1, 2)
    source_R = fp8_matmul._source_rows(dest_TK, rows)
    tokens_q, tokens_scale = fp8_quantize.quantize_rows(tokens)
    cases = {  # name: (call, bytes read + written at least)
        "rows of x": (lambda: fp8_quantize.quantize_rows(x), x.numel() * 3),
        "rows of dy": (lambda: fp8_quantize.quantize_rows(dy), dy.numel() * 3),
        "expert columns of x": (lambda: fp8_quantize.quantize_columns(x, counts_E, places), x.numel() * 5),
        "expert columns of dy": (lambda: fp8_quantize.quantize_columns(dy, counts_E, places), dy.numel() * 5),
        "weight, forward": (lambda: fp8_quantize.quantize_weight(w, over=1), w.numel() * 9),
        "weight, dgrad": (lambda: fp8_quantize.quantize_weight(w, over=2), w.numel() * 5),
        "bf16 gate-up weight, forward": (lambda: fp8_quantize.quantize_weight(w_up, over=1), w_up.numel() * 5),
        "bf16 gate-up weight, dgrad": (lambda: fp8_quantize.quantize_weight(w_up, over=2), w_up.numel() * 3),
        "bf16 down weight, forward": (lambda: fp8_quantize.quantize_weight(w_down, over=1), w_down.numel() * 5),
        "bf16 down weight, dgrad": (lambda: fp8_quantize.quantize_weight(w_down, over=2), w_down.numel() * 3),
        "gather of FP8 token rows": (lambda: fp8_matmul._gather_rows(tokens_q, source_R, 0.0), rows * dim * 3 // 2),
        "the same with the scales": (lambda: (fp8_matmul._gather_rows(tokens_q, source_R, 0.0),
                                              fp8_matmul._gather_rows(tokens_scale, source_R, 1.0)),
                                     rows * dim * 3 // 2 + (rows // 2 + rows) * 4),  # and the fp32 scales
        "weight blocks, forward": (lambda: fp8_quantize.quantize_weight_blocks(w, k_contiguous=True), w.numel() * 5),
        "weight blocks, dgrad": (lambda: fp8_quantize.quantize_weight_blocks(w, k_contiguous=False), w.numel() * 5),
        "1x128 tiles of x": (lambda: fp8_quantize.quantize_row_tiles(x), x.numel() * 3),
        "128x1 tiles of x": (lambda: fp8_quantize.quantize_column_tiles(x), x.numel() * 5),
        "copy of x (scale)": (lambda: x.clone(), x.numel() * 4),
    }
    if device.type == "cuda":
        # SwiGLU on the gate-up output (dy's shape), plain and writing its E4M3 rows as well (the fused
        # kernels of fp8_token_swiglu_experts): what the fusion saves is the quantizer's re-read of
        # its output, so the fused kernels must stay near the plain ones' rate to pay.
        from moetrain.ops import swiglu  # noqa: PLC0415
        from moetrain.precision import kernels  # noqa: PLC0415

        grad_h = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
        pairs = rows * hidden
        cases.update({
            "SwiGLU forward": (lambda: swiglu._swiglu(dy), pairs * 6),
            "SwiGLU forward, then rows of h": (lambda: fp8_quantize.quantize_rows(swiglu._swiglu(dy)), pairs * 9),
            "SwiGLU forward writing rows of h": (lambda: kernels.swiglu_quantize(dy), pairs * 7),
            "SwiGLU backward": (lambda: swiglu._swiglu_backward(grad_h, dy), pairs * 10),
            "SwiGLU backward, then its rows": (lambda: fp8_quantize.quantize_rows(swiglu._swiglu_backward(grad_h, dy)),
                                               pairs * 16),
            "SwiGLU backward writing its rows": (lambda: kernels.swiglu_backward_quantize(grad_h, dy), pairs * 12),
        })
    out = []
    for quantizer, (call, nbytes) in cases.items():
        # GPU time alone (a CUDA graph of 20 calls, replayed): the step launches these kernels ahead
        # of the GPU, and each one is shorter than its launch from Python. A call that cannot be
        # captured is timed call by call, and its row says so.
        try:
            ms = timing.graph_median_ms(call, device, steps=iters)
            timed = "graph" if device.type == "cuda" else "call by call"
        except RuntimeError as error:
            ms, timed = median_ms(call, iters, device), f"call by call ({str(error).splitlines()[0][:60]})"
        out.append({"shape": name, "quantizer": quantizer, "ms": ms, "gb_per_s": nbytes / ms / 1e6, "timed": timed})
    return out


def torchao_fp8_grouped_mm():
    """(torchao's FP8 row-wise grouped GEMM for MoE training, called as fn(a [R, K], b [E, K, N]
    column-major, int32 group ends), its version) where torchao is installed and imports with
    this torch, else (None, why not). A peer to measure against, not a dependency."""
    try:
        import torchao  # noqa: PLC0415
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm  # noqa: PLC0415
    except Exception as error:  # noqa: BLE001 - not installed, or built for another torch
        return None, f"torchao not available ({type(error).__name__}: {str(error).splitlines()[0][:120]})"

    def grouped_mm(a_RK, b_EKN, ends_E):
        return _to_fp8_rowwise_then_scaled_grouped_mm(a_RK, b_EKN, ends_E, out_dtype=torch.bfloat16,
                                                      pad_token_groups_for_grouped_mm=False)
    return grouped_mm, f"torchao {torchao.__version__}"


def training_gemm_rows(name: str, rows: int, dim: int, hidden: int, experts: int, device: torch.device,
                       iters: int) -> list[dict]:
    """Each expert GEMM of one LM shape (gate-up: [R, D] x [E, D, 2H]; down: [R, H] x [E, H, D]),
    forward and both backward GEMMs, on every training path, same values, equal rows per expert
    (multiples of 16, which torchao's FP8 grouped GEMM needs): bf16 (torch._grouped_mm through
    moetrain.ops.grouped.expert_matmul), moetrain's fp8 and fp8_block (moetrain.precision.fp8_matmul, the
    quantization included; the weight gradient in bf16, then in FP8 too: "fp8 wgrad"), and
    torchao's FP8 row-wise recipe where it is installed (its weight in the layout it asks for,
    [E, N, K] read transposed). {shape, gemm, path, ms, tflops}."""
    from moetrain.ops.grouped import expert_matmul  # noqa: PLC0415
    from moetrain.precision import fp8_matmul  # noqa: PLC0415 - Triton kernels, imported when asked for

    per_expert = rows // experts // 16 * 16
    rows = per_expert * experts
    counts_E = torch.full((experts,), per_expert, device=device, dtype=torch.int64)
    ends_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    peer, _ = torchao_fp8_grouped_mm()
    out = []
    for gemm, (k, n) in (("gate-up", (dim, 2 * hidden)), ("down", (hidden, dim))):
        generator = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16, generator=generator).requires_grad_()
        w_EKN = (torch.randn(experts, k, n, device=device, generator=generator) * k**-0.5).to(torch.bfloat16)
        w_ENK = w_EKN.transpose(1, 2).contiguous().requires_grad_()
        w_EKN.requires_grad_()
        dy = torch.randn(rows, n, device=device, dtype=torch.bfloat16, generator=generator)
        paths = {"bf16": (lambda: expert_matmul(x, w_EKN, counts_E, None), w_EKN)}
        for precision in FP8_PRECISIONS:
            if fp8_matmul.fp8_supported(device, precision)[0]:
                for wgrad, label in (("bf16", ""), ("fp8", ", fp8 wgrad")):
                    paths[f"moetrain {precision}{label}"] = (
                        lambda precision=precision, wgrad=wgrad: fp8_matmul.fp8_expert_matmul(
                            x, w_EKN, counts_E, None, precision, wgrad), w_EKN)
        if peer is not None and device.type == "cuda":
            paths["torchao fp8"] = (lambda: peer(x, w_ENK.transpose(1, 2), ends_E), w_ENK)
        for path, (call, w) in paths.items():
            def step(call=call, w=w):
                torch.autograd.grad(call(), [x, w], dy)
            ms = timing.median_ms(step, device, warmup=3, steps=iters)
            out.append({"shape": name, "gemm": gemm, "path": path, "ms": ms,
                        "tflops": 3 * 2 * rows * k * n / (ms * 1e-3) / 1e12})
    return out


def write_json(path: str, device_name: str, rows: list[dict]) -> None:
    """The rows of a run, with the torch version and the device, as --json writes them."""
    with open(path, "w") as f:
        json.dump({"torch": torch.__version__, "device": device_name, "rows": rows}, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["mixtral", "fine_grained"], choices=sorted(SHAPES))
    parser.add_argument("--formats", nargs="+", default=list(FORMAT_NAMES), choices=FORMAT_NAMES)
    parser.add_argument("--expert", default="swiglu", choices=["ffn", "swiglu"])
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--kernels", action="store_true",
                        help="instead: time one weight's GEMM on every CUDA path (first shape) and the Triton kernels alone")
    parser.add_argument("--training-quantizers", action="store_true",
                        help="instead: time each FP8 training quantizer alone on the LM shapes (see above)")
    parser.add_argument("--training-gemms", action="store_true",
                        help="instead: each expert GEMM of the LM shapes, forward + backward, in bf16, fp8, fp8_block "
                             "and torchao's FP8 where installed (see above)")
    args = parser.parse_args(argv)
    args.formats = ["bf16"] + [f for f in args.formats if f != "bf16"]  # the baseline of every ratio, first
    device = torch.device(args.device)
    if args.training_gemms:
        if device.type != "cuda":
            parser.error("--training-gemms times the CUDA GEMMs: it needs a CUDA device")
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, {torchao_fp8_grouped_mm()[1]}; "
              f"median of {args.iters} steps, forward + backward, TFLOP/s counted as bf16's", flush=True)
        rows = []
        for name, shape in TRAINING_SHAPES.items():
            shape_rows = training_gemm_rows(name, *shape, device, args.iters)
            bf16 = {row["gemm"]: row["ms"] for row in shape_rows if row["path"] == "bf16"}
            for row in shape_rows:
                print(f"{row['shape']:10s} {row['gemm']:8s} {row['path']:29s} {row['ms']:8.3f} ms "
                      f"{row['tflops']:6.0f} TFLOP/s {bf16[row['gemm']] / row['ms']:5.2f}x bf16", flush=True)
            rows += shape_rows
        if args.json:
            write_json(args.json, torch.cuda.get_device_name(device), rows)
        return
    if args.training_quantizers:
        if device.type != "cuda":
            parser.error("--training-quantizers times the CUDA kernels: it needs a CUDA device")
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; GPU time of one call: median of "
              f"{args.iters} replays of a CUDA graph of 20 calls", flush=True)
        rows = []
        for name, shape in TRAINING_SHAPES.items():
            for row in training_quantizer_rows(name, *shape, device, args.iters):
                note = "" if row["timed"] == "graph" else f"  timed {row['timed']}"
                print(f"{row['shape']:10s} {row['quantizer']:24s} {row['ms']:8.3f} ms {row['gb_per_s']:7.0f} GB/s{note}",
                      flush=True)
                rows.append(row)
        if args.json:
            write_json(args.json, torch.cuda.get_device_name(device), rows)
        return
    if args.kernels:
        if device.type != "cuda" or not kernels.available():
            parser.error("--kernels needs a CUDA device and Triton")
        kernel_timings(args, device)
        return
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"benchmarks/quantized_experts.py: torch {torch.__version__}, {card}, expert={args.expert}, "
          f"decode {args.decode_tokens} / prefill {args.prefill_tokens} tokens, median of {args.iters}; times in ms")
    print(HEADER)
    print("-" * len(HEADER), flush=True)
    rows = []
    for name in args.shapes:
        rows += bench_shape(name, args, device)
        if args.json:  # after every shape, so a run cut short still leaves its results
            write_json(args.json, card, rows)


if __name__ == "__main__":
    main()
