"""The Triton grouped GEMMs (moetrain.ops.triton_grouped) against torch's at the expert GEMMs of LM shapes (a GPU).

    python benchmarks/grouped_gemm.py [--shapes moe_1b5 qwen3_30b ...] [--sweep] [--json FILE]

For each shape's gate-up and down GEMM: forward (x @ w), dgrad (dy @ w^T) and wgrad (x^T dy per
expert), in bf16 (ours, torch._grouped_mm), FP8 with row-wise scales (ours, torch._scaled_grouped_mm)
and FP8 with 128-blocks (ours); the fastest tile of each (with --sweep: of SWEEP too), its TFLOP/s
(2 rows k n / the median of 20 steps, moetrain.timing) and its error against the fp32 reference on
the dequantized operands.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from moetrain.ops.triton_grouped import (
    FP8, SCALE_BLOCK, default_config, grouped_mm, grouped_mm_reference, grouped_mm_wgrad, grouped_mm_wgrad_reference,
    triton,
)
from moetrain.precision import fp8_quantize, kernels
from moetrain.timing import median_ms

# Expert GEMMs of LM shapes: tokens T, model dim D, expert hidden dim H, experts E, top-k.
LM_SHAPES = {"moe_1b5": (32768, 2048, 2048, 8, 2), "qwen3_30b": (16384, 2048, 768, 128, 8),
             "mixtral": (8192, 4096, 14336, 8, 2), "dsv3": (8192, 7168, 2048, 256, 8)}
# Our FP8 row-wise kernels, by the config's TMA key: pointer loads, TMA, TMA persistent.
FP8_ROW_KERNELS = (("fp8 row ours", 0), ("fp8 row tma", 1), ("fp8 row tma persistent", 2))
# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried by --sweep; BLOCK_K is the dtype's default.
SWEEP = ((128, 256, 8, 3), (128, 256, 8, 4), (128, 128, 8, 4), (128, 128, 4, 4), (64, 256, 8, 3), (64, 128, 4, 4),
         (256, 128, 8, 3), (256, 128, 8, 4), (128, 64, 4, 5))


def routed_counts(tokens: int, num_experts: int, top_k: int, seed: int = 0) -> list[int]:
    """Rows per expert when every token picks top_k distinct experts, drawn from a mildly skewed
    popularity (a softmax of Gaussian logits), as a trained router's load looks."""
    generator = torch.Generator().manual_seed(seed)
    popularity = torch.softmax(0.3 * torch.randn(num_experts, generator=generator), 0)
    picks = torch.multinomial(popularity.expand(tokens, num_experts), top_k, generator=generator)
    return torch.bincount(picks.flatten(), minlength=num_experts).tolist()


def _quantize_blocks(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values of a 2-D x and one fp32 scale per block of rows x cols (amax / 448, 1 for zeros)."""
    r, c = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -c % cols, 0, -r % rows))
    blocks = padded.view(padded.size(0) // rows, rows, padded.size(1) // cols, cols)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:r, :c].to(FP8)
    return q, scale


def _quantize_experts(w_EKN: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """_quantize_blocks of each expert's [K, N] (one expert at a time: no fp32 copy of all weights)."""
    pairs = [_quantize_blocks(w, rows, cols) for w in w_EKN]
    q = torch.empty(w_EKN.shape, dtype=FP8, device=w_EKN.device)
    for e, (q_e, _) in enumerate(pairs):
        q[e] = q_e
    return q, torch.stack([s for _, s in pairs])


def _k_contiguous(b_EKN: torch.Tensor) -> torch.Tensor:
    """The same logical [E, K, N] stored [E, N, K] (K contiguous, what FP8 tensor cores read)."""
    return b_EKN.transpose(1, 2).contiguous().transpose(1, 2)


def _starts_ends(ends_E: torch.Tensor) -> list[tuple[int, int]]:
    """(first row, end row) of each expert."""
    ends = ends_E.tolist()
    return list(zip([0] + ends[:-1], ends))


def _relative_error(kind: str, c: torch.Tensor, a, b, ends_E, a_scale=None, b_scale=None, block=0) -> float:
    """max |c - reference| / max |reference|, the reference (fp32, dequantized operands) taken one
    expert at a time so that no fp32 copy of all expert weights (or of all of dw) is made."""
    error, peak = 0.0, 0.0
    for e, (s, t) in enumerate(_starts_ends(ends_E)):
        if kind == "mm":
            if s == t:
                continue
            ends = torch.tensor([t - s], dtype=torch.int32)
            scales = (None, None) if a_scale is None else (a_scale[s:t], b_scale[e:e + 1])
            ref = grouped_mm_reference(a[s:t], b[e:e + 1], ends, *scales, block)
            got = c[s:t]
        else:  # rows from a multiple of 128, so that block scales keep their global 128-row blocks
            s0 = s // SCALE_BLOCK * SCALE_BLOCK if block else s
            ends = torch.tensor([s - s0, t - s0], dtype=torch.int32)
            if a_scale is None:
                scales = (None, None)
            elif block:
                scales = (a_scale[s0 // SCALE_BLOCK:], b_scale[s0 // SCALE_BLOCK:])
                scales = tuple(x[:-(-(t - s0) // SCALE_BLOCK)] for x in scales)
            else:
                scales = (a_scale[[e, e]], b_scale[[e, e]])
            ref = grouped_mm_wgrad_reference(a[s0:t], b[s0:t], ends, *scales, block)[1]
            got = c[e]
        error = max(error, (got.float() - ref).abs().max().item())
        peak = max(peak, ref.abs().max().item())
    return error / peak if peak else error


def _configs(dtype: torch.dtype, n: int, rows_per_expert: float, block: int, sweep: bool, tma: int = 0) -> list[dict]:
    """Our tiles to time: the default, and with sweep the SWEEP variants of it; tma: the operands read
    by the pointer kernel (0), the TMA kernel (1) or the persistent TMA kernel (2)."""
    default = dict(default_config(dtype, n, rows_per_expert, block), TMA=tma)
    tried = [dict(default, BLOCK_M=m, BLOCK_N=nn, num_warps=w, num_stages=s) for m, nn, w, s in SWEEP] if sweep else []
    return [default] + [config for config in tried if config != default]


def _config_text(config: dict | None) -> str:
    if config is None:
        return "torch"
    return "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} w{num_warps} s{num_stages} g{GROUP}".format(**config) + (
        {0: "", 1: " tma", 2: " tma persistent"}[config.get("TMA", 0)])


def _measure(name: str, kind: str, call, operands: tuple, flops: float, configs: list, device) -> dict:
    """Time call(config) for each config (None: torch's kernel) and keep the fastest; its error
    against the reference of operands (a, b, ends, a_scale, b_scale, block)."""
    best, failure = None, None
    for config in configs:
        try:
            ms = median_ms(lambda: call(config), device, warmup=5, steps=20)
        except Exception as error:  # a config out of shared memory, or a torch kernel refusing the layout
            failure = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:120]}"
            continue
        if best is None or ms < best[0]:
            best = (ms, config)
    if best is None:
        return dict(variant=name, error=failure)
    ms, config = best
    relative = _relative_error(kind, call(config), *operands)
    return dict(variant=name, ms=ms, tflops=flops / ms / 1e9, rel_error=relative, config=_config_text(config))


def _bench_gemm(shape: str, gemm: str, counts: list[int], k: int, n: int, seed: int, sweep: bool,
                device="cuda", only: tuple[str, ...] = ()) -> list[dict]:
    """Forward (x @ w), dgrad (dy @ w^T) and wgrad (x^T dy per expert) of one expert GEMM with
    weights w [E, k, n], in bf16 (ours, torch._grouped_mm), FP8 row-wise (ours and
    torch._scaled_grouped_mm, on the operands moetrain.precision.fp8_quantize gives it) and FP8 128-blocks
    (ours). FP8 operands are stored with the reduction dimension contiguous. only: the variants whose
    names hold one of these words (all when empty)."""
    rows, num_experts, bf16 = sum(counts), len(counts), torch.bfloat16
    counts_E = torch.tensor(counts, device=device)
    ends_E = counts_E.cumsum(0).to(torch.int32)
    torch.manual_seed(seed)
    x = torch.randn(rows, k, device=device, dtype=bf16)
    dy = torch.randn(rows, n, device=device, dtype=bf16)
    w = (torch.randn(num_experts, k, n, device=device) / k ** 0.5).to(bf16)
    flops = 2.0 * rows * k * n
    results = []

    def record(pass_name: str, variant: str, call, operands: tuple, dtype=None, tma: int = 0) -> None:
        """dtype: ours (its configs, out features n for fwd/wgrad, k for dgrad); None: torch's."""
        if only and not any(word in variant for word in only):
            return
        out_features, block = k if pass_name == "dgrad" else n, operands[5] if len(operands) > 5 else 0
        configs = [None] if dtype is None else _configs(dtype, out_features, rows / num_experts, block, sweep, tma)
        kind = "wgrad" if pass_name == "wgrad" else "mm"
        result = dict(shape=shape, gemm=gemm, rows=rows, k=k, n=n, **{"pass": pass_name})
        result.update(_measure(variant, kind, call, operands, flops, configs, device))
        results.append(result)
        print(_row_text(result), flush=True)

    # bf16, w as stored [E, k, n]; dgrad through its transposed view
    wt = w.transpose(1, 2)
    record("fwd", "bf16 ours", lambda cfg: grouped_mm(x, w, ends_E, config=cfg), (x, w, ends_E), bf16)
    record("fwd", "bf16 torch", lambda cfg: torch._grouped_mm(x, w, offs=ends_E), (x, w, ends_E))
    record("dgrad", "bf16 ours", lambda cfg: grouped_mm(dy, wt, ends_E, config=cfg), (dy, wt, ends_E), bf16)
    record("dgrad", "bf16 torch", lambda cfg: torch._grouped_mm(dy, wt, offs=ends_E), (dy, wt, ends_E))
    record("wgrad", "bf16 ours", lambda cfg: grouped_mm_wgrad(x, dy, ends_E, out_dtype=bf16, config=cfg),
           (x, dy, ends_E), bf16)
    record("wgrad", "bf16 torch", lambda cfg: torch._grouped_mm(x.t(), dy, offs=ends_E), (x, dy, ends_E))
    # FP8 row-wise
    xq, sx = fp8_quantize.quantize_rows(x)
    wq, sw = fp8_quantize.quantize_weight(w, over=1)  # [E, n, k], scales [E, n]
    ops = (xq, wq.transpose(1, 2), ends_E, sx, sw, 0)
    for variant, tma in FP8_ROW_KERNELS:
        record("fwd", variant, lambda cfg: grouped_mm(*ops[:5], config=cfg), ops, FP8, tma=tma)
    record("fwd", "fp8 row torch", lambda cfg: torch._scaled_grouped_mm(
        xq, ops[1], sx, sw, offs=ends_E, out_dtype=bf16), ops)
    dyq, sdy = fp8_quantize.quantize_rows(dy)
    wq, sw = fp8_quantize.quantize_weight(w, over=2)  # [E, k, n], scales [E, k]
    ops = (dyq, wq.transpose(1, 2), ends_E, sdy, sw, 0)
    for variant, tma in FP8_ROW_KERNELS:
        record("dgrad", variant, lambda cfg: grouped_mm(*ops[:5], config=cfg), ops, FP8, tma=tma)
    record("dgrad", "fp8 row torch", lambda cfg: torch._scaled_grouped_mm(
        dyq, ops[1], sdy, sw, offs=ends_E, out_dtype=bf16), ops)
    del wq, ops
    # wgrad: each expert's rows padded to 16 for torch (zeros), scales per expert and column
    padded_ends_E = fp8_quantize.padded_ends(counts_E)
    padded = int(padded_ends_E[-1])
    xq_KP, sx_EK, dyq_NP, sdy_EN = fp8_quantize.quantize_column_pair(x, dy, counts_E, padded)
    ops = (xq_KP.t(), dyq_NP.t(), padded_ends_E, sx_EK, sdy_EN, 0)
    record("wgrad", "fp8 row ours", lambda cfg: grouped_mm_wgrad(*ops[:5], out_dtype=bf16, config=cfg), ops, FP8)
    record("wgrad", "fp8 row torch", lambda cfg: torch._scaled_grouped_mm(
        xq_KP, dyq_NP.t(), sx_EK.reshape(-1), sdy_EN.reshape(-1), offs=padded_ends_E, out_dtype=bf16), ops)
    del xq_KP, dyq_NP, ops
    # FP8 128-blocks: 1x128 activation tiles, 128x128 weight blocks; for wgrad 128x1 (rows x column)
    wq, sw = _quantize_experts(w, SCALE_BLOCK, SCALE_BLOCK)  # [E, k, n], scales [E, k/128, n/128]
    del w, wt
    xq, sx = kernels.quantize_fp8(x, SCALE_BLOCK)
    ops = (xq, _k_contiguous(wq), ends_E, sx, sw, SCALE_BLOCK)
    record("fwd", "fp8 block ours", lambda cfg: grouped_mm(*ops, config=cfg), ops, FP8)
    dyq, sdy = kernels.quantize_fp8(dy, SCALE_BLOCK)
    ops = (dyq, wq.transpose(1, 2), ends_E, sdy, sw.transpose(1, 2), SCALE_BLOCK)  # n contiguous as stored
    record("dgrad", "fp8 block ours", lambda cfg: grouped_mm(*ops, config=cfg), ops, FP8)
    del wq, ops
    xq, sx = _quantize_blocks(x, SCALE_BLOCK, 1)
    dyq, sdy = _quantize_blocks(dy, SCALE_BLOCK, 1)
    ops = (xq.t().contiguous().t(), dyq.t().contiguous().t(), ends_E, sx, sdy, SCALE_BLOCK)  # rows contiguous
    record("wgrad", "fp8 block ours", lambda cfg: grouped_mm_wgrad(*ops, out_dtype=bf16, config=cfg), ops, FP8)
    return results


_COLUMNS = (("shape", 10), ("gemm", 8), ("pass", 6), ("variant", 15), ("rows", 7), ("k", 6), ("n", 6), ("ms", 8),
            ("tflops", 8), ("rel_error", 9), ("config", 0))


def _row_text(row: dict) -> str:
    """One line of the table (the header when row maps each column to its name)."""
    formats = {"ms": "{:.3f}", "tflops": "{:.1f}", "rel_error": "{:.2e}"}
    cells = []
    for key, width in _COLUMNS:
        value = row.get(key, "")
        if key in formats and not isinstance(value, str):
            value = formats[key].format(value)
        if key == "config" and "error" in row:
            value = row["error"]
        cells.append(f"{value!s:<{width}}")
    return " ".join(cells).rstrip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/grouped_gemm.py",
                                     description="Time the Triton grouped GEMMs against torch's at LM shapes (a GPU).")
    parser.add_argument("--shapes", nargs="+", choices=list(LM_SHAPES), default=list(LM_SHAPES))
    parser.add_argument("--sweep", action="store_true", help="also try the SWEEP tiles for each of our GEMMs")
    parser.add_argument("--json", metavar="FILE", help="write the results there")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", default=[], metavar="WORD",
                        help="time only the variants whose names hold one of these words (e.g. 'fp8 row')")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or triton is None:
        print("benchmarks/grouped_gemm.py: the benchmark needs a CUDA GPU and Triton "
              f"({'no GPU visible' if not torch.cuda.is_available() else 'Triton missing'})")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          "w [E, k, n]: fwd x @ w, dgrad dy @ w^T, wgrad x^T dy; TFLOP/s = 2 rows k n / time (median of 20); "
          "rel_error = max |c - ref| / max |ref|, ref in fp32 on the dequantized operands")
    print(_row_text({key: key for key, _ in _COLUMNS}))
    results = []
    for shape in args.shapes:
        tokens, d, h, num_experts, top_k = LM_SHAPES[shape]
        counts = routed_counts(tokens, num_experts, top_k, args.seed)
        for gemm, k, n in (("gate_up", d, 2 * h), ("down", h, d)):
            results += _bench_gemm(shape, gemm, counts, k, n, args.seed, args.sweep, only=tuple(args.only))
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           sweep=args.sweep, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
