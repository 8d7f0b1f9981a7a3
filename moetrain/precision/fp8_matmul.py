"""FP8 training of the expert GEMMs: MoELayer(precision="fp8" | "fp8_block"), trainer.precision=fp8 | fp8_block.

The expert GEMMs of the forward and of the input gradient (dgrad) multiply E4M3 operands with fp32
scales and fp32 accumulation; the weight gradient's (wgrad) multiplies bf16 operands, as the bf16
layer's does (wgrad="bf16", MoELayer.fp8_wgrad's default), or E4M3 ones by the same recipe
(wgrad="fp8", DeepSeek-V3's way). bf16 is the default because FP8's wgrad needs each expert's
columns of x and dy quantized, and on an H200 those passes cost more than its FP8 GEMM saves
(docs/performance.md). The master weights keep their dtype (fp32 under autocast) and are quantized
afresh at every step. Two scaling recipes (R rows, K input features, N output features):

"fp8", row-wise: scales run along the whole reduction dimension of each GEMM, so a scale can be
taken out of the sum:

  GEMM     product              first operand scaled per         second operand scaled per
  forward  y_RN  = x_RK w_KN    row of x (token), over K          column n of w, over K
  dgrad    dx_RK = dy_RN w_KN^T row of dy (token), over N         row k of w, over N
  wgrad    dw_KN = x_RK^T dy_RN column k of x, over its expert's  column n of dy, over its expert's
           (wgrad="fp8")        rows                              rows

"fp8_block", DeepSeek-V3's fine-grained recipe (the inference format fp8_block's arithmetic,
moetrain.precision.formats): scales per 128 elements of the reduction dimension, so one outlier costs
the precision of 128 values, not of a whole row; the GEMM multiplies each 128-deep slab of partial
sums by its two scales before accumulating:

  GEMM     first operand scaled per                 second operand scaled per
  forward  x: 1x128 tile along K, [R, K/128]        w: 128x128 block, [E, K/128, N/128]
  dgrad    dy: 1x128 tile along N, [R, N/128]       w: the same 128x128 blocks, read transposed
  wgrad    x: 128x1 tile, [R/128, K]                dy: 128x1 tile, [R/128, N]   (wgrad="fp8")

(sizes rounded up). The wgrad tiles are global blocks of 128 packed rows (rows 128i..128i+127); a
block that straddles two experts shares its scale between them, which keeps the quantization one
pass with no per-expert padding.

Gradients are E4M3 too, not E5M2: with a scale per row, per column and expert, or per 128-element
tile the range of a scaled group is at most 448 / smallest normal, and E4M3's third mantissa bit
halves the rounding error E5M2 would add (DeepSeek-V3 trains with E4M3 gradients under
fine-grained scales for the same reason). Outputs round to bfloat16, as the tensor cores write
them; dx and dw then take the dtype of x and w.

On CUDA (sm90+), "fp8": the GEMMs are torch._scaled_grouped_mm or moetrain.ops.triton_grouped's,
whichever is faster and accurate enough there (set_rowwise_gemms); the weight gradient's operands
are transposed and quantized per expert column by two Triton kernels (each expert's column maxima,
then the values written transposed, each expert's rows padded to a multiple of 16, the FP8 GEMMs'
alignment).
"fp8_block": the GEMMs are moetrain.ops.triton_grouped's block-scaled grouped GEMMs; the 1x128 tiles
are quantized by moetrain.precision.kernels.quantize_fp8, the 128x1 tiles (transposed, rows contiguous) by the
same Triton kernels as "fp8"'s columns, the 128x128 weight blocks by one Triton kernel (a program
per block). On the CPU every GEMM is emulated: the operands are quantized with the same arithmetic
(moetrain.precision.formats, bit for bit), dequantized to fp32 and multiplied in fp32, then rounded to
bfloat16; only the order of the fp32 accumulation differs from the GPU.

Quantized once, before dispatch: where the rows are copies of tokens (MoELayer's built-in experts
in one process hand their first GEMM moetrain.moe.experts.TokenRows), fp8_token_matmul quantizes
each token once (the forward's row or 1x128-tile scales) and gathers its E4M3 values and scales into
the expert layout: half the bytes of dispatching bf16 rows, k times fewer rows quantized, and the
same operands bit for bit, since a token's copies quantize alike. The bf16 rows are not kept for
backward: the weight gradient dispatches the tokens again, and the input gradient is summed over
each token's copies (dispatch's backward); the fused SwiGLU experts below keep them instead. Under
expert parallelism the E4M3 rows travel to the experts' ranks (fp8_exchanged_matmul, the dropless
layout at r = 1): there the weight gradient is taken from the received rows, dequantized (and with
wgrad="fp8" quantized again per column: DeepSeek-V3's double quantization).

The quantizers are moetrain.precision.fp8_quantize's; this module holds the GEMMs and their autograd.

Shape letters: R rows (expert-major, packed or padded), K input features, N output features,
E experts, P rows padded per expert to multiples of ALIGN; Kb, Nb, Rb those dims in 128-blocks.
"""

from __future__ import annotations

import torch

from moetrain import ops
from moetrain.ops import swiglu
from moetrain.ops.graph import outside_the_graph
from moetrain.ops.grouped import expert_matmul, group_ends
from moetrain.ops.launch import on_device_of
from moetrain.precision import kernels
from moetrain.precision.formats import FP8_BLOCK, dequantize_fp8_blocks, dequantize_fp8_groups
from moetrain.precision.fp8_quantize import (
    ALIGN, padded_ends, quantize_column_pair, quantize_column_tiles, quantize_row_tiles, quantize_rows, quantize_weight,
    quantize_weight_blocks,
)
from moetrain.precision.recipes import check_fp8_precision, check_fp8_wgrad

try:
    import triton
    import triton.language as tl
except ImportError:  # the CUDA path needs Triton (fp8_supported says so)
    triton = None


def fp8_supported(device: torch.device, precision: str = "fp8") -> tuple[bool, str]:
    """Whether the FP8 expert GEMMs of this recipe ("fp8" or "fp8_block") run on this device, and
    why not when they do not."""
    check_fp8_precision(precision)
    if device.type == "cpu":
        return True, "CPU: emulated in fp32"
    if device.type != "cuda":
        return False, f"{device.type} tensors (FP8 training runs on CUDA or emulated on the CPU)"
    if precision == "fp8" and (not hasattr(torch, "_scaled_grouped_mm") or triton is None):
        return False, f"torch {torch.__version__} without torch._scaled_grouped_mm or without Triton"
    if precision == "fp8_block" and triton is None:
        return False, "an install without Triton (fp8_block's GEMMs are moetrain.ops.triton_grouped's)"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return False, "GPU older than sm90 (Hopper): no FP8 grouped GEMM"
    return True, "CUDA sm90+"



# ---------------------------------------------------------------- GEMMs


ROWWISE_GEMMS = ("auto", "torch", "triton")
_rowwise_gemms = "auto"
# Hopper's FP8 tensor cores accumulate at reduced precision unless the sum is promoted to fp32 every
# few steps; torch._scaled_grouped_mm promotes, moetrain's Triton GEMMs (row-wise) do not. Measured
# on an H200 against fp32 GEMMs of the same FP8 operands, the Triton ones' error grows with the
# reduction: 4-8e-3 of the largest output up to 4096 terms, 1.0-1.7e-2 at 7168-28672 (torch's:
# 2-3.4e-3 throughout). "auto" takes them up to this length, where they also ran 1.2-3.4x faster.
FAST_ACCUMULATION_LIMIT = 4096


def set_rowwise_gemms(backend: str) -> None:
    """Which grouped GEMMs run precision="fp8" on CUDA: "torch" (torch._scaled_grouped_mm, fp32
    promotion), "triton" (moetrain.ops.triton_grouped, row-wise scales in the epilogue, the tensor
    cores' own accumulation) or "auto" (per GEMM: _triton_rows and _triton_columns)."""
    global _rowwise_gemms
    if backend not in ROWWISE_GEMMS:
        raise ValueError(f"backend must be one of {list(ROWWISE_GEMMS)}, got {backend!r}")
    _rowwise_gemms = backend


def _triton_rows(reduction: int) -> bool:
    """Forward and dgrad: the Triton GEMM where its sums are short enough (FAST_ACCUMULATION_LIMIT);
    it ran 1.2-1.4x faster than torch's on the moe_1b5, mixtral and dsv3 shapes, 3-3.4x on qwen3_30b's
    128 experts."""
    if _rowwise_gemms != "auto":
        return _rowwise_gemms == "triton"
    return reduction <= FAST_ACCUMULATION_LIMIT


def _triton_columns(num_experts: int, rows: int) -> bool:
    """wgrad, which sums over each expert's rows: the Triton GEMM ran 2x faster than torch's with 128
    experts of ~1024 rows (qwen3_30b), within 4 % with 8 of 8192 (moe_1b5), 10-60 % slower with 8 of
    2048 (mixtral) and 256 of 256 (dsv3): "auto" takes it for many experts of 512 rows or more."""
    if _rowwise_gemms != "auto":
        return _rowwise_gemms == "triton"
    per_expert = rows / max(num_experts, 1)
    return num_experts >= 64 and 512 <= per_expert <= FAST_ACCUMULATION_LIMIT


def rows_matmul(xq_RK, x_scale_R, wq_ENK, w_scale_EN, counts_E) -> torch.Tensor:
    """y[r] = (xq[r] * x_scale[r]) @ (wq[e] * w_scale[e, :, None]).T for each row's expert e -> bf16 [R, N]."""
    if xq_RK.size(0) == 0:
        return torch.zeros(0, wq_ENK.size(1), dtype=torch.bfloat16, device=xq_RK.device)
    if xq_RK.is_cuda:
        ends_E = group_ends(counts_E, xq_RK.size(0), xq_RK.device)
        if _triton_rows(xq_RK.size(1)):
            from moetrain.ops import triton_grouped  # noqa: PLC0415 - Triton is imported on first use

            return triton_grouped.grouped_mm(xq_RK, wq_ENK.transpose(1, 2), ends_E, a_scale=x_scale_R,
                                             b_scale=w_scale_EN)
        return torch._scaled_grouped_mm(xq_RK, wq_ENK.transpose(1, 2), x_scale_R, w_scale_EN, offs=ends_E,
                                        out_dtype=torch.bfloat16)
    x_RK = xq_RK.float() * x_scale_R.unsqueeze(1)
    w_EKN = (wq_ENK.float() * w_scale_EN.unsqueeze(2)).transpose(1, 2)
    return expert_matmul(x_RK, w_EKN, counts_E, None, backend="loop").to(torch.bfloat16)


def columns_matmul(aq_KP, a_scale_EK, bq_NP, b_scale_EN, counts_E) -> torch.Tensor:
    """dw[e] = A_e @ B_e.T over expert e's (padded) columns, with A_e = aq[:, cols_e] * a_scale[e, :, None]
    and B_e likewise -> bf16 [E, K, N]."""
    if aq_KP.size(1) == 0:
        return torch.zeros(counts_E.numel(), aq_KP.size(0), bq_NP.size(0), dtype=torch.bfloat16, device=aq_KP.device)
    ends_E = padded_ends(counts_E)
    if aq_KP.is_cuda:
        if _triton_columns(counts_E.numel(), aq_KP.size(1)):
            from moetrain.ops import triton_grouped  # noqa: PLC0415 - Triton is imported on first use

            return triton_grouped.grouped_mm_wgrad(aq_KP.t(), bq_NP.t(), ends_E, a_scale=a_scale_EK,
                                                   b_scale=b_scale_EN, out_dtype=torch.bfloat16)
        return torch._scaled_grouped_mm(aq_KP, bq_NP.t(), a_scale_EK.reshape(-1), b_scale_EN.reshape(-1),
                                        offs=ends_E, out_dtype=torch.bfloat16)
    ends = ends_E.tolist()
    starts = [0] + ends[:-1]
    a_KP, b_NP = aq_KP.float(), bq_NP.float()
    dw = [(a_KP[:, s:t] * a_scale_EK[e].unsqueeze(1)) @ (b_NP[:, s:t] * b_scale_EN[e].unsqueeze(1)).t()
          for e, (s, t) in enumerate(zip(starts, ends))]
    return torch.stack(dw).to(torch.bfloat16)


def block_rows_matmul(aq_RK, a_scale_RKb, bq_EKN, b_scale_EKbNb, counts_E) -> torch.Tensor:
    """c[r] = A[r] @ B[e] for each row's expert e -> bf16 [R, N], with A = aq scaled per 1x128 tile
    along K (a_scale [R, Kb]) and B = bq scaled per 128x128 block (b_scale [E, Kb, Nb]): the
    forward (b = w) and dgrad (b = w[e].T, K and N swapped) of fp8_block. bq may be any view; for
    the GPU's speed b[e] should have K contiguous. counts_E must sum to R."""
    rows, n = aq_RK.size(0), bq_EKN.size(2)
    if rows == 0:
        return torch.zeros(0, n, dtype=torch.bfloat16, device=aq_RK.device)
    if aq_RK.is_cuda:
        from moetrain.ops import triton_grouped  # noqa: PLC0415 - Triton is imported on first use

        return triton_grouped.grouped_mm(aq_RK, bq_EKN, group_ends(counts_E, rows, aq_RK.device), a_scale=a_scale_RKb,
                                         b_scale=b_scale_EKbNb, block=FP8_BLOCK, out_dtype=torch.bfloat16)
    a_RK = dequantize_fp8_groups(aq_RK, a_scale_RKb, FP8_BLOCK)
    b_EKN = dequantize_fp8_blocks(bq_EKN, b_scale_EKbNb)
    return expert_matmul(a_RK, b_EKN, counts_E, None, backend="loop").to(torch.bfloat16)


def block_columns_matmul(aq_RK, a_scale_RbK, bq_RN, b_scale_RbN, counts_E) -> torch.Tensor:
    """dw[e] = sum over expert e's rows r of A[r]^T B[r] -> bf16 [E, K, N], with A and B scaled per
    128x1 tile (a_scale [Rb, K], b_scale [Rb, N]: one scale per column and global 128-row block):
    fp8_block's weight gradient. aq and bq may be transposed views (the GPU reads them fastest with
    rows contiguous). counts_E must sum to R."""
    num_experts, rows, k, n = counts_E.numel(), aq_RK.size(0), aq_RK.size(1), bq_RN.size(1)
    if rows == 0:
        return torch.zeros(num_experts, k, n, dtype=torch.bfloat16, device=aq_RK.device)
    if aq_RK.is_cuda:
        from moetrain.ops import triton_grouped  # noqa: PLC0415 - Triton is imported on first use

        return triton_grouped.grouped_mm_wgrad(aq_RK, bq_RN, group_ends(counts_E, rows, aq_RK.device),
                                               a_scale=a_scale_RbK, b_scale=b_scale_RbN, block=FP8_BLOCK,
                                               out_dtype=torch.bfloat16)
    # A 128x1 tile is a 1x128 tile of the transpose.
    a_RK = dequantize_fp8_groups(aq_RK.t(), a_scale_RbK.t(), FP8_BLOCK).t()
    b_RN = dequantize_fp8_groups(bq_RN.t(), b_scale_RbN.t(), FP8_BLOCK).t()
    counts = counts_E.tolist()
    dw = [a_rK.t() @ b_rN for a_rK, b_rN in zip(torch.split(a_RK, counts), torch.split(b_RN, counts))]
    return torch.stack(dw).to(torch.bfloat16)


def _quantize_rows_of(precision: str, x_RK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's first operand: one scale per row ("fp8") or per 1x128 tile ("fp8_block")."""
    return quantize_row_tiles(x_RK) if precision == "fp8_block" else quantize_rows(x_RK)


def _forward_gemm(precision: str, xq_RK, x_scale, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """The forward GEMM on quantized rows (x_scale: [R] or [R, Kb]) -> bf16 [R, N]."""
    if precision == "fp8_block":
        wq_ENK, w_scale_EKbNb = quantize_weight_blocks(w_EKN, k_contiguous=True)
        return block_rows_matmul(xq_RK, x_scale, wq_ENK.transpose(1, 2), w_scale_EKbNb, counts_E)
    wq_ENK, w_scale_EN = quantize_weight(w_EKN, over=1)
    return rows_matmul(xq_RK, x_scale, wq_ENK, w_scale_EN, counts_E)


def _grad_input(precision: str, dy_RN: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """dgrad, dx = dy w[e]^T -> bf16 [R, K]."""
    dyq_RN, dy_scale = _quantize_rows_of(precision, dy_RN)
    if precision == "fp8_block":
        wq_EKN, w_scale_EKbNb = quantize_weight_blocks(w_EKN, k_contiguous=False)
        # the second operand is w[e].T [N, K], N (its reduction dim) contiguous
        return block_rows_matmul(dyq_RN, dy_scale, wq_EKN.transpose(1, 2), w_scale_EKbNb.transpose(1, 2).contiguous(),
                                 counts_E)
    return _grad_input_rows(dyq_RN, dy_scale, w_EKN, counts_E)


def _grad_input_rows(dyq_RN: torch.Tensor, dy_scale_R: torch.Tensor, w_EKN: torch.Tensor,
                     counts_E: torch.Tensor) -> torch.Tensor:
    """_grad_input ("fp8") on dy's E4M3 rows and scales."""
    wq_EKN, w_scale_EK = quantize_weight(w_EKN, over=2)
    return rows_matmul(dyq_RN, dy_scale_R, wq_EKN, w_scale_EK, counts_E)


def bf16_weight_grad(x_RK: torch.Tensor, dy_RN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """dw[e] = x_e^T dy_e over expert e's rows with both operands rounded to bf16, fp32 sums, bf16
    out [E, K, N]: the bf16 layer's weight gradient (torch._grouped_mm on CUDA; on the CPU the same
    rounding, one fp32 matmul per expert). counts_E must sum to R."""
    x_RK, dy_RN = x_RK.to(torch.bfloat16), dy_RN.to(torch.bfloat16)
    num_experts, rows = counts_E.numel(), x_RK.size(0)
    if rows == 0:
        return torch.zeros(num_experts, x_RK.size(1), dy_RN.size(1), dtype=torch.bfloat16, device=x_RK.device)
    if x_RK.is_cuda:
        return torch._grouped_mm(x_RK.t(), dy_RN, offs=group_ends(counts_E, rows, x_RK.device))
    counts = counts_E.tolist()
    dw = [x_rK.float().t() @ dy_rN.float() for x_rK, dy_rN in zip(torch.split(x_RK, counts), torch.split(dy_RN, counts))]
    return torch.stack(dw).to(torch.bfloat16)


def _grad_weight(precision: str, x_RK: torch.Tensor, dy_RN: torch.Tensor, counts_E: torch.Tensor,
                 wgrad: str) -> torch.Tensor:
    """wgrad, dw[e] = x_e^T dy_e -> bf16 [E, K, N]: in bf16 (wgrad="bf16") or in FP8 by the recipe."""
    if wgrad == "bf16":
        return bf16_weight_grad(x_RK, dy_RN, counts_E)
    if precision == "fp8_block":
        xq_KR, x_scale_RbK = quantize_column_tiles(x_RK)
        dyq_NR, dy_scale_RbN = quantize_column_tiles(dy_RN)
        return block_columns_matmul(xq_KR.t(), x_scale_RbK, dyq_NR.t(), dy_scale_RbN, counts_E)
    # padded rows: known on the host only from the counts; the CPU path needs them anyway and on
    # CUDA the worst case (every expert one row past a multiple) bounds it without a sync.
    padded = _padded_rows(counts_E, x_RK.size(0))
    xq_KP, x_scale_EK, dyq_NP, dy_scale_EN = quantize_column_pair(x_RK, dy_RN, counts_E, padded)
    return columns_matmul(xq_KP, x_scale_EK, dyq_NP, dy_scale_EN, counts_E)


# ---------------------------------------------------------------- autograd
#
# The FP8 GEMMs are custom operators with their gradients registered (torch.library), not
# autograd.Functions: torch.compile keeps each one whole in the model's graph, as one opaque call,
# and differentiates it by the registered formula. Traced as autograd.Functions (torch 2.11, H200)
# the GEMMs lost their gradients: the compiled backward quantized a zero-filled buffer in place of
# the gate-up GEMM's output gradient, and the loss ran as if the experts never trained. Only x, w
# and the counts are kept for backward: each GEMM quantizes its operands in the layout and scaling
# it needs. Each operator returns contiguous tensors, the layout its fake (shape-only) version
# promises the compiler.


@torch.library.custom_op("moetrain::fp8_grad_input", mutates_args=())
def _grad_input_op(dy_RN: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor, precision: str) -> torch.Tensor:
    return _grad_input(precision, dy_RN, w_EKN, counts_E).contiguous()


@_grad_input_op.register_fake
def _(dy_RN, w_EKN, counts_E, precision):
    return dy_RN.new_empty((dy_RN.size(0), w_EKN.size(1)), dtype=torch.bfloat16)


@torch.library.custom_op("moetrain::fp8_grad_weight", mutates_args=())
def _grad_weight_op(x_RK: torch.Tensor, dy_RN: torch.Tensor, counts_E: torch.Tensor, precision: str,
                    wgrad: str) -> torch.Tensor:
    return _grad_weight(precision, x_RK, dy_RN, counts_E, wgrad).contiguous()


@_grad_weight_op.register_fake
def _(x_RK, dy_RN, counts_E, precision, wgrad):
    return x_RK.new_empty((counts_E.size(0), x_RK.size(1), dy_RN.size(1)), dtype=torch.bfloat16)


@torch.library.custom_op("moetrain::fp8_expert_matmul", mutates_args=())
def _expert_matmul_op(x_RK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor, precision: str,
                      wgrad: str) -> torch.Tensor:
    xq_RK, x_scale = _quantize_rows_of(precision, x_RK)
    return _forward_gemm(precision, xq_RK, x_scale, w_EKN, counts_E).to(x_RK.dtype).contiguous()


@_expert_matmul_op.register_fake
def _(x_RK, w_EKN, counts_E, precision, wgrad):
    return x_RK.new_empty((x_RK.size(0), w_EKN.size(2)))


def _expert_matmul_setup(ctx, inputs, output) -> None:
    x_RK, w_EKN, counts_E, precision, wgrad = inputs
    ctx.save_for_backward(x_RK, w_EKN, counts_E)
    ctx.precision, ctx.wgrad = precision, wgrad


def _matmul_grads(dy_RN: torch.Tensor, x_RK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor,
                  precision: str, wgrad: str, need_x: bool, need_w: bool) -> tuple[torch.Tensor | None, ...]:
    """(dx, dw) of y = x w[e] over each expert's rows, None where not needed."""
    dy_RN = dy_RN.contiguous()
    grad_x = _grad_input_op(dy_RN, w_EKN, counts_E, precision).to(x_RK.dtype) if need_x else None
    grad_w = _grad_weight_op(x_RK, dy_RN, counts_E, precision, wgrad).to(w_EKN.dtype) if need_w else None
    return grad_x, grad_w


def _expert_matmul_backward(ctx, dy_RN):
    x_RK, w_EKN, counts_E = ctx.saved_tensors
    grad_x, grad_w = _matmul_grads(dy_RN, x_RK, w_EKN, counts_E, ctx.precision, ctx.wgrad, *ctx.needs_input_grad[:2])
    return grad_x, grad_w, None, None, None


_expert_matmul_op.register_autograd(_expert_matmul_backward, setup_context=_expert_matmul_setup)


def _source_rows(dest_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 [R]: the token whose copy row r of the expert layout holds (dest_TK[t, k] == r), T where
    no token's does (padding, dropped choices' slots). No host sync: the dropped choices (dest -1)
    write into a slot past the end, which is cut off."""
    tokens, top_k = dest_TK.shape
    flat_N = dest_TK.reshape(-1)
    slot_N = torch.where(flat_N >= 0, flat_N, num_rows)
    source = torch.full((num_rows + 1,), tokens, dtype=torch.int64, device=dest_TK.device)
    source.scatter_(0, slot_N, torch.arange(tokens * top_k, device=dest_TK.device) // top_k)
    return source[:num_rows]


def _gather_rows_eager(table_TC: torch.Tensor, source_R: torch.Tensor, pad: float) -> torch.Tensor:
    if table_TC.dtype == torch.float8_e4m3fn:  # moved as bytes (pad: a byte, 0 for +0)
        return _gather_rows_eager(table_TC.view(torch.uint8), source_R, pad).view(torch.float8_e4m3fn)
    return torch.cat([table_TC, table_TC.new_full((1, *table_TC.shape[1:]), pad)]).index_select(0, source_R)


if triton is not None:

    @triton.jit
    def _gather_rows_kernel(table_ptr, source_ptr, out_ptr, pad, T, R, C, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # ROWS rows a program, BLOCK values of a row at a time: out[r] = table[source[r]], or pad
        # where source[r] == T. Nothing is copied but the rows read: no padded table is built.
        row_I = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        source_I = tl.load(source_ptr + row_I, mask=row_I < R, other=T).to(tl.int64)
        for c0 in range(0, C, BLOCK):
            col_B = c0 + tl.arange(0, BLOCK)
            in_IB = (row_I[:, None] < R) & (col_B[None, :] < C)
            value_IB = tl.load(table_ptr + source_I[:, None] * C + col_B[None, :],
                               mask=in_IB & (source_I[:, None] < T), other=pad)
            tl.store(out_ptr + row_I[:, None] * C + col_B[None, :], value_IB, mask=in_IB)


GATHER_VALUES = 2048  # values a program of _gather_rows_kernel holds at a time


def _gather_rows_triton(table_TC: torch.Tensor, source_R: torch.Tensor, pad: float) -> torch.Tensor:
    """_gather_rows_eager in one Triton kernel (E4M3 moved as bytes)."""
    table_TC, source_R = table_TC.contiguous(), source_R.contiguous()
    if table_TC.dtype == torch.float8_e4m3fn:
        return _gather_rows_triton(table_TC.view(torch.uint8), source_R, pad).view(torch.float8_e4m3fn)
    tokens, rows = table_TC.size(0), source_R.size(0)
    out = table_TC.new_empty((rows, *table_TC.shape[1:]))
    width = table_TC.shape[1:].numel()
    if rows and width:
        block = min(triton.next_power_of_2(width), GATHER_VALUES)
        rows_each = max(1, GATHER_VALUES // block)
        with on_device_of(out):
            _gather_rows_kernel[(triton.cdiv(rows, rows_each),)](table_TC, source_R, out, pad, tokens, rows, width,
                                                                 ROWS=rows_each, BLOCK=block, num_warps=4)
    return out


@torch.library.custom_op("moetrain::fp8_gather_rows", mutates_args=())
def _gather_rows_op(table_TC: torch.Tensor, source_R: torch.Tensor, pad: float) -> torch.Tensor:
    if table_TC.is_cuda and triton is not None:
        return _gather_rows_triton(table_TC, source_R, pad)
    return _gather_rows_eager(table_TC, source_R, pad)


@_gather_rows_op.register_fake
def _(table_TC, source_R, pad):
    return table_TC.new_empty((source_R.size(0), *table_TC.shape[1:]))


def _gather_rows(table_TC: torch.Tensor, source_R: torch.Tensor, pad: float) -> torch.Tensor:
    """table[source[r]] for each row r, with `pad` where source[r] == T (one row past the table). A
    custom op on every device (the CPU runs the GPU's code path), so that torch.compile sees no
    reinterpretation of E4M3 values as bytes."""
    return _gather_rows_op(table_TC.contiguous(), source_R, float(pad))


def _quantized_copies(precision: str, x_TK: torch.Tensor, source_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token quantized once (the forward's recipe), its E4M3 values and scales gathered into
    the rows source_R names; a row no token fills is zero, as dispatch leaves it: zero values,
    scale 1."""
    xq_TK, x_scale_T = _quantize_rows_of(precision, x_TK)
    return _gather_rows(xq_TK, source_R, 0.0), _gather_rows(x_scale_T, source_R, 1.0)


@torch.library.custom_op("moetrain::fp8_token_matmul", mutates_args=())
def _token_matmul_op(x_TK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor, dest_TK: torch.Tensor,
                     num_rows: int, precision: str, wgrad: str, impl: str) -> torch.Tensor:
    """_expert_matmul_op on rows that are copies of tokens (TokenRows): each token is quantized once,
    before dispatch, and its FP8 values and scales are gathered into the expert layout (half a bf16
    dispatch's bytes; a token's copies quantize alike, so the GEMM's operands are the same bit for
    bit). Backward sums the copies' input gradients into their tokens (dispatch's backward), and
    dispatches the tokens again for the weight gradient instead of keeping the bf16 rows."""
    return _token_gemm(precision, x_TK, w_EKN, counts_E, dest_TK, num_rows)


def _token_gemm(precision: str, x_TK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor,
                dest_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The forward GEMM on the tokens' quantized copies in the expert layout -> [R, N] in x's dtype."""
    xq_RK, x_scale_R = _quantized_copies(precision, x_TK, _source_rows(dest_TK, num_rows))
    return _forward_gemm(precision, xq_RK, x_scale_R, w_EKN, counts_E).to(x_TK.dtype).contiguous()


@_token_matmul_op.register_fake
def _(x_TK, w_EKN, counts_E, dest_TK, num_rows, precision, wgrad, impl):
    return x_TK.new_empty((num_rows, w_EKN.size(2)))


def _token_matmul_setup(ctx, inputs, output) -> None:
    x_TK, w_EKN, counts_E, dest_TK, num_rows, precision, wgrad, impl = inputs
    ctx.save_for_backward(x_TK, w_EKN, counts_E, dest_TK)
    ctx.num_rows, ctx.precision, ctx.wgrad, ctx.impl = num_rows, precision, wgrad, impl


def _token_matmul_backward(ctx, dy_RN):
    x_TK, w_EKN, counts_E, dest_TK = ctx.saved_tensors
    dy_RN = dy_RN.contiguous()
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        dx_RK = _grad_input_op(dy_RN, w_EKN, counts_E, ctx.precision).to(x_TK.dtype)
        grad_x = ops.sum_copies(dx_RK, dest_TK, ctx.impl)
    if ctx.needs_input_grad[1]:
        x_RK = ops.dispatch(x_TK, dest_TK, ctx.num_rows, impl=ctx.impl)
        grad_w = _grad_weight_op(x_RK, dy_RN, counts_E, ctx.precision, ctx.wgrad).to(w_EKN.dtype)
    return grad_x, grad_w, None, None, None, None, None, None


_token_matmul_op.register_autograd(_token_matmul_backward, setup_context=_token_matmul_setup)


# ---------------------------------------------------------------- SwiGLU experts, fused ("fp8")
#
# The routed SwiGLU experts in row-wise FP8 as two operators instead of three: the gate-up GEMM on the
# tokens' rows with the SwiGLU activation after it, whose kernel also writes h's E4M3 rows (the
# down GEMM's operand), and whose backward's kernel writes d(gate-up) with its E4M3 rows (the gate-up
# dgrad's operand); then the down GEMM on h's rows so quantized. Unfused, each of those two
# quantizations reads its bf16 rows once more (h: R x H, d(gate-up): R x 2H). The gate-up GEMM's
# input rows are copied from the tokens and quantized in one pass on the GPU (the bf16 rows kept for
# the weight gradient, the E4M3 rows for the GEMM), instead of the token path's quantizing, gathering
# the E4M3 rows, and dispatching the tokens again in the backward. The same kernels' and quantizers'
# arithmetic: the result and every gradient are the unfused path's, bit for bit.


def _swiglu_rows(gate_up_RN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h = silu(gate) * up of interleaved [R, 2H], and h's E4M3 rows and scales."""
    if swiglu.kernel_runs(gate_up_RN, "silu"):
        return kernels.swiglu_quantize(gate_up_RN)
    h_RH = swiglu.reference(gate_up_RN)  # gated_activation's torch path
    return (h_RH, *quantize_rows(h_RH))


@torch.library.custom_op("moetrain::fp8_swiglu_backward", mutates_args=())
def _swiglu_backward_op(grad_h_RH: torch.Tensor, gate_up_RN: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d(gate, up) of h = silu(gate) * up, and its E4M3 rows and scales (one per row of 2H)."""
    if swiglu.kernel_runs(gate_up_RN, "silu"):
        return kernels.swiglu_backward_quantize(grad_h_RH, gate_up_RN)
    # what autograd computes for reference()'s silu(gate) * up, op by op in the operands' dtype
    gate, up = swiglu.split_gate_up(gate_up_RN)
    grad_gate = torch.ops.aten.silu_backward(grad_h_RH * up, gate)
    grad_RN = swiglu.interleave_gate_up(grad_gate, grad_h_RH * torch.nn.functional.silu(gate))
    return (grad_RN, *quantize_rows(grad_RN))


@_swiglu_backward_op.register_fake
def _(grad_h_RH, gate_up_RN):
    return (torch.empty_like(gate_up_RN), torch.empty_like(gate_up_RN, dtype=torch.float8_e4m3fn),
            gate_up_RN.new_empty(gate_up_RN.size(0), dtype=torch.float32))


@torch.library.custom_op("moetrain::fp8_grad_input_quantized", mutates_args=())
def _grad_input_quantized_op(dyq_RN: torch.Tensor, dy_scale_R: torch.Tensor, w_EKN: torch.Tensor,
                             counts_E: torch.Tensor) -> torch.Tensor:
    """_grad_input ("fp8") on dy's E4M3 rows, quantized by the caller."""
    return _grad_input_rows(dyq_RN, dy_scale_R, w_EKN, counts_E).contiguous()


@_grad_input_quantized_op.register_fake
def _(dyq_RN, dy_scale_R, w_EKN, counts_E):
    return dyq_RN.new_empty((dyq_RN.size(0), w_EKN.size(1)), dtype=torch.bfloat16)


def _dispatched_rows(x_TK: torch.Tensor, dest_TK: torch.Tensor, num_rows: int, impl: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows dispatch makes of the tokens (moetrain.ops.dispatch), and their E4M3 rows and scales
    ("fp8"), on the GPU in one pass that reads each copied row once."""
    if x_TK.is_cuda and kernels.available():
        return kernels.dispatch_quantize(x_TK, _source_rows(dest_TK, num_rows))
    x_RK = ops.dispatch(x_TK, dest_TK, num_rows, impl=impl)
    return (x_RK, *quantize_rows(x_RK))


@torch.library.custom_op("moetrain::fp8_token_swiglu", mutates_args=())
def _token_swiglu_op(x_TK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor, dest_TK: torch.Tensor,
                     num_rows: int, wgrad: str, impl: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gate-up GEMM ("fp8") on the rows dispatch makes of x_TK, then SwiGLU -> (gate_up [R, 2H] and
    the bf16 rows x_RK [R, K], both kept for backward; h [R, H]; h's E4M3 rows and scales). x's rows
    are copied and quantized in one pass, and kept for the weight gradient: the backward does not
    dispatch the tokens again (one [R, K] tensor more held from forward to backward)."""
    x_RK, xq_RK, x_scale_R = _dispatched_rows(x_TK, dest_TK, num_rows, impl)
    gate_up_RN = _forward_gemm("fp8", xq_RK, x_scale_R, w_EKN, counts_E).to(x_TK.dtype).contiguous()
    return (gate_up_RN, *_swiglu_rows(gate_up_RN), x_RK)


@_token_swiglu_op.register_fake
def _(x_TK, w_EKN, counts_E, dest_TK, num_rows, wgrad, impl):
    hidden = w_EKN.size(2) // 2
    return (x_TK.new_empty((num_rows, 2 * hidden)), x_TK.new_empty((num_rows, hidden)),
            x_TK.new_empty((num_rows, hidden), dtype=torch.float8_e4m3fn),
            x_TK.new_empty((num_rows,), dtype=torch.float32), x_TK.new_empty((num_rows, x_TK.size(1))))


def _token_swiglu_setup(ctx, inputs, output) -> None:
    x_TK, w_EKN, counts_E, dest_TK, num_rows, wgrad, impl = inputs
    ctx.save_for_backward(output[4], w_EKN, counts_E, dest_TK, output[0])
    ctx.wgrad, ctx.impl = wgrad, impl


def _token_swiglu_backward(ctx, _grad_gate_up, grad_h_RH, _grad_hq, _grad_h_scale, _grad_x_RK):
    # gate_up and x_RK are outputs only to be kept for backward: nothing downstream reads them.
    x_RK, w_EKN, counts_E, dest_TK, gate_up_RN = ctx.saved_tensors
    grad_RN, gradq_RN, grad_scale_R = _swiglu_backward_op(grad_h_RH.contiguous(), gate_up_RN)
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        dx_RK = _grad_input_quantized_op(gradq_RN, grad_scale_R, w_EKN, counts_E).to(x_RK.dtype)
        grad_x = ops.sum_copies(dx_RK, dest_TK, ctx.impl)
    if ctx.needs_input_grad[1]:
        grad_w = _grad_weight_op(x_RK, grad_RN, counts_E, "fp8", ctx.wgrad).to(w_EKN.dtype)
    return grad_x, grad_w, None, None, None, None, None


_token_swiglu_op.register_autograd(_token_swiglu_backward, setup_context=_token_swiglu_setup)


@torch.library.custom_op("moetrain::fp8_quantized_rows_matmul", mutates_args=())
def _quantized_rows_matmul_op(x_RK: torch.Tensor, xq_RK: torch.Tensor, x_scale_R: torch.Tensor, w_EKN: torch.Tensor,
                              counts_E: torch.Tensor, wgrad: str) -> torch.Tensor:
    """_expert_matmul_op ("fp8") on x's E4M3 rows, quantized by the caller; x is kept for the weight
    gradient."""
    return _forward_gemm("fp8", xq_RK, x_scale_R, w_EKN, counts_E).to(x_RK.dtype).contiguous()


@_quantized_rows_matmul_op.register_fake
def _(x_RK, xq_RK, x_scale_R, w_EKN, counts_E, wgrad):
    return x_RK.new_empty((x_RK.size(0), w_EKN.size(2)))


def _quantized_rows_matmul_setup(ctx, inputs, output) -> None:
    x_RK, _, _, w_EKN, counts_E, wgrad = inputs
    ctx.save_for_backward(x_RK, w_EKN, counts_E)
    ctx.wgrad = wgrad


def _quantized_rows_matmul_backward(ctx, dy_RN):
    x_RK, w_EKN, counts_E = ctx.saved_tensors
    grad_x, grad_w = _matmul_grads(dy_RN, x_RK, w_EKN, counts_E, "fp8", ctx.wgrad, ctx.needs_input_grad[0],
                                   ctx.needs_input_grad[3])
    return grad_x, None, None, grad_w, None, None


_quantized_rows_matmul_op.register_autograd(_quantized_rows_matmul_backward, setup_context=_quantized_rows_matmul_setup)


def fp8_token_swiglu_experts(x_TK: torch.Tensor, dest_TK: torch.Tensor, num_rows: int, w_gate_up_EDN: torch.Tensor,
                             w_down_EHD: torch.Tensor, counts_E: torch.Tensor | list[int], capacity: int | None,
                             impl: str = "kernel", wgrad: str = "bf16") -> torch.Tensor:
    """The routed SwiGLU experts (gate and up interleaved in w_gate_up, moetrain.ops.swiglu; SiLU) on
    the rows dispatch would make of x_TK, in row-wise FP8 ("fp8"): fp8_token_matmul with the gate-up
    weight, gated_activation, fp8_expert_matmul with the down weight, with the SwiGLU kernels writing
    the E4M3 rows the next GEMM reads (see above). The same output and gradients bit for bit, [R, D]."""
    counts_E = _fp8_counts("fp8", wgrad, x_TK.device, w_gate_up_EDN.size(0), num_rows, counts_E, capacity)
    x_TK = _autocast_input(x_TK)
    with torch.autocast(x_TK.device.type, enabled=False):
        _, h_RH, hq_RH, h_scale_R, _ = _token_swiglu_op(x_TK.contiguous(), w_gate_up_EDN, counts_E,
                                                        dest_TK.contiguous(), num_rows, wgrad, impl)
        return _quantized_rows_matmul_op(h_RH, hq_RH, h_scale_R, w_down_EHD, counts_E, wgrad)


def _padded_rows(counts_E: torch.Tensor, num_rows: int) -> int:
    """P: a bound on the padded row count that needs no host sync on CUDA (each expert adds at most
    ALIGN - 1 rows); on the CPU the exact count."""
    if num_rows == 0:
        return 0
    if counts_E.is_cuda:
        return -(-num_rows // ALIGN) * ALIGN + counts_E.numel() * ALIGN
    return int(padded_ends(counts_E)[-1]) if counts_E.numel() else 0


def _fp8_counts(precision: str, wgrad: str, device: torch.device, num_experts: int, rows: int, counts_E,
                capacity: int | None):
    """Checks precision, wgrad and the device; counts_E as int64 on the device, the last expert
    owning the padding rows (zeros in, unread out)."""
    check_fp8_precision(precision)
    check_fp8_wgrad(wgrad)
    ok, why = fp8_supported(device, precision)
    if not ok:
        raise ValueError(f"precision={precision!r} cannot run on {why}; use precision='bf16'")
    if capacity is not None:
        counts_E = [capacity] * num_experts
    counts_E = torch.as_tensor(counts_E, device=device).to(torch.int64, copy=True)
    counts_E[-1] += rows - counts_E.sum()
    return counts_E


def _autocast_input(x: torch.Tensor) -> torch.Tensor:
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


def fp8_expert_matmul(x_RK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor | list[int],
                      capacity: int | None, precision: str = "fp8", wgrad: str = "bf16") -> torch.Tensor:
    """y[r] = x[r] @ w[expert_of(r)] with the forward and dgrad GEMMs in FP8, scaled by the recipe
    `precision` ("fp8": row-wise, "fp8_block": DeepSeek-V3's blocks; module docstring), and the
    weight gradient's GEMM in bf16 (wgrad="bf16") or FP8 by the same recipe (wgrad="fp8"); the same
    layouts and arguments as moetrain.ops.grouped.expert_matmul."""
    counts_E = _fp8_counts(precision, wgrad, x_RK.device, w_EKN.size(0), x_RK.size(0), counts_E, capacity)
    x_RK = _autocast_input(x_RK)
    with torch.autocast(x_RK.device.type, enabled=False):
        return _expert_matmul_op(x_RK, w_EKN, counts_E, precision, wgrad)


def fp8_token_matmul(x_TK: torch.Tensor, dest_TK: torch.Tensor, num_rows: int, w_EKN: torch.Tensor,
                     counts_E: torch.Tensor | list[int], capacity: int | None, precision: str = "fp8",
                     impl: str = "kernel", wgrad: str = "bf16") -> torch.Tensor:
    """fp8_expert_matmul of the expert-major rows that dispatch (moetrain.ops.dispatch(x_TK,
    dest_TK, num_rows, impl)) would make, without making them: each token is quantized once and
    its FP8 rows gathered (_token_matmul_op). The same result and gradients bit for bit; the input
    gradient is in token order, [T, K]."""
    counts_E = _fp8_counts(precision, wgrad, x_TK.device, w_EKN.size(0), num_rows, counts_E, capacity)
    x_TK = _autocast_input(x_TK)
    with torch.autocast(x_TK.device.type, enabled=False):
        return _token_matmul_op(x_TK.contiguous(), w_EKN, counts_E, dest_TK.contiguous(), num_rows, precision,
                                wgrad, impl)


def dequantize_rows_of(precision: str, xq_RK: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of rows quantized by the forward's recipe (_quantize_rows_of)."""
    if precision == "fp8_block":
        return dequantize_fp8_groups(xq_RK, x_scale, FP8_BLOCK)
    return dequantize_fp8_groups(xq_RK, x_scale.view(-1, 1), max(1, xq_RK.size(1)))


# Packing and unpacking reinterpret E4M3 values and fp32 scales as bytes: custom ops, so that
# torch.compile never sees those reinterpretations (as moetrain::fp8_gather_rows).
@torch.library.custom_op("moetrain::fp8_pack_rows", mutates_args=())
def _pack_rows_op(xq_RK: torch.Tensor, scale_RS: torch.Tensor) -> torch.Tensor:
    return torch.cat([xq_RK.view(torch.uint8), scale_RS.contiguous().view(torch.uint8)], dim=1)


@_pack_rows_op.register_fake
def _(xq_RK, scale_RS):
    return xq_RK.new_empty((xq_RK.size(0), xq_RK.size(1) + 4 * scale_RS.size(1)), dtype=torch.uint8)


@torch.library.custom_op("moetrain::fp8_unpack_rows", mutates_args=())
def _unpack_rows_op(packed_RB: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values = packed_RB[:, :k].clone(memory_format=torch.contiguous_format)
    scales = packed_RB[:, k:].clone(memory_format=torch.contiguous_format)
    return values.view(torch.float8_e4m3fn), scales.view(torch.float32)


@_unpack_rows_op.register_fake
def _(packed_RB, k):
    rows = packed_RB.size(0)
    return (packed_RB.new_empty((rows, k), dtype=torch.float8_e4m3fn),
            packed_RB.new_empty((rows, (packed_RB.size(1) - k) // 4), dtype=torch.float32))


def _pack_rows(xq_RK: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """uint8 [R, K + 4 S]: each row's E4M3 values, then its S fp32 scales' bytes (one exchange)."""
    return _pack_rows_op(xq_RK.contiguous(), x_scale if x_scale.dim() == 2 else x_scale.unsqueeze(1))


def _unpack_rows(packed_RB: torch.Tensor, k: int, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    xq_RK, x_scale_RS = _unpack_rows_op(packed_RB, k)
    return xq_RK, (x_scale_RS if precision == "fp8_block" else x_scale_RS.view(-1))


class _FP8ExchangedMatmul(torch.autograd.Function):
    """_token_matmul_op across ranks (expert parallelism): each token is quantized once, on its own
    rank, and its E4M3 rows travel to their experts' ranks with their scales, packed as bytes in one
    exchange: K + 4 bytes a row ("fp8"; K + 4 K/128 for "fp8_block") against 2 K for bf16. The
    forward GEMM multiplies them as received: the same operands, bit for bit, as in one process.
    Backward: the input gradient (bf16) travels back and is summed over each token's copies. The
    weight gradient is taken from the received rows, dequantized (wgrad="fp8": and quantized again
    per column, DeepSeek-V3's double quantization), since the bf16 rows never reach the expert's
    rank: the one numerical difference from one process."""

    @staticmethod
    def forward(ctx, x_TK, w_EKN, counts_E, dest_TK, num_rows, precision, wgrad, impl, exchange):
        source_S = _source_rows(dest_TK, num_rows)[:exchange.sent_rows]
        packed_SB = _pack_rows(*_quantized_copies(precision, x_TK, source_S))
        xq_RK, x_scale_R = _unpack_rows(exchange.to_experts(packed_SB), x_TK.size(1), precision)
        ctx.save_for_backward(xq_RK, x_scale_R, w_EKN, counts_E, dest_TK)
        ctx.num_rows, ctx.precision, ctx.wgrad, ctx.impl = num_rows, precision, wgrad, impl
        ctx.exchange, ctx.dtype = exchange, x_TK.dtype
        return _forward_gemm(precision, xq_RK, x_scale_R, w_EKN, counts_E).to(x_TK.dtype)

    @staticmethod
    def backward(ctx, dy_RN):
        xq_RK, x_scale_R, w_EKN, counts_E, dest_TK = ctx.saved_tensors
        dy_RN = dy_RN.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            dx_SK = ctx.exchange.to_tokens(_grad_input(ctx.precision, dy_RN, w_EKN, counts_E).to(ctx.dtype))
            unsent = dx_SK.new_zeros(ctx.num_rows - dx_SK.size(0), dx_SK.size(1))
            grad_x = ops.sum_copies(torch.cat([dx_SK, unsent]), dest_TK, ctx.impl)
        if ctx.needs_input_grad[1]:
            x_RK = dequantize_rows_of(ctx.precision, xq_RK, x_scale_R).to(ctx.dtype)
            grad_w = _grad_weight(ctx.precision, x_RK, dy_RN, counts_E, ctx.wgrad).to(w_EKN.dtype)
        return grad_x, grad_w, None, None, None, None, None, None, None


def _apply_without_autocast(function: type[torch.autograd.Function], *args) -> torch.Tensor:
    with torch.autocast(args[0].device.type, enabled=False):
        return function.apply(*args)


def fp8_exchanged_matmul(x_TK: torch.Tensor, dest_TK: torch.Tensor, num_rows: int, exchange, w_EKN: torch.Tensor,
                         counts_E: torch.Tensor | list[int], precision: str = "fp8",
                         impl: str = "kernel", wgrad: str = "bf16") -> torch.Tensor:
    """fp8_token_matmul whose rows live on other ranks (_FP8ExchangedMatmul). This rank's rows are
    the first exchange.sent_rows of the expert-major rows dispatch(x_TK, dest_TK, num_rows) would
    make; `exchange` moves rows between the ranks: exchange.to_experts(rows [sent_rows, B]) ->
    [exchange.received_rows, B], the rows of this rank's experts (w_EKN, counts_E: packed, in
    expert order), and exchange.to_tokens, the way back. Returns those rows' products; the input
    gradient is in token order, [T, K]."""
    counts_E = _fp8_counts(precision, wgrad, x_TK.device, w_EKN.size(0), exchange.received_rows, counts_E, None)
    x_TK = _autocast_input(x_TK)
    # The exchange is no tensor, so this autograd.Function cannot be an operator: on CUDA, where
    # torch.compile lost the FP8 GEMMs' gradients when it traced them, it runs outside the graph.
    apply = outside_the_graph(_apply_without_autocast) if x_TK.is_cuda else _apply_without_autocast
    return apply(_FP8ExchangedMatmul, x_TK.contiguous(), w_EKN, counts_E, dest_TK.contiguous(), num_rows, precision,
                 wgrad, impl, exchange)
