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
each token's copies (dispatch's backward). Under expert parallelism the E4M3 rows travel to the
experts' ranks (fp8_exchanged_matmul, the dropless layout at r = 1): there the weight gradient is
taken from the received rows, dequantized (and with wgrad="fp8" quantized again per column:
DeepSeek-V3's double quantization).

Shape letters: R rows (expert-major, packed or padded), K input features, N output features,
E experts, P rows padded per expert to multiples of ALIGN; Kb, Nb, Rb those dims in 128-blocks.
"""

from __future__ import annotations

import contextlib

import torch

from moetrain import ops
from moetrain.ops.grouped import expert_matmul, expert_of_rows, group_ends
from moetrain.precision import kernels
from moetrain.precision.formats import (
    FP8_BLOCK, dequantize_fp8_blocks, dequantize_fp8_groups, e4m3_encode, finite_amax, fp8_scale, quantize_fp8_blocks,
    quantize_fp8_groups,
)
from moetrain.precision.recipes import check_fp8_precision, check_fp8_wgrad

try:
    import triton
    import triton.language as tl
except ImportError:  # the CUDA path needs Triton (fp8_supported says so)
    triton = None

ALIGN = 16  # rows of each expert in the weight-gradient GEMM: a multiple of 16 bytes of E4M3


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


# ---------------------------------------------------------------- quantization


def quantize_weight(w_EKN: torch.Tensor, over: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 copy of w with one fp32 scale per column (over=1: scales [E, N], values stored [E, N, K]
    contiguous) or per row (over=2: scales [E, K], values [E, K, N]): both are the layouts the
    grouped GEMM reads its second operand in (K-major for the forward, N-major for dgrad)."""
    if w_EKN.is_cuda and triton is not None:
        return _quantize_weight_cuda(w_EKN.contiguous(), over)
    w = w_EKN.float()
    amax, finite = finite_amax(w, over)
    scale = fp8_scale(amax, finite)
    q = e4m3_encode(w / scale.unsqueeze(over))
    return (q.transpose(1, 2).contiguous() if over == 1 else q), scale


def quantize_rows(x_RK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values [R, K] and one fp32 scale per row [R]."""
    if x_RK.is_cuda:
        q_RK, scale_R1 = kernels.quantize_fp8(x_RK.contiguous(), x_RK.size(1))
    else:
        q_RK, scale_R1 = quantize_fp8_groups(x_RK, max(1, x_RK.size(1)))
    return q_RK, scale_R1.view(-1)


def padded_ends(counts_E: torch.Tensor) -> torch.Tensor:
    """int32 end of each expert's rows once every expert's row count is rounded up to ALIGN."""
    return torch.cumsum((counts_E + ALIGN - 1) // ALIGN * ALIGN, 0, dtype=torch.int32)


def quantize_columns(x_RC: torch.Tensor, counts_E: torch.Tensor, padded_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x transposed and quantized per expert and column: values [C, P] (expert e's rows at columns
    padded_ends[e-1] ..., zero up to padded_ends[e]) and fp32 scales [E, C], each over that expert's
    rows. counts_E must sum to R (the last expert owns any padding rows). padded_rows: P, the last
    of padded_ends (given so that the CUDA path does not wait for the GPU)."""
    num_experts, cols = counts_E.numel(), x_RC.size(1)
    if x_RC.is_cuda:
        return tuple(_quantize_columns_cuda([x_RC.contiguous()], counts_E.to(torch.int32), padded_rows))
    q_CP = torch.zeros(cols, padded_rows, dtype=torch.float8_e4m3fn)
    scale_EC = torch.ones(num_experts, cols, dtype=torch.float32)  # 1: an expert without rows
    padded_starts = [0] + padded_ends(counts_E).tolist()[:-1]
    for e, (x_cR, padded_start) in enumerate(zip(torch.split(x_RC.float().t(), counts_E.tolist(), dim=1),
                                                  padded_starts)):
        if x_cR.size(1):
            scale_EC[e] = fp8_scale(*finite_amax(x_cR, 1))
            q_CP[:, padded_start:padded_start + x_cR.size(1)] = e4m3_encode(x_cR / scale_EC[e].unsqueeze(1))
    return q_CP, scale_EC


def quantize_column_pair(a_RK: torch.Tensor, b_RN: torch.Tensor, counts_E: torch.Tensor,
                         padded_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_columns of both operands of a weight-gradient GEMM, which share their rows' experts:
    (a values, a scales, b values, b scales). On CUDA one call, whose row layout (each row's expert,
    the padded ends) is computed once for both."""
    if a_RK.is_cuda:
        return tuple(_quantize_columns_cuda([a_RK.contiguous(), b_RN.contiguous()], counts_E.to(torch.int32),
                                            padded_rows))
    return quantize_columns(a_RK, counts_E, padded_rows) + quantize_columns(b_RN, counts_E, padded_rows)


if triton is not None:
    from moetrain.precision.kernels import _e4m3_codes, _fp8_scale

    @triton.jit
    def _row_experts(expert_ptr, rows, row_ok, rows_per_matrix, PACKED: tl.constexpr):
        """The expert of each row: from the per-row map (PACKED) or a stack of equal matrices."""
        if PACKED:
            return tl.load(expert_ptr + rows, mask=row_ok, other=0)
        return rows // rows_per_matrix

    @triton.jit
    def _column_amax_kernel(x_ptr, expert_ptr, amax_ptr, R, C, rows_per_matrix,
                            PACKED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """amax[e, c] = max over expert e's rows of |x[r, c]|, +Inf where one of them is not finite.
        One program per tile of rows and columns; each expert the tile holds takes an atomic max."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        row_ok, col_ok = rows < R, cols < C
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        magnitude = tl.where(tl.abs(x) < float("inf"), tl.abs(x), float("inf"))  # NaN counts as +Inf
        expert = _row_experts(expert_ptr, rows, row_ok, rows_per_matrix, PACKED)
        first = tl.min(tl.where(row_ok, expert, 2**30))
        last = tl.max(tl.where(row_ok, expert, -1))
        for e in range(first, last + 1):
            mine = tl.max(tl.where((expert == e)[:, None], magnitude, 0.0), axis=0)
            tl.atomic_max(amax_ptr + e * C + cols, mine, mask=col_ok, sem="relaxed")

    @triton.jit
    def _fp8_scales_kernel(amax_ptr, n, BLOCK: tl.constexpr):
        """In place, amax -> formats.fp8_scale(amax, amax < inf) (the amax kernel's +Inf stands for
        a non-finite value): one launch where torch takes eight small operations."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        amax = tl.load(amax_ptr + i, mask=ok, other=0.0)
        tl.store(amax_ptr + i, _fp8_scale(amax, amax < float("inf")), mask=ok)

    @triton.jit
    def _quantize_transposed_kernel(x_ptr, block_expert_ptr, ends_ptr, padded_ends_ptr, scale_ptr, q_ptr,
                                    R, C, P, E, rows_per_matrix, stride_qe, stride_qc, PACKED: tl.constexpr,
                                    ALIGN_ROWS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        """q[c, p] = x[row(p), c] / scale[e, c] in E4M3: e4m3_encode's arithmetic (IEEE division,
        saturation, round to nearest even) with the scales fp8_scale made. One program per tile of
        output places p and columns, so that each column's places are stored contiguously (a tile
        walked by input rows scatters single bytes C apart). PACKED: p runs over the [C, P] layout
        where expert e's rows sit at padded_ends[e-1] ... and zeros fill each expert's places up to
        padded_ends[e] and everything past the last expert (block_expert: the expert of each
        ALIGN_ROWS places, E past the last); otherwise program 0 is a matrix e of rows_per_matrix
        stacked rows (the last may be shorter), its row p written at e * stride_qe + c * stride_qc +
        p ([E, C, rows] for weights, [C, R] for 128x1 tiles)."""
        cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_ok = cols < C
        if PACKED:
            places = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
            in_range = places < P
            expert = tl.load(block_expert_ptr + places // ALIGN_ROWS, mask=in_range, other=E)
            has_expert = expert < E
            later = has_expert & (expert > 0)
            rows = (places - tl.load(padded_ends_ptr + expert - 1, mask=later, other=0)
                    + tl.load(ends_ptr + expert - 1, mask=later, other=0))
            row_ok = has_expert & (rows < tl.load(ends_ptr + expert, mask=has_expert, other=0))
            store_ok = in_range[:, None] & col_ok[None, :]  # padding places are written as zeros
            out = cols.to(tl.int64)[None, :] * stride_qc + places[:, None]
        else:
            matrix = tl.program_id(0)
            places = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
            rows = matrix * rows_per_matrix + places
            row_ok = (places < rows_per_matrix) & (rows < R)
            expert = tl.zeros([BLOCK_P], tl.int32) + matrix
            store_ok = row_ok[:, None] & col_ok[None, :]
            out = matrix.to(tl.int64) * stride_qe + cols.to(tl.int64)[None, :] * stride_qc + places[:, None]
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # A tile of one expert (the common case) reads one row of scales; others gather them per place.
        lowest = tl.min(expert)
        mixed = lowest != tl.max(expert)
        scale_row = tl.load(scale_ptr + lowest * C + cols, mask=col_ok & (lowest < E), other=1.0)
        scale_each = tl.load(scale_ptr + expert[:, None] * C + cols[None, :], mask=mask & mixed, other=1.0)
        scale = tl.where(mixed, scale_each, scale_row[None, :])
        tl.store(q_ptr + out, _e4m3_codes(x, scale).to(tl.uint8, bitcast=True), mask=store_ok)


# Tiles and warps, the fastest of those timed on an H200 (amax: 64-256 x 64-256 tiles, 4 or 8 warps;
# the transposing kernel: 64-256 places x 64-256 columns, 4 or 8 warps; 65536-131072 rows of
# 1536-4096 columns): the column amax's tiles (rows x columns), places (output rows of q's
# transposed layout) x columns per quantizing tile.
_AMAX_ROWS, _AMAX_COLS, _AMAX_WARPS = 64, 128, 4
_BLOCK_P, _BLOCK_C, _TRANSPOSED_WARPS = 64, 64, 4


def _packed_layout(counts_E: torch.Tensor, rows: int, places: int) -> tuple[torch.Tensor, ...]:
    """What the column kernels read of the packed layout: each expert's end row and padded end
    (int32), each row's expert, and the expert of each ALIGN places of q (num_experts past the last)."""
    ends_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    padded_ends_E = padded_ends(counts_E)
    block_expert = torch.searchsorted(padded_ends_E, torch.arange(0, places, ALIGN, device=counts_E.device,
                                                                  dtype=torch.int32), right=True, out_int32=True)
    return ends_E, padded_ends_E, expert_of_rows(counts_E, rows), block_expert


def _quantize_transposed(x_RC: torch.Tensor, num_experts: int, counts_E: torch.Tensor | None, q: torch.Tensor,
                         stride_qe: int, stride_qc: int, rows_per_matrix: int | None = None,
                         layout: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """Per-(expert, column) amax (a kernel), the scales from it (a kernel, formats.fp8_scale: 1 for an
    expert without rows or a zero column, NaN for a non-finite one), then quantize x into q transposed (a
    kernel); returns the scales [E, C]. counts_E: the packed layout's rows per expert (q is [C, P],
    P = q.size(1), written whole) and layout its _packed_layout (made here when None); counts_E None:
    x is num_experts matrices of rows_per_matrix rows stacked (default R / num_experts; the last one
    may be shorter)."""
    rows, cols = x_RC.shape
    amax_EC = torch.zeros(num_experts, cols, dtype=torch.float32, device=x_RC.device)
    packed = counts_E is not None
    column_tiles = triton.cdiv(cols, _BLOCK_C)  # of the quantizing kernel
    if packed:
        places = q.size(1)
        ends_E, padded_ends_E, expert_R, block_expert = layout or _packed_layout(counts_E, rows, places)
        rows_per_matrix = 1
        quantize_grid = (triton.cdiv(places, _BLOCK_P), 1, column_tiles)
    else:
        ends_E = padded_ends_E = expert_R = block_expert = amax_EC  # unread
        places = 0
        rows_per_matrix = rows_per_matrix or rows // num_experts
        quantize_grid = (num_experts, triton.cdiv(rows_per_matrix, _BLOCK_P), column_tiles)
    with torch.cuda.device(x_RC.device) if x_RC.is_cuda else contextlib.nullcontext():  # CPU: the interpreter
        _column_amax_kernel[(triton.cdiv(rows, _AMAX_ROWS), triton.cdiv(cols, _AMAX_COLS))](
            x_RC, expert_R, amax_EC, rows, cols, rows_per_matrix, PACKED=packed, BLOCK_R=_AMAX_ROWS,
            BLOCK_C=_AMAX_COLS, num_warps=_AMAX_WARPS)
        # once per (expert, column), not per element: the kernel below divides each value only once
        scale_EC = amax_EC
        _fp8_scales_kernel[(triton.cdiv(scale_EC.numel(), 1024),)](scale_EC, scale_EC.numel(), BLOCK=1024)
        _quantize_transposed_kernel[quantize_grid](
            x_RC, block_expert, ends_E, padded_ends_E, scale_EC, q, rows, cols, places, num_experts,
            rows_per_matrix, stride_qe, stride_qc, PACKED=packed, ALIGN_ROWS=ALIGN, BLOCK_P=_BLOCK_P,
            BLOCK_C=_BLOCK_C, num_warps=_TRANSPOSED_WARPS)
    return scale_EC


def _quantize_columns_triton(x_RC: torch.Tensor, counts_E: torch.Tensor, padded_rows: int,
                             layout: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_columns by the Triton kernels (CUDA, or the interpreter on CPU tensors in the tests);
    layout: _packed_layout(counts_E, R, padded_rows), made here when None."""
    cols, num_experts = x_RC.size(1), counts_E.numel()
    q_CP = torch.empty(cols, padded_rows, dtype=torch.uint8, device=x_RC.device)
    if num_experts and cols and x_RC.size(0):
        scale_EC = _quantize_transposed(x_RC, num_experts, counts_E, q_CP, 0, padded_rows,
                                        layout=layout)  # padding: zeros
    else:
        q_CP.zero_()
        scale_EC = torch.ones(num_experts, cols, dtype=torch.float32, device=x_RC.device)  # experts without rows
    return q_CP.view(torch.float8_e4m3fn), scale_EC


def _quantize_column_list_triton(xs: list[torch.Tensor], counts_E: torch.Tensor, padded_rows: int) -> list[torch.Tensor]:
    """quantize_columns of each x (all of the same rows, so one layout serves them all): [values,
    scales] of each, in order."""
    layout = _packed_layout(counts_E, xs[0].size(0), padded_rows) if counts_E.numel() else None
    return [out for x_RC in xs for out in _quantize_columns_triton(x_RC, counts_E, padded_rows, layout)]


@torch.library.custom_op("moetrain::fp8_quantize_columns", mutates_args=(), device_types="cuda")
def _quantize_columns_cuda(xs: list[torch.Tensor], counts_E: torch.Tensor, padded_rows: int) -> list[torch.Tensor]:
    return _quantize_column_list_triton(xs, counts_E, padded_rows)


@_quantize_columns_cuda.register_fake
def _(xs, counts_E, padded_rows):
    return [out for x_RC in xs for out in (x_RC.new_empty(x_RC.size(1), padded_rows, dtype=torch.float8_e4m3fn),
                                           x_RC.new_empty(counts_E.numel(), x_RC.size(1), dtype=torch.float32))]


def _quantize_weight_columns_triton(w_EKN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_weight(over=1) by the Triton kernels: values [E, N, K], scales [E, N]."""
    num_experts, k, n = w_EKN.shape
    q_ENK = torch.empty(num_experts, n, k, dtype=torch.uint8, device=w_EKN.device)
    if not w_EKN.numel():
        return q_ENK.view(torch.float8_e4m3fn), torch.ones(num_experts, n, dtype=torch.float32, device=w_EKN.device)
    scale_EN = _quantize_transposed(w_EKN.view(num_experts * k, n), num_experts, None, q_ENK, n * k, k)
    return q_ENK.view(torch.float8_e4m3fn), scale_EN


@torch.library.custom_op("moetrain::fp8_quantize_weight", mutates_args=(), device_types="cuda")
def _quantize_weight_cuda(w_EKN: torch.Tensor, over: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_experts, k, n = w_EKN.shape
    if over == 2:  # per row over N: each row of the stacked [E * K, N] is one scaling group
        q, scale = kernels.quantize_fp8(w_EKN.view(num_experts * k, n), n)
        return q.view(num_experts, k, n), scale.view(num_experts, k)
    return _quantize_weight_columns_triton(w_EKN)


@_quantize_weight_cuda.register_fake
def _(w_EKN, over):
    e, k, n = w_EKN.shape
    if over == 2:
        return w_EKN.new_empty(e, k, n, dtype=torch.float8_e4m3fn), w_EKN.new_empty(e, k, dtype=torch.float32)
    return w_EKN.new_empty(e, n, k, dtype=torch.float8_e4m3fn), w_EKN.new_empty(e, n, dtype=torch.float32)


# ---------------------------------------------------------------- quantization, fp8_block


def quantize_row_tiles(x_RK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values [R, K] and fp32 scales [R, Kb]: one scale per row and 128 consecutive columns
    (1x128 tiles: x for the forward, dy for dgrad)."""
    if x_RK.is_cuda:
        return kernels.quantize_fp8(x_RK.contiguous(), FP8_BLOCK)
    return quantize_fp8_groups(x_RK, FP8_BLOCK)


def quantize_column_tiles(x_RC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x transposed and quantized per 128x1 tile: values [C, R] (each column's rows contiguous, the
    layout the weight-gradient GEMM reads) and fp32 scales [Rb, C], one per column and global block
    of 128 rows (rows 128i..128i+127, whichever experts own them; the last block may be shorter)."""
    if x_RC.is_cuda:
        return _quantize_column_tiles_cuda(x_RC.contiguous())
    q_CR, scale_CRb = quantize_fp8_groups(x_RC.t(), FP8_BLOCK)
    return q_CR, scale_CRb.t().contiguous()


_BLOCK_CHUNK = 2**28  # elements of w the CPU path quantizes at once: its fp32 working copies stay near 1 GiB each


def quantize_weight_blocks(w_EKN: torch.Tensor, k_contiguous: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 copy of w with one fp32 scale per 128x128 block of each w[e]: scales [E, Kb, Nb]; values
    stored [E, N, K] (k_contiguous: the forward reads w[e] with K, its reduction dim, contiguous) or
    [E, K, N] (dgrad reads w[e].T, reducing over N). A block's scale and values are the same in
    either storage; only the layout differs. On CUDA one Triton pass (a program per block); on the
    CPU torch ops, a group of experts at a time: at once, a layer of DeepSeek-V3's size
    (256 x 7168 x 4096) would need 30 GB of fp32 working copies."""
    if w_EKN.is_cuda and triton is not None:
        return _quantize_weight_blocks_cuda(w_EKN.contiguous(), k_contiguous)
    per_group = max(1, _BLOCK_CHUNK // max(1, w_EKN[0].numel())) if w_EKN.size(0) else 1
    if w_EKN.size(0) > per_group:
        parts = [quantize_weight_blocks(w, k_contiguous) for w in w_EKN.split(per_group)]
        return torch.cat([q for q, _ in parts]), torch.cat([scale for _, scale in parts])
    if k_contiguous:
        q_ENK, scale_ENbKb = quantize_fp8_blocks(w_EKN.transpose(1, 2))
        return q_ENK, scale_ENbKb.transpose(1, 2).contiguous()
    return quantize_fp8_blocks(w_EKN)


if triton is not None:

    @triton.jit
    def _quantize_weight_blocks_kernel(w_ptr, q_ptr, scale_ptr, K, N, K_BLOCKS, N_BLOCKS,
                                       TRANSPOSED: tl.constexpr, BLOCK: tl.constexpr):
        """One 128x128 block (k, n) of w[e] (contiguous [E, K, N]): its scale (formats.fp8_scale of
        its largest finite magnitude; NaN if any value is not finite) into scale[e, kb, nb], its
        values divided by it and rounded to E4M3 (formats.e4m3_encode) into q[e] as [K, N], or
        TRANSPOSED as [N, K]. Values outside w (ragged edges) count as zeros and are not written."""
        nb, kb, e = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        ks = kb * BLOCK + tl.arange(0, BLOCK)
        ns = nb * BLOCK + tl.arange(0, BLOCK)
        mask = (ks < K)[:, None] & (ns < N)[None, :]
        matrix = e * K * N
        x = tl.load(w_ptr + matrix + ks.to(tl.int64)[:, None] * N + ns[None, :], mask=mask, other=0.0).to(tl.float32)
        finite = tl.abs(x) < float("inf")  # False for +-Inf and NaN
        amax = tl.max(tl.max(tl.where(finite, tl.abs(x), 0.0), axis=1), axis=0)
        all_finite = tl.min(tl.min(finite.to(tl.int32), axis=1), axis=0) == 1
        scale = _fp8_scale(amax, all_finite)
        tl.store(scale_ptr + (e * K_BLOCKS + kb) * N_BLOCKS + nb, scale)
        codes = _e4m3_codes(x, tl.broadcast_to(scale, x.shape)).to(tl.uint8, bitcast=True)
        if TRANSPOSED:
            tl.store(q_ptr + matrix + ns.to(tl.int64)[None, :] * K + ks[:, None], codes, mask=mask)
        else:
            tl.store(q_ptr + matrix + ks.to(tl.int64)[:, None] * N + ns[None, :], codes, mask=mask)


def _quantize_weight_blocks_triton(w_EKN: torch.Tensor, k_contiguous: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_weight_blocks by the Triton kernel above (CUDA, or the interpreter on CPU tensors in
    the tests); w contiguous."""
    num_experts, k, n = w_EKN.shape
    k_blocks, n_blocks = -(-k // FP8_BLOCK), -(-n // FP8_BLOCK)
    q = torch.empty((num_experts, n, k) if k_contiguous else (num_experts, k, n), dtype=torch.uint8,
                    device=w_EKN.device)
    scale_EKbNb = torch.empty(num_experts, k_blocks, n_blocks, dtype=torch.float32, device=w_EKN.device)
    if w_EKN.numel():
        with torch.cuda.device(w_EKN.device) if w_EKN.is_cuda else contextlib.nullcontext():
            _quantize_weight_blocks_kernel[(n_blocks, k_blocks, num_experts)](
                w_EKN, q, scale_EKbNb, k, n, k_blocks, n_blocks, TRANSPOSED=k_contiguous, BLOCK=FP8_BLOCK,
                num_warps=8)
    return q.view(torch.float8_e4m3fn), scale_EKbNb


@torch.library.custom_op("moetrain::fp8_quantize_weight_blocks", mutates_args=(), device_types="cuda")
def _quantize_weight_blocks_cuda(w_EKN: torch.Tensor, k_contiguous: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_weight_blocks_triton(w_EKN, k_contiguous)


@_quantize_weight_blocks_cuda.register_fake
def _(w_EKN, k_contiguous):
    e, k, n = w_EKN.shape
    shape = (e, n, k) if k_contiguous else (e, k, n)
    return (w_EKN.new_empty(shape, dtype=torch.float8_e4m3fn),
            w_EKN.new_empty(e, -(-k // FP8_BLOCK), -(-n // FP8_BLOCK), dtype=torch.float32))


def _quantize_column_tiles_triton(x_RC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_column_tiles by the Triton kernels."""
    rows, cols = x_RC.shape
    blocks = -(-rows // FP8_BLOCK)
    # empty: every value is written (each block has at least one row)
    q_CR = torch.empty(cols, rows, dtype=torch.uint8, device=x_RC.device)
    if not (rows and cols):
        return q_CR.view(torch.float8_e4m3fn), torch.empty(blocks, cols, dtype=torch.float32, device=x_RC.device)
    # the 128-row blocks as stacked matrices: row r of block i lands at q[c, 128 i + (r - 128 i)]
    scale_RbC = _quantize_transposed(x_RC, blocks, None, q_CR, FP8_BLOCK, rows, rows_per_matrix=FP8_BLOCK)
    return q_CR.view(torch.float8_e4m3fn), scale_RbC


@torch.library.custom_op("moetrain::fp8_quantize_column_tiles", mutates_args=(), device_types="cuda")
def _quantize_column_tiles_cuda(x_RC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_column_tiles_triton(x_RC)


@_quantize_column_tiles_cuda.register_fake
def _(x_RC):
    rows, cols = x_RC.shape
    return (x_RC.new_empty(cols, rows, dtype=torch.float8_e4m3fn),
            x_RC.new_empty(-(-rows // FP8_BLOCK), cols, dtype=torch.float32))


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
    wq_EKN, w_scale_EK = quantize_weight(w_EKN, over=2)
    return rows_matmul(dyq_RN, dy_scale, wq_EKN, w_scale_EK, counts_E)


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


class _FP8ExpertMatmul(torch.autograd.Function):
    """The three GEMMs of the module docstring, in either recipe. Only x, w and the counts are kept
    for backward: each GEMM quantizes its operands in the layout and scaling it needs."""

    @staticmethod
    def forward(ctx, x_RK, w_EKN, counts_E, precision, wgrad):
        xq_RK, x_scale = _quantize_rows_of(precision, x_RK)
        ctx.save_for_backward(x_RK, w_EKN, counts_E)
        ctx.precision, ctx.wgrad = precision, wgrad
        return _forward_gemm(precision, xq_RK, x_scale, w_EKN, counts_E).to(x_RK.dtype)

    @staticmethod
    def backward(ctx, dy_RN):
        x_RK, w_EKN, counts_E = ctx.saved_tensors
        dy_RN = dy_RN.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _grad_input(ctx.precision, dy_RN, w_EKN, counts_E).to(x_RK.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _grad_weight(ctx.precision, x_RK, dy_RN, counts_E, ctx.wgrad).to(w_EKN.dtype)
        return grad_x, grad_w, None, None, None


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


@torch.library.custom_op("moetrain::fp8_gather_rows", mutates_args=())
def _gather_rows_op(table_TC: torch.Tensor, source_R: torch.Tensor, pad: float) -> torch.Tensor:
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


class _FP8TokenMatmul(torch.autograd.Function):
    """_FP8ExpertMatmul on rows that are copies of tokens (TokenRows): each token is quantized
    once, before dispatch, and its FP8 values and scales are gathered into the expert layout (half
    a bf16 dispatch's bytes; a token's copies quantize alike, so the GEMM's operands are the same bit
    for bit). Backward sums the copies' input gradients into their tokens (dispatch's backward), and
    dispatches the tokens again for the weight gradient instead of keeping the bf16 rows."""

    @staticmethod
    def forward(ctx, x_TK, w_EKN, counts_E, dest_TK, num_rows, precision, wgrad, impl):
        xq_RK, x_scale_R = _quantized_copies(precision, x_TK, _source_rows(dest_TK, num_rows))
        ctx.save_for_backward(x_TK, w_EKN, counts_E, dest_TK)
        ctx.num_rows, ctx.precision, ctx.wgrad, ctx.impl = num_rows, precision, wgrad, impl
        return _forward_gemm(precision, xq_RK, x_scale_R, w_EKN, counts_E).to(x_TK.dtype)

    @staticmethod
    def backward(ctx, dy_RN):
        x_TK, w_EKN, counts_E, dest_TK = ctx.saved_tensors
        dy_RN = dy_RN.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = ops.sum_copies(_grad_input(ctx.precision, dy_RN, w_EKN, counts_E).to(x_TK.dtype), dest_TK,
                                    ctx.impl)
        if ctx.needs_input_grad[1]:
            x_RK = ops.dispatch(x_TK, dest_TK, ctx.num_rows, impl=ctx.impl)
            grad_w = _grad_weight(ctx.precision, x_RK, dy_RN, counts_E, ctx.wgrad).to(w_EKN.dtype)
        return grad_x, grad_w, None, None, None, None, None, None


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
        return _FP8ExpertMatmul.apply(x_RK, w_EKN, counts_E, precision, wgrad)


def fp8_token_matmul(x_TK: torch.Tensor, dest_TK: torch.Tensor, num_rows: int, w_EKN: torch.Tensor,
                     counts_E: torch.Tensor | list[int], capacity: int | None, precision: str = "fp8",
                     impl: str = "kernel", wgrad: str = "bf16") -> torch.Tensor:
    """fp8_expert_matmul of the expert-major rows that dispatch (moetrain.ops.dispatch(x_TK,
    dest_TK, num_rows, impl)) would make, without making them: each token is quantized once and
    its FP8 rows gathered (_FP8TokenMatmul). The same result and gradients bit for bit; the input
    gradient is in token order, [T, K]."""
    counts_E = _fp8_counts(precision, wgrad, x_TK.device, w_EKN.size(0), num_rows, counts_E, capacity)
    x_TK = _autocast_input(x_TK)
    with torch.autocast(x_TK.device.type, enabled=False):
        return _FP8TokenMatmul.apply(x_TK.contiguous(), w_EKN, counts_E, dest_TK.contiguous(), num_rows, precision,
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
    """_FP8TokenMatmul across ranks (expert parallelism): each token is quantized once, on its own
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
    with torch.autocast(x_TK.device.type, enabled=False):
        return _FP8ExchangedMatmul.apply(x_TK.contiguous(), w_EKN, counts_E, dest_TK.contiguous(), num_rows,
                                         precision, wgrad, impl, exchange)
