"""Expert GEMMs with quantized weights: y = x @ w.T for each expert's rows, in each format.

On CPU every format is emulated exactly: activations are quantized the way the GPU path quantizes
them (per token for fp8, 1x128 groups for fp8_block, not at all for bf16 and FP4), both operands
are dequantized to fp32 and multiplied in fp32. On CUDA:
  fp8        torch._scaled_mm, per-token activation scales and per-channel weight scales;
  fp8_block  torch._scaled_mm with 1x128 activation and 128x128 weight scales (needs K % 512 == 0
             and N % 128 == 0: cuBLAS wants the K-blocks of the weight scales padded to 4);
  mxfp4, nvfp4  W4A16: Hopper has no FP4 tensor cores, so one Triton launch per format decodes the
             weights to bf16 inside the GEMM (moetrain.quant.fp4_kernel; needs Triton);
  bf16       a plain bf16 matmul.
Shapes or installs the fast kernels cannot take run the emulation on the GPU (dequantize, multiply).
Shape letters: R rows, K input features, N output features, G experts of one format.
"""

from __future__ import annotations

import torch

from moetrain.quant import fp4_kernel
from moetrain.quant.formats import FP8_BLOCK, WeightFormat, dequantize_fp8_groups, quantize_fp8_groups

# How each format's activations are grouped for FP8 quantization (0: the whole row, per token).
ACTIVATION_GROUP = {"fp8": 0, "fp8_block": FP8_BLOCK}
ALIGN = 16  # rows per expert in an FP8 GEMM must be a multiple of this


def fast_path(fmt: WeightFormat, n: int, k: int) -> str:
    """Which CUDA path a matrix of this format and shape takes: "kernel" or "emulated"."""
    if fmt.name == "fp8":
        return "kernel" if n % 16 == 0 and k % 16 == 0 else "emulated"
    if fmt.name == "fp8_block":
        return "kernel" if n % FP8_BLOCK == 0 and k % (4 * FP8_BLOCK) == 0 else "emulated"
    if fmt.name in ("mxfp4", "nvfp4"):
        return "kernel" if fp4_kernel.supports(fmt, n, k) else "emulated"
    return "kernel"


def quantize_activations(x_RK: torch.Tensor, fmt: WeightFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 activations for the fp8 formats. Scales are per row (and 128 columns), so quantizing the
    whole expert-major buffer once equals quantizing each expert's rows separately."""
    return quantize_fp8_groups(x_RK, ACTIVATION_GROUP[fmt.name] or x_RK.size(-1))


def emulated_matmul(x_RK: torch.Tensor, fmt: WeightFormat, q: dict[str, torch.Tensor], k: int) -> torch.Tensor:
    """Reference semantics of every format, in fp32: quantize-dequantize x, dequantize w, multiply."""
    x_RK = x_RK.float()
    if fmt.name in ACTIVATION_GROUP:
        group = ACTIVATION_GROUP[fmt.name] or k
        x_RK = dequantize_fp8_groups(*quantize_fp8_groups(x_RK, group), group)
    return x_RK @ fmt.dequantize(q, k).t()


def _scaled_mm(fmt: WeightFormat, xq_RK: torch.Tensor, x_scale: torch.Tensor, q: dict[str, torch.Tensor]) -> torch.Tensor:
    # _scaled_mm wants the second operand column-major: w_NK.t() is exactly that.
    if fmt.name == "fp8":
        return torch._scaled_mm(xq_RK, q["data"].t(), scale_a=x_scale, scale_b=q["scale"].view(1, -1),
                                out_dtype=torch.bfloat16)
    # cuBLAS reads 1x128 activation scales K-block-major and 128x128 weight scales as [Kb, Nb].
    return torch._scaled_mm(xq_RK, q["data"].t(), scale_a=x_scale.t().contiguous().t(), scale_b=q["scale"].t(),
                            out_dtype=torch.bfloat16)


def _round_up(rows: int) -> int:
    return -(-rows // ALIGN) * ALIGN


def per_expert_scaled_mm(fmt: WeightFormat, xq_RK: torch.Tensor, scale: torch.Tensor, q_G: dict[str, torch.Tensor],
                         segments: list[tuple[int, int, int]], y_RN: torch.Tensor) -> None:
    """One torch._scaled_mm per (expert g, first row, row count) segment, into y_RN's rows.

    cuBLAS's FP8 GEMMs refuse row counts that are not multiples of 16 (CUBLAS_STATUS_NOT_SUPPORTED),
    so unless they already are, the rows are copied into a buffer A in which every expert's block
    starts on a multiple of 16 and is padded to one with zero rows (scale 1), never read back."""
    if all(start % ALIGN == 0 and count % ALIGN == 0 for _, start, count in segments):
        for g, start, count in segments:
            rows = slice(start, start + count)
            q = {name: t[g] for name, t in q_G.items()}
            y_RN[rows] = _scaled_mm(fmt, xq_RK[rows], scale[rows], q).to(y_RN.dtype)
        return
    aligned_starts, total = [], 0
    for _, _, count in segments:
        aligned_starts.append(total)
        total += _round_up(count)
    source_N = torch.cat([torch.arange(start, start + count) for _, start, count in segments]).to(xq_RK.device)
    target_N = torch.cat([torch.arange(a, a + count) for a, (_, _, count) in zip(aligned_starts, segments)]).to(xq_RK.device)
    # FP8 is indexed as bytes: the same copy, and every torch version supports uint8 indexing.
    xq_AK = xq_RK.new_zeros(total, xq_RK.size(1), dtype=torch.uint8)
    xq_AK[target_N] = xq_RK.view(torch.uint8)[source_N]
    xq_AK = xq_AK.view(xq_RK.dtype)
    scale_A = scale.new_ones(total, scale.size(1))
    scale_A[target_N] = scale[source_N]
    out_AN = y_RN.new_empty(total, y_RN.size(1), dtype=torch.bfloat16)
    for a, (g, _, count) in zip(aligned_starts, segments):
        rows = slice(a, a + _round_up(count))
        out_AN[rows] = _scaled_mm(fmt, xq_AK[rows], scale_A[rows], {name: t[g] for name, t in q_G.items()})
    y_RN[source_N] = out_AN[target_N].to(y_RN.dtype)


def quantized_matmul(x_RK: torch.Tensor, fmt: WeightFormat, q: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """x_RK @ w_NK.T -> [R, N] in x's dtype, for one matrix w given by its format and stored tensors q."""
    y_RN = x_RK.new_zeros(x_RK.size(0), n)
    grouped_matmul(x_RK, fmt, {name: t.unsqueeze(0) for name, t in q.items()}, n, k, [0], [x_RK.size(0)], y_RN)
    return y_RN


def _packed(starts: list[int], counts: list[int]) -> bool:
    """Whether the experts' rows follow each other from row 0 (one format for the whole layer)."""
    return starts[0] == 0 and all(starts[g + 1] == starts[g] + counts[g] for g in range(len(starts) - 1))


def grouped_matmul(x_RK: torch.Tensor, fmt: WeightFormat, q_G: dict[str, torch.Tensor], n: int, k: int,
                   starts: list[int], counts: list[int], y_RN: torch.Tensor, fp8_grouped: bool = False) -> None:
    """For each expert g of one format: y[start_g : start_g + count_g] = x[same rows] @ w_g.T, in place.
    q_G holds the G experts' stored tensors stacked on a leading dimension.

    fp8_grouped: run fp8 through one torch._scaled_grouped_mm launch instead of one _scaled_mm per
    expert, where the rows allow it (all experts packed from row 0)."""
    segments = [(g, start, count) for g, (start, count) in enumerate(zip(starts, counts)) if count]
    if not segments:
        return
    kernel = x_RK.is_cuda and fast_path(fmt, n, k) == "kernel"
    if kernel and fmt.name in ("mxfp4", "nvfp4") and y_RN.dtype == torch.bfloat16 and y_RN.stride(1) == 1:
        # One launch for all experts of the format, written straight into y.
        fp4_kernel.grouped_fp4_matmul(x_RK.to(torch.bfloat16).contiguous(), fmt, q_G, k, starts, counts, y_RN)
        return
    if kernel and fmt.name in ACTIVATION_GROUP:
        xq_RK, scale = quantize_activations(x_RK, fmt)
        if fp8_grouped and fmt.name == "fp8" and _packed(starts, counts):
            total = starts[-1] + counts[-1]
            ends_G = torch.tensor(counts, device=x_RK.device).cumsum(0).to(torch.int32)
            # The grouped kernel wants each expert's weight column-major: w_GNK.transpose is that.
            y_RN[:total] = torch._scaled_grouped_mm(
                xq_RK[:total], q_G["data"].transpose(1, 2), scale[:total].view(-1), q_G["scale"], offs=ends_G,
                out_dtype=torch.bfloat16,
            ).to(y_RN.dtype)
            return
        per_expert_scaled_mm(fmt, xq_RK, scale, q_G, segments, y_RN)
        return
    for g, start, count in segments:
        rows = slice(start, start + count)
        q = {name: t[g] for name, t in q_G.items()}
        if kernel and fmt.name == "bf16":
            y_RN[rows] = (x_RK[rows].to(torch.bfloat16) @ q["data"].t()).to(y_RN.dtype)
        elif kernel:  # an FP4 format into a non-bf16 output: the kernel writes bf16 rows first
            out_RN = x_RK.new_empty(count, n, dtype=torch.bfloat16)
            fp4_kernel.grouped_fp4_matmul(x_RK[rows].to(torch.bfloat16).contiguous(), fmt,
                                          {name: t[g : g + 1] for name, t in q_G.items()}, k, [0], [count], out_RN)
            y_RN[rows] = out_RN.to(y_RN.dtype)
        else:
            y_RN[rows] = emulated_matmul(x_RK[rows], fmt, q, k).to(y_RN.dtype)
