"""The quantizers of FP8 training (moetrain.precision.fp8_matmul): each GEMM operand to E4M3 values
and fp32 scales, by the recipes that fp8_matmul's docstring tabulates.

  fp8        rows of x or dy (quantize_rows), per-expert columns of x and dy transposed and padded
             to ALIGN rows an expert for the weight gradient (quantize_columns, quantize_column_pair),
             the weight per column or per row (quantize_weight);
  fp8_block  1x128 row tiles (quantize_row_tiles), 128x1 column tiles over global 128-row blocks
             (quantize_column_tiles) and 128x128 weight blocks (quantize_weight_blocks).

On CUDA each is a Triton kernel behind a custom op (one graph under torch.compile); on the CPU the
same arithmetic in torch (moetrain.precision.formats), bit for bit.

Shape letters: R rows (expert-major, packed or padded), K input features, N output features,
C columns, E experts, P rows padded per expert to multiples of ALIGN.
"""

from __future__ import annotations

import torch

from moetrain import ops
from moetrain.ops.grouped import expert_of_rows
from moetrain.ops.launch import on_device_of
from moetrain.precision import kernels
from moetrain.precision.formats import (
    FP8_BLOCK, e4m3_encode, finite_amax, fp8_scale, quantize_fp8_blocks, quantize_fp8_groups,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the CUDA path needs Triton (moetrain.precision.fp8_matmul.fp8_supported says so)
    triton = None

ALIGN = 16  # rows of each expert in the weight-gradient GEMM: a multiple of 16 bytes of E4M3

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
        q_RK, scale_R1 = _quantize_row_groups_cuda(x_RK.contiguous(), x_RK.size(1))
    else:
        q_RK, scale_R1 = quantize_fp8_groups(x_RK, max(1, x_RK.size(1)))
    return q_RK, scale_R1.view(-1)


# The row quantizer as an operator, so that torch.compile sees one opaque call with the shapes below
# rather than tracing a Triton launch that writes into a uint8 buffer it then views as E4M3.
@torch.library.custom_op("moetrain::fp8_quantize_row_groups", mutates_args=(), device_types="cuda")
def _quantize_row_groups_cuda(x_RK: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.quantize_fp8(x_RK, group)


@_quantize_row_groups_cuda.register_fake
def _(x_RK, group):
    rows, k = x_RK.shape
    return (x_RK.new_empty(rows, k, dtype=torch.float8_e4m3fn),
            x_RK.new_empty(rows, -(-k // max(1, min(group, k))), dtype=torch.float32))


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
    with on_device_of(x_RC):
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
        return _quantize_row_groups_cuda(x_RK.contiguous(), FP8_BLOCK)
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
        with on_device_of(w_EKN):
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
