"""Expert GEMMs with quantized weights: y = x @ w.T for each expert's rows, in each format.

On CPU every format is emulated exactly: activations are quantized the way the GPU path quantizes
them (per token for fp8, 1x128 groups for fp8_block, not at all for bf16 and FP4), both operands
are dequantized to fp32 and multiplied in fp32. On CUDA each format of a layer takes one path,
chosen from the rows per expert (R / E, known without waiting for the GPU) by cuda_path:

  path                 formats              when
  triton               all                  few rows per expert (SMALL_BATCH_ROWS: decode), or rows
                                            not packed from row 0 (capacity layout, several formats
                                            in one layer): one grouped Triton GEMM that decodes the
                                            weights in registers (moetrain.precision.kernels)
  scaled_grouped_mm    fp8                  many rows, packed: torch._scaled_grouped_mm, per-token x
                                            scales and per-channel w scales, FP8 tensor cores
  dequant+grouped_mm   mxfp4, nvfp4         many rows, packed: FP4 -> bf16 once per call (Triton), then
                                            torch._grouped_mm (bf16); Hopper has no FP4 tensor cores
  grouped_mm           bf16                 many rows, packed: torch._grouped_mm
  torch                all                  no Triton: per-expert torch._scaled_mm for fp8 and
                                            fp8_block, bf16 matmuls, dequantize-and-multiply for FP4
fp8_block always takes the Triton GEMM (FP8 dots, scaled per 1x128 x 128x128 block in fp32):
torch._scaled_grouped_mm takes only row-wise scales on Hopper. FP8 activations are quantized by
one Triton kernel, bit-identical to formats.quantize_fp8_groups, once per input (SwiGLU's gate and
up share them; the down projection's input is quantized as silu(gate) * up is formed).
Shape letters: R rows, K input features, N output features, G experts of one format, E all experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain.precision import kernels
from moetrain.precision.formats import FP8_BLOCK, WeightFormat, dequantize_fp8_groups, quantize_fp8_groups

# How each format's activations are grouped for FP8 quantization (0: the whole row, per token).
ACTIVATION_GROUP = {"fp8": 0, "fp8_block": FP8_BLOCK}
ALIGN = 16  # rows per expert in an FP8 GEMM must be a multiple of this


# Rows per expert up to which the Triton GEMM (weights streamed and decoded in registers) beats
# torch's grouped GEMMs. Measured on one H200 (docs/quantization.md, the kernel-only timings of the gate
# projections of the Mixtral and the 64-expert shapes): bf16 and fp8 cross over between 64 and 128
# rows, the FP4 formats (whose other path first decodes every weight to bf16) between 128 and 512.
SMALL_BATCH_ROWS = {"bf16": 64, "fp8": 64, "mxfp4": 256, "nvfp4": 256}
LARGE_BATCH_PATH = {"bf16": "grouped_mm", "fp8": "scaled_grouped_mm", "mxfp4": "dequant+grouped_mm",
                    "nvfp4": "dequant+grouped_mm"}


def cuda_path(fmt: WeightFormat, n: int, k: int, rows_per_expert: float, packed: bool) -> str:
    """The CUDA path of a format's [N, K] GEMM (see the module docstring) for R / E rows per
    expert; packed: the experts' rows follow each other from row 0, which torch's grouped GEMMs
    need, as they need N and K in multiples of 16."""
    packed = packed and n % 16 == 0 and k % 16 == 0
    if not kernels.available():
        return "grouped_mm" if fmt.name == "bf16" and packed else "torch"
    if packed and fmt.name in LARGE_BATCH_PATH and rows_per_expert > SMALL_BATCH_ROWS[fmt.name]:
        return LARGE_BATCH_PATH[fmt.name]
    return "triton"


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


def grouped_matmul(x_RK: torch.Tensor, fmt: WeightFormat, q_G: dict[str, torch.Tensor], n: int, k: int,
                   starts: list[int], counts: list[int], y_RN: torch.Tensor) -> None:
    """The "torch" path, and the CPU emulation: for each expert g of one format,
    y[start_g : start_g + count_g] = x[same rows] @ w_g.T, in place. q_G holds the G experts'
    stored tensors stacked on a leading dimension."""
    segments = [(g, start, count) for g, (start, count) in enumerate(zip(starts, counts)) if count]
    if not segments:
        return
    if x_RK.is_cuda and fmt.name in ACTIVATION_GROUP and fp8_gemm_fits(fmt, n, k):
        per_expert_scaled_mm(fmt, *quantize_activations(x_RK, fmt), q_G, segments, y_RN)
        return
    for g, start, count in segments:
        rows = slice(start, start + count)
        q = {name: t[g] for name, t in q_G.items()}
        if x_RK.is_cuda and fmt.name == "bf16":
            y_RN[rows] = (x_RK[rows].to(torch.bfloat16) @ q["data"].t()).to(y_RN.dtype)
        else:
            y_RN[rows] = emulated_matmul(x_RK[rows], fmt, q, k).to(y_RN.dtype)


def fp8_gemm_fits(fmt: WeightFormat, n: int, k: int) -> bool:
    """Whether cuBLAS's FP8 GEMM takes the shape: it wants dimensions in multiples of 16 and, for
    blockwise scales, the weight scales' K-blocks padded to 4 (K % 512 == 0, N % 128 == 0)."""
    if fmt.name == "fp8":
        return n % 16 == 0 and k % 16 == 0
    return n % FP8_BLOCK == 0 and k % (4 * FP8_BLOCK) == 0


@dataclass
class ExpertRows:
    """Where the rows of the G experts of one format lie in the expert-major buffer: device tensors
    for the kernels (no host sync), host lists only for the torch path."""

    starts_G: torch.Tensor  # int32, on x's device
    counts_G: torch.Tensor  # int32
    rows_per_expert: float  # R / E of the whole layer: what decides decode- or prefill-style paths
    packed: bool  # the G experts' rows follow each other from row 0 (all experts, dropless layout)

    def lists(self) -> tuple[list[int], list[int]]:
        return self.starts_G.tolist(), self.counts_G.tolist()


class ExpertInput:
    """A GEMM input x_RK (bf16 on CUDA) with its FP8 quantizations, each computed once: SwiGLU's
    gate and up projections share them; `fp8` can be given already (the fused SwiGLU kernel)."""

    def __init__(self, x_RK: torch.Tensor | None, fp8: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.x_RK = x_RK
        self._fp8 = dict(fp8 or {})

    def fp8(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(E4M3 values [R, K], fp32 scales [R, ceil(K/group)]); group >= K: one scale per row."""
        if group not in self._fp8:
            self._fp8[group] = kernels.quantize_fp8(self.x_RK, group)
        return self._fp8[group]


def activation_group(fmt: WeightFormat, k: int) -> int:
    return ACTIVATION_GROUP[fmt.name] or k


def cuda_matmul(inputs: ExpertInput, fmt: WeightFormat, q_G: dict[str, torch.Tensor], n: int, k: int,
                rows: ExpertRows, y_RN: torch.Tensor | None, path: str | None = None) -> torch.Tensor:
    """The G experts' GEMM on CUDA by cuda_path (or the given path: the benchmark compares them).
    Writes into y_RN (bf16) when given; otherwise returns a new [R, N] bf16 tensor whose rows past
    the experts' rows are left unwritten."""
    path = path or cuda_path(fmt, n, k, rows.rows_per_expert, rows.packed)
    x_RK = inputs.x_RK
    if path in ("grouped_mm", "scaled_grouped_mm", "dequant+grouped_mm"):  # packed: one format, y_RN is None
        offsets_G = torch.cumsum(rows.counts_G, 0, dtype=torch.int32)
        if path == "scaled_grouped_mm":
            xq_RK, scale_R1 = inputs.fp8(k)
            # The grouped kernel wants each expert's weight column-major: w_GNK.transpose is that.
            return torch._scaled_grouped_mm(xq_RK, q_G["data"].transpose(1, 2), scale_R1.view(-1), q_G["scale"],
                                            offs=offsets_G, out_dtype=torch.bfloat16)
        w_GNK = q_G["data"] if path == "grouped_mm" else kernels.dequantize_fp4(fmt, q_G, k)
        return torch._grouped_mm(x_RK, w_GNK.transpose(1, 2), offs=offsets_G)
    num_rows = (x_RK if x_RK is not None else inputs.fp8(activation_group(fmt, k))[0]).size(0)
    if y_RN is None:
        y_RN = torch.empty(num_rows, n, dtype=torch.bfloat16, device=rows.starts_G.device)
    if path == "torch":
        grouped_matmul(x_RK, fmt, q_G, n, k, *rows.lists(), y_RN)
    elif fmt.name in ACTIVATION_GROUP:
        kernels.grouped_gemm(*inputs.fp8(activation_group(fmt, k)), fmt, q_G, k, rows.starts_G, rows.counts_G, y_RN)
    else:
        kernels.grouped_gemm(x_RK, None, fmt, q_G, k, rows.starts_G, rows.counts_G, y_RN)
    return y_RN
