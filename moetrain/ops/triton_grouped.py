"""Triton grouped GEMMs for the packed (dropless) expert layout, in bf16/fp16/fp32 and in FP8.

Rows of expert e are the contiguous range [ends[e-1], ends[e]) of the row dimension (ends_E int32
on the device, cumulative, ends[-1] == R; an expert may own no rows). Nothing waits for the host.

  grouped_mm        c[r] = a[r] @ b[e(r)]                         forward and dgrad: c_RN = a_RK b_EKN
  grouped_mm_wgrad  dw[e] = sum over e's rows r of a[r]^T b[r]    wgrad: dw_EKN = a_RK^T b_RN per expert

Operands may be any strided views (dgrad passes w.transpose(1, 2), wgrad x_KR.t()). Accumulation is
fp32. FP8 operands are float8_e4m3fn with fp32 scales, applied in fp32:

  GEMM              block=0 (row-wise, in the epilogue)        block=128 (DeepSeek-V3, per K slab)
  grouped_mm        a_scale [R], b_scale [E, N]                a_scale [R, K/128] (1x128 tiles),
                                                               b_scale [E, K/128, N/128] (128x128)
  grouped_mm_wgrad  a_scale [E, K], b_scale [E, N]             a_scale [R/128, K], b_scale [R/128, N]
                    (per expert and column)                    (per column and global 128-row block)

(X/128 rounds up.) Hopper's FP8 tensor cores read both operands with the reduction dimension
contiguous: for speed, grouped_mm wants b_EKN.stride(1) == 1 (weights stored [E, N, K]) and
grouped_mm_wgrad wants a.stride(0) == b.stride(0) == 1 (operands stored transposed, [K, R] and
[N, R]); other strides are correct but slower. 16-bit MMAs read either layout.
fp32 operands use TF32 when torch.backends.cuda.matmul.allow_tf32 is set, IEEE fp32 otherwise.
On sm90 the row-wise FP8 products accumulate over all of K in the tensor cores (Triton's default
for FP8 there, like a fast-accumulation cuBLAS GEMM); the block-scaled ones are added to the fp32
accumulator one BLOCK_K slab at a time, as their scales require.

Scheduling: one program per output tile. grouped_mm's programs cover an upper bound of the row
tiles (cdiv(R, BLOCK_M) + E, each expert wasting at most one partial tile) times the column tiles;
each program finds its expert by counting the experts whose cumulative row-tile count it has
passed (a vector load of ends_E), and programs past the last tile return. grouped_mm_wgrad has
one program per (expert, K tile, N tile) looping over that expert's rows in slabs of BLOCK_K rows
aligned to BLOCK_K (a masked first and last slab, unmasked ones between, so the loads vectorize).
Programs are ordered in bands of GROUP row tiles so that those running together share tiles in L2.

Operand loads: pointer loads (cp.async, pipelined by Triton), or for grouped_mm with config TMA=1
(FP8 row-wise's default where Triton has host tensor descriptors) the Tensor Memory Accelerator:
one descriptor over a [R, K] and one over b stored [E * N, K], so it serves only K-contiguous
operands with 16-byte aligned rows (the FP8 layout; _tma_layout), others take the pointer kernel.
A TMA tile cannot stop at an expert's last row: it reads on into the next expert's rows (a) or
weight rows (b), whose products the masked store drops. TMA=2 is the same kernel persistent (one
program per SM); measured no faster, it is not a default.

CUDA tensors go through the custom ops moetrain::grouped_mm and moetrain::grouped_mm_wgrad (one
graph under torch.compile(fullgraph=True)); CPU tensors launch the kernels directly, which runs
only under Triton's interpreter (the tests). grouped_mm_reference and grouped_mm_wgrad_reference
are the pure-torch definitions (fp32, dequantized operands, a loop over experts).

benchmarks/grouped_gemm.py times them against torch._grouped_mm and torch._scaled_grouped_mm.

Shape letters: R rows, K reduction (input) features, N output features, E experts.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels need Triton; the references and the benchmark's help do not
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host-side tensor descriptors: grouped_mm's TMA kernel is not offered
    TensorDescriptor = None

from moetrain.ops.launch import on_device_of

FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 128  # block=128: the K (grouped_mm) or row (wgrad) extent of one scale
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "GROUP", "TMA")


if triton is not None:

    @triton.jit
    def _band_tile(pid, m_tiles, N, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
        """(row tile, column tile) of program pid: bands of GROUP row tiles, column by column in a band."""
        band_size = GROUP * tl.cdiv(N, BLOCK_N)
        first = pid // band_size * GROUP
        band_rows = min(m_tiles - first, GROUP)
        return first + (pid % band_size) % band_rows, (pid % band_size) // band_rows

    @triton.jit
    def _expert_tiles(ends_ptr, E, E_P2: tl.constexpr, BLOCK_M: tl.constexpr):
        """Per expert (E_P2 lanes): its index, first row, end row, row tiles (0 past the last expert)
        and cumulative row tiles."""
        experts = tl.arange(0, E_P2)
        ends = tl.load(ends_ptr + experts, mask=experts < E, other=0)
        starts = tl.load(ends_ptr + experts - 1, mask=(experts > 0) & (experts < E), other=0)
        tiles = tl.cdiv(ends - starts, BLOCK_M)
        return experts, starts, ends, tiles, tl.cumsum(tiles, 0)

    @triton.jit
    def _tile_rows(tile_m, e, experts, starts, ends, tiles, tile_ends, BLOCK_M: tl.constexpr):
        """(first row, end row of its expert) of row tile tile_m, a tile of expert e (_expert_tiles' table)."""
        mine = experts == e
        first_tile = tl.sum(tl.where(mine, tile_ends - tiles, 0))
        return tl.sum(tl.where(mine, starts, 0)) + (tile_m - first_tile) * BLOCK_M, tl.sum(tl.where(mine, ends, 0))

    @triton.jit
    def _store_rows(acc, rows, cols, row_ok, col_ok, e, c_ptr, sa_ptr, sb_ptr, stride_cm, stride_cn, stride_sam,
                    stride_sbe, stride_sbn, SCALING: tl.constexpr):
        """grouped_mm's epilogue: acc times the row and column scales (SCALING 1), stored where in range."""
        rows64 = rows.to(tl.int64)
        if SCALING == 1:
            sa = tl.load(sa_ptr + rows64 * stride_sam, mask=row_ok, other=0.0)
            sb = tl.load(sb_ptr + e.to(tl.int64) * stride_sbe + cols * stride_sbn, mask=col_ok, other=0.0)
            acc = acc * sa[:, None] * sb[None, :]
        c_ptrs = c_ptr + rows64[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _grouped_mm_kernel(
        a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, ends_ptr, N, K, M_TILES, E,
        stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
        stride_sam, stride_sak, stride_sbe, stride_sbk, stride_sbn,
        SCALING: tl.constexpr, PRECISION: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
    ):
        """c[r] = a[r] @ b[e(r)] for one BLOCK_M x BLOCK_N tile. SCALING: 0 none, 1 per row of a and
        column of b (epilogue), 2 per 128-wide K slab (1x128 of a, 128x128 of b, in the K loop)."""
        tile_m, tile_n = _band_tile(tl.program_id(0), M_TILES, N, BLOCK_N, GROUP)
        # Expert of row tile tile_m: the number of experts whose cumulative tile count is <= tile_m.
        experts, starts, ends, tiles, tile_ends = _expert_tiles(ends_ptr, E, E_P2, BLOCK_M)
        e = tl.sum((tile_ends <= tile_m).to(tl.int32))
        if e >= E:
            return  # past the last row tile: the grid covers the worst case
        row0, end = _tile_rows(tile_m, e, experts, starts, ends, tiles, tile_ends, BLOCK_M)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < end, cols < N
        rows64, e64 = rows.to(tl.int64), e.to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows64[:, None] * stride_am + ks[None, :] * stride_ak
        b_ptrs = b_ptr + e64 * stride_be + ks[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:  # no mask along K: it would stop the loads of a K-contiguous operand vectorizing
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = k0 + ks < K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if SCALING == 2:
                slab = k0 // 128
                sa = tl.load(sa_ptr + rows64 * stride_sam + slab * stride_sak, mask=row_ok, other=0.0)
                sb = tl.load(sb_ptr + e64 * stride_sbe + slab * stride_sbk + (cols // 128) * stride_sbn,
                             mask=col_ok, other=0.0)
                acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
            else:
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        _store_rows(acc, rows, cols, row_ok, col_ok, e, c_ptr, sa_ptr, sb_ptr, stride_cm, stride_cn, stride_sam,
                    stride_sbe, stride_sbn, SCALING)

    @triton.jit
    def _grouped_mm_tma_kernel(
        a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, ends_ptr, N, K, M_TILES, E,
        stride_cm, stride_cn, stride_sam, stride_sbe, stride_sbn,
        SCALING: tl.constexpr, PRECISION: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, PERSISTENT: tl.constexpr,
    ):
        """_grouped_mm_kernel (SCALING 0 or 1) with both operands read by the Tensor Memory Accelerator:
        a_desc over a [R, K], b_desc over b stored [E * N, K] (each expert's N rows of K). A tile may read
        rows of the next expert (a) or columns past N (b, the next expert's rows); the masked store drops
        what they give, and reads past either tensor's end come back as zeros. PERSISTENT: one program
        per SM walks the row tiles there are, in the same banded order, instead of a program a tile."""
        experts, starts, ends, tiles, tile_ends = _expert_tiles(ends_ptr, E, E_P2, BLOCK_M)
        if PERSISTENT:
            m_tiles = tl.sum(tiles)
            for pid in range(tl.program_id(0), m_tiles * tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
                _tma_tile(pid, m_tiles, experts, starts, ends, tiles, tile_ends, a_desc, b_desc, c_ptr, sa_ptr, sb_ptr,
                          N, K, E, stride_cm, stride_cn, stride_sam, stride_sbe, stride_sbn,
                          SCALING, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP)
        else:
            _tma_tile(tl.program_id(0), M_TILES, experts, starts, ends, tiles, tile_ends, a_desc, b_desc, c_ptr, sa_ptr,
                      sb_ptr, N, K, E, stride_cm, stride_cn, stride_sam, stride_sbe, stride_sbn,
                      SCALING, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP)

    @triton.jit
    def _tma_tile(pid, m_tiles, experts, starts, ends, tiles, tile_ends, a_desc, b_desc, c_ptr, sa_ptr, sb_ptr,
                  N, K, E, stride_cm, stride_cn, stride_sam, stride_sbe, stride_sbn,
                  SCALING: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
        """Output tile pid of _grouped_mm_tma_kernel (the tiles banded as _grouped_mm_kernel's)."""
        tile_m, tile_n = _band_tile(pid, m_tiles, N, BLOCK_N, GROUP)
        e = tl.sum((tile_ends <= tile_m).to(tl.int32))
        if e < E:  # else past the last row tile: the grid covers the worst case
            row0, end = _tile_rows(tile_m, e, experts, starts, ends, tiles, tile_ends, BLOCK_M)
            col0 = tile_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = a_desc.load([row0, k0])
                b = b_desc.load([e * N + col0, k0])
                acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
            rows = row0 + tl.arange(0, BLOCK_M)
            cols = col0 + tl.arange(0, BLOCK_N)
            _store_rows(acc, rows, cols, rows < end, cols < N, e, c_ptr, sa_ptr, sb_ptr, stride_cm, stride_cn,
                        stride_sam, stride_sbe, stride_sbn, SCALING)

    @triton.jit
    def _wgrad_slab(acc, r0, row_ok, R, a_ptr, b_ptr, a_offsets, b_offsets, sa_ptrs, sb_ptrs, kk_ok, col_ok,
                    stride_ar, stride_br, stride_sa0, stride_sb0, BLOCK_K: tl.constexpr,
                    MASK_ROWS: tl.constexpr, SCALING: tl.constexpr, PRECISION: tl.constexpr):
        """acc + the slab of rows [r0, r0 + BLOCK_K): a^T tile [BLOCK_M, BLOCK_K] @ b tile [BLOCK_K, BLOCK_N];
        MASK_ROWS: only its rows where row_ok. SCALING 2: times the slab's 128-row block scales."""
        a_ptrs = a_ptr + r0 * stride_ar + a_offsets
        b_ptrs = b_ptr + r0 * stride_br + b_offsets
        if MASK_ROWS:
            # Loaded up to R only (a mask that vectorizes when 16 divides R), then the rows of other
            # experts replaced by zeros: a per-row mask in the load would load byte by byte.
            in_range = r0 + tl.arange(0, BLOCK_K) < R
            a = tl.load(a_ptrs, mask=kk_ok[:, None] & in_range[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=in_range[:, None] & col_ok[None, :], other=0.0)
            a = tl.where(row_ok[None, :], a, 0.0)
            b = tl.where(row_ok[:, None], b, 0.0)
        else:  # no mask along the rows: the loads of a row-contiguous operand vectorize
            a = tl.load(a_ptrs, mask=kk_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        if SCALING == 2:
            block = r0 // 128
            sa = tl.load(sa_ptrs + block * stride_sa0, mask=kk_ok, other=0.0)
            sb = tl.load(sb_ptrs + block * stride_sb0, mask=col_ok, other=0.0)
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _grouped_mm_wgrad_kernel(
        a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, ends_ptr, R, N, K,
        stride_ar, stride_ak, stride_br, stride_bn, stride_ce, stride_ck, stride_cn,
        stride_sa0, stride_sak, stride_sb0, stride_sbn,
        SCALING: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    ):
        """dw[e] tile (K tile, N tile) = sum over e's rows of a[r]^T b[r]. BLOCK_M tiles K, BLOCK_N
        tiles N, BLOCK_K is the slab of rows. Scale index 0 of sa/sb: the expert (SCALING 1) or the
        global 128-row block (SCALING 2)."""
        pid = tl.program_id(0)
        k_tiles, n_tiles = tl.cdiv(K, BLOCK_M), tl.cdiv(N, BLOCK_N)
        e = pid // (k_tiles * n_tiles)
        t = pid % (k_tiles * n_tiles)
        band_size = GROUP * n_tiles
        first = t // band_size * GROUP
        band_rows = min(k_tiles - first, GROUP)
        tile_k = first + (t % band_size) % band_rows
        tile_n = (t % band_size) // band_rows
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(ends_ptr + e)
        kk = tile_k * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kk_ok, col_ok = kk < K, cols < N
        slab = tl.arange(0, BLOCK_K)
        a_offsets = kk.to(tl.int64)[:, None] * stride_ak + slab[None, :] * stride_ar  # + r0 * stride_ar
        b_offsets = slab[:, None] * stride_br + cols.to(tl.int64)[None, :] * stride_bn  # + r0 * stride_br
        sa_ptrs = sa_ptr + kk * stride_sak  # + block * stride_sa0
        sb_ptrs = sb_ptr + cols * stride_sbn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # Slabs [r0, r0 + BLOCK_K) with r0 a multiple of BLOCK_K: the first and last (partial) ones
        # masked by row, the full ones between unmasked. BLOCK_K divides 128, so a slab lies in one
        # 128-row scale block.
        aligned_start = start // BLOCK_K * BLOCK_K
        last = end // BLOCK_K * BLOCK_K  # the partial last slab's first row, where end % BLOCK_K
        full_from = aligned_start + tl.where(start % BLOCK_K == 0, 0, BLOCK_K)
        if start % BLOCK_K != 0:
            r0 = tl.multiple_of(aligned_start, BLOCK_K).to(tl.int64)
            acc = _wgrad_slab(acc, r0, (r0 + slab >= start) & (r0 + slab < end), R, a_ptr, b_ptr, a_offsets, b_offsets,
                              sa_ptrs, sb_ptrs, kk_ok, col_ok, stride_ar, stride_br, stride_sa0, stride_sb0,
                              BLOCK_K, True, SCALING, PRECISION)
        for i in range(0, (last - full_from) // BLOCK_K):
            r0 = tl.multiple_of(full_from + i * BLOCK_K, BLOCK_K).to(tl.int64)
            acc = _wgrad_slab(acc, r0, slab >= 0, R, a_ptr, b_ptr, a_offsets, b_offsets,
                              sa_ptrs, sb_ptrs, kk_ok, col_ok, stride_ar, stride_br, stride_sa0, stride_sb0,
                              BLOCK_K, False, SCALING, PRECISION)
        if (end % BLOCK_K != 0) & (last >= full_from):
            r0 = tl.multiple_of(last, BLOCK_K).to(tl.int64)
            acc = _wgrad_slab(acc, r0, r0 + slab < end, R, a_ptr, b_ptr, a_offsets, b_offsets,
                              sa_ptrs, sb_ptrs, kk_ok, col_ok, stride_ar, stride_br, stride_sa0, stride_sb0,
                              BLOCK_K, True, SCALING, PRECISION)
        if SCALING == 1:
            sa = tl.load(sa_ptrs + e * stride_sa0, mask=kk_ok, other=0.0)
            sb = tl.load(sb_ptrs + e * stride_sb0, mask=col_ok, other=0.0)
            acc = acc * sa[:, None] * sb[None, :]
        c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + kk.to(tl.int64)[:, None] * stride_ck + cols[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=kk_ok[:, None] & col_ok[None, :])


# ---------------------------------------------------------------- configs and launches


def default_config(dtype: torch.dtype, n: int, rows_per_expert: float, block: int = 0) -> dict:
    """Tiles for one GEMM: output tile BLOCK_M x BLOCK_N (grouped_mm: rows x N; wgrad: K x N),
    reduction slab BLOCK_K. Wide column tiles where N allows (fewer re-reads of a), thin row tiles
    when experts own few rows; FP8 reduces over 128 at a time (its scale blocks, and 128 bytes a row).
    Block-scaled FP8 holds a second [BLOCK_M, BLOCK_N] fp32 tile (each slab's product before it is
    scaled): 128 x 256 would spill registers there (ptxas, sm_90a), so its column tiles stay at 128."""
    if dtype == torch.float32:  # correctness more than speed: CUDA-core FMAs unless TF32 is allowed
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3, GROUP=8, TMA=0)
    block_m = 64 if rows_per_expert < 96 else 128
    block_n = 256 if n >= 1024 and block_m == 128 and not block else 128
    stages = 3 if block_n == 256 else 4  # <= 147 KiB of shared memory for the operand tiles
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128 if dtype == FP8 else 64, num_warps=8, num_stages=stages,
                GROUP=8, TMA=int(dtype == FP8 and not block and TensorDescriptor is not None))


def _config(config: list[int], dtype: torch.dtype, n: int, rows_per_expert: float, block: int) -> dict:
    """default_config with the entries of a _config_list (-1: not given) put over it."""
    chosen = default_config(dtype, n, rows_per_expert, block)
    chosen.update((key, value) for key, value in zip(CONFIG_KEYS, config) if value >= 0)
    if block and SCALE_BLOCK % chosen["BLOCK_K"]:
        raise ValueError(f"block={block} needs BLOCK_K dividing {SCALE_BLOCK}, got {chosen['BLOCK_K']}")
    return chosen


def _config_list(config: dict | None) -> list[int]:
    """A config dict as the custom ops take it: a list in CONFIG_KEYS order, -1 where not given."""
    if not config:
        return []
    unknown = set(config) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {CONFIG_KEYS}")
    return [int(config.get(key, -1)) for key in CONFIG_KEYS]


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: IEEE fp32 for fp32 operands unless torch allows TF32 ("tf32", the
    default, means nothing for other dtypes)."""
    return "ieee" if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"


def _check_operands(a: torch.Tensor, b: torch.Tensor, a_scale, b_scale, block: int) -> int:
    """SCALING code of the kernels (0 none, 1 row-wise, 2 block) after checking dtypes."""
    if a.dtype != b.dtype:
        raise ValueError(f"operands of one dtype expected, got {a.dtype} and {b.dtype}")
    if block not in (0, SCALE_BLOCK):
        raise ValueError(f"block must be 0 (row-wise) or {SCALE_BLOCK}, got {block}")
    if a.dtype == FP8:
        if a_scale is None or b_scale is None:
            raise ValueError("float8_e4m3fn operands need a_scale and b_scale")
        if a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32:
            raise ValueError("scales must be float32")
        return 2 if block else 1
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype {a.dtype} not supported (bf16, fp16, fp32 or float8_e4m3fn)")
    if a_scale is not None or b_scale is not None or block:
        raise ValueError("scales and block go with float8_e4m3fn operands only")
    return 0


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def _check_ends(ends_E: torch.Tensor) -> torch.Tensor:
    if ends_E.dtype != torch.int32:
        raise ValueError(f"ends_E must be int32, got {ends_E.dtype}")
    return ends_E.contiguous()


def _strides(t: torch.Tensor | None, dims: int) -> tuple[int, ...]:
    return (0,) * dims if t is None else tuple(t.stride())


def _grouped_mm_impl(a_RK: torch.Tensor, b_EKN: torch.Tensor, ends_E: torch.Tensor, a_scale: torch.Tensor | None,
                     b_scale: torch.Tensor | None, block: int, out_dtype: torch.dtype,
                     config: list[int]) -> torch.Tensor:
    rows, k = a_RK.shape
    num_experts, _, n = b_EKN.shape
    _expect("b_EKN", b_EKN, (num_experts, k, n))
    _expect("ends_E", ends_E, (num_experts,))
    ends_E = _check_ends(ends_E)
    scaling = _check_operands(a_RK, b_EKN, a_scale, b_scale, block)
    kb, nb = -(-k // SCALE_BLOCK), -(-n // SCALE_BLOCK)
    if scaling == 1:
        _expect("a_scale", a_scale, (rows,))
        _expect("b_scale", b_scale, (num_experts, n))
        sa_strides, sb_strides = (a_scale.stride(0), 0), (b_scale.stride(0), 0, b_scale.stride(1))
    else:
        if scaling == 2:
            _expect("a_scale", a_scale, (rows, kb))
            _expect("b_scale", b_scale, (num_experts, kb, nb))
        sa_strides, sb_strides = _strides(a_scale, 2), _strides(b_scale, 3)
    c_RN = torch.empty(rows, n, dtype=out_dtype, device=a_RK.device)
    cfg = _config(config, a_RK.dtype, n, rows / max(num_experts, 1), block)
    if rows == 0 or n == 0 or num_experts == 0:
        return c_RN
    m_tiles = triton.cdiv(rows, cfg["BLOCK_M"]) + num_experts  # each expert wastes at most one partial tile
    grid = (m_tiles * triton.cdiv(n, cfg["BLOCK_N"]),)
    if cfg["TMA"] and scaling != 2 and _tma_layout(a_RK, b_EKN):
        b_rows = b_EKN.transpose(1, 2)  # [E, N, K], K contiguous: one [E * N, K] matrix
        a_desc = TensorDescriptor(a_RK, list(a_RK.shape), [a_RK.stride(0), 1], [cfg["BLOCK_M"], cfg["BLOCK_K"]])
        b_desc = TensorDescriptor(b_rows, [num_experts * n, k], [b_rows.stride(1), 1], [cfg["BLOCK_N"], cfg["BLOCK_K"]])
        if cfg["TMA"] == 2:
            grid = (min(grid[0], _multiprocessors(a_RK.device)),)
        with on_device_of(a_RK):
            _grouped_mm_tma_kernel[grid](
                a_desc, b_desc, c_RN, a_scale if scaling else c_RN, b_scale if scaling else c_RN, ends_E,
                n, k, m_tiles, num_experts, *c_RN.stride(), sa_strides[0], sb_strides[0], sb_strides[2],
                SCALING=scaling, PRECISION=_precision(a_RK.dtype), E_P2=triton.next_power_of_2(num_experts),
                BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP=cfg["GROUP"],
                PERSISTENT=cfg["TMA"] == 2, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            )
        return c_RN
    with on_device_of(a_RK):
        _grouped_mm_kernel[grid](
            a_RK, b_EKN, c_RN, a_scale if scaling else c_RN, b_scale if scaling else c_RN, ends_E,
            n, k, m_tiles, num_experts, *a_RK.stride(), *b_EKN.stride(), *c_RN.stride(), *sa_strides, *sb_strides,
            SCALING=scaling, PRECISION=_precision(a_RK.dtype), E_P2=triton.next_power_of_2(num_experts),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP=cfg["GROUP"],
            EVEN_K=k % cfg["BLOCK_K"] == 0, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return c_RN


def _grouped_mm_wgrad_impl(a_RK: torch.Tensor, b_RN: torch.Tensor, ends_E: torch.Tensor, a_scale: torch.Tensor | None,
                           b_scale: torch.Tensor | None, block: int, out_dtype: torch.dtype,
                           config: list[int]) -> torch.Tensor:
    rows, k = a_RK.shape
    n, num_experts = b_RN.size(1), ends_E.numel()
    _expect("b_RN", b_RN, (rows, n))
    ends_E = _check_ends(ends_E)
    scaling = _check_operands(a_RK, b_RN, a_scale, b_scale, block)
    first_dim = -(-rows // SCALE_BLOCK) if scaling == 2 else num_experts
    if scaling:
        _expect("a_scale", a_scale, (first_dim, k))
        _expect("b_scale", b_scale, (first_dim, n))
    dw_EKN = torch.empty(num_experts, k, n, dtype=out_dtype, device=a_RK.device)
    cfg = _config(config, a_RK.dtype, n, rows / max(num_experts, 1), block)
    grid = (num_experts * triton.cdiv(k, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    if grid[0] == 0:
        return dw_EKN
    with on_device_of(a_RK):
        _grouped_mm_wgrad_kernel[grid](
            a_RK, b_RN, dw_EKN, a_scale if scaling else dw_EKN, b_scale if scaling else dw_EKN, ends_E, rows, n, k,
            *a_RK.stride(), *b_RN.stride(), *dw_EKN.stride(), *_strides(a_scale, 2), *_strides(b_scale, 2),
            SCALING=scaling, PRECISION=_precision(a_RK.dtype), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"], GROUP=cfg["GROUP"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return dw_EKN


def _tma_layout(a_RK: torch.Tensor, b_EKN: torch.Tensor) -> bool:
    """Whether the TMA kernel can read these operands: K contiguous in both, b's experts [N, K] matrices
    one after another, every row start 16-byte aligned (a layout it cannot read takes the pointer kernel)."""
    if TensorDescriptor is None:
        return False
    size = a_RK.element_size()
    return (a_RK.stride(1) == 1 and b_EKN.stride(1) == 1 and b_EKN.stride(0) == b_EKN.size(2) * b_EKN.stride(2)
            and all(stride * size % 16 == 0 for stride in (a_RK.stride(0), b_EKN.stride(2)))
            and a_RK.data_ptr() % 16 == 0 and b_EKN.data_ptr() % 16 == 0)


def _multiprocessors(device: torch.device) -> int:
    """The programs of a persistent kernel: one per SM (4 in the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@torch.library.custom_op("moetrain::grouped_mm", mutates_args=(), device_types="cuda")
def _grouped_mm_op(a_RK: torch.Tensor, b_EKN: torch.Tensor, ends_E: torch.Tensor, a_scale: torch.Tensor | None,
                   b_scale: torch.Tensor | None, block: int, out_dtype: torch.dtype, config: list[int]) -> torch.Tensor:
    return _grouped_mm_impl(a_RK, b_EKN, ends_E, a_scale, b_scale, block, out_dtype, config)


@_grouped_mm_op.register_fake
def _(a_RK, b_EKN, ends_E, a_scale, b_scale, block, out_dtype, config):
    return a_RK.new_empty(a_RK.size(0), b_EKN.size(2), dtype=out_dtype)


@torch.library.custom_op("moetrain::grouped_mm_wgrad", mutates_args=(), device_types="cuda")
def _grouped_mm_wgrad_op(a_RK: torch.Tensor, b_RN: torch.Tensor, ends_E: torch.Tensor, a_scale: torch.Tensor | None,
                         b_scale: torch.Tensor | None, block: int, out_dtype: torch.dtype,
                         config: list[int]) -> torch.Tensor:
    return _grouped_mm_wgrad_impl(a_RK, b_RN, ends_E, a_scale, b_scale, block, out_dtype, config)


@_grouped_mm_wgrad_op.register_fake
def _(a_RK, b_RN, ends_E, a_scale, b_scale, block, out_dtype, config):
    return a_RK.new_empty(ends_E.numel(), a_RK.size(1), b_RN.size(1), dtype=out_dtype)


def grouped_mm(a_RK: torch.Tensor, b_EKN: torch.Tensor, ends_E: torch.Tensor, a_scale: torch.Tensor | None = None,
               b_scale: torch.Tensor | None = None, block: int = 0, out_dtype: torch.dtype = torch.bfloat16,
               config: dict | None = None) -> torch.Tensor:
    """c[r] = a[r] @ b[e(r)] -> [R, N] in out_dtype (module docstring: layouts, scales, strides).
    config: tiles instead of default_config (keys CONFIG_KEYS), for sweeps."""
    if triton is None:
        raise RuntimeError("moetrain.ops.triton_grouped needs Triton")
    op = _grouped_mm_op if a_RK.is_cuda else _grouped_mm_impl
    return op(a_RK, b_EKN, ends_E, a_scale, b_scale, block, out_dtype, _config_list(config))


def grouped_mm_wgrad(a_RK: torch.Tensor, b_RN: torch.Tensor, ends_E: torch.Tensor, a_scale: torch.Tensor | None = None,
                     b_scale: torch.Tensor | None = None, block: int = 0, out_dtype: torch.dtype = torch.float32,
                     config: dict | None = None) -> torch.Tensor:
    """dw[e] = a[rows of e]^T @ b[rows of e] -> [E, K, N] in out_dtype, zeros for an expert without
    rows (module docstring). config: tiles instead of default_config; BLOCK_M tiles K, BLOCK_N
    tiles N, BLOCK_K is the slab of rows reduced at a time."""
    if triton is None:
        raise RuntimeError("moetrain.ops.triton_grouped needs Triton")
    op = _grouped_mm_wgrad_op if a_RK.is_cuda else _grouped_mm_wgrad_impl
    return op(a_RK, b_RN, ends_E, a_scale, b_scale, block, out_dtype, _config_list(config))


# ---------------------------------------------------------------- references


def _expand_blocks(scale: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """Block scales repeated SCALE_BLOCK times along each dim i where sizes[i] is given, cut to it."""
    for dim, size in enumerate(sizes):
        if size is not None:
            scale = scale.repeat_interleave(SCALE_BLOCK, dim).narrow(dim, 0, size)
    return scale


def _starts_ends(ends_E: torch.Tensor) -> list[tuple[int, int]]:
    ends = ends_E.tolist()
    return list(zip([0] + ends[:-1], ends))


def grouped_mm_reference(a_RK, b_EKN, ends_E, a_scale=None, b_scale=None, block=0) -> torch.Tensor:
    """grouped_mm in fp32 on dequantized operands, one matmul per expert -> fp32 [R, N]."""
    rows, k = a_RK.shape
    n = b_EKN.size(2)
    a, b = a_RK.float(), b_EKN.float()
    if a_scale is not None and block:
        a = a * _expand_blocks(a_scale, (None, k))
        b = b * _expand_blocks(b_scale, (None, k, n))
    elif a_scale is not None:
        a, b = a * a_scale[:, None], b * b_scale[:, None, :]
    c = torch.zeros(rows, n, dtype=torch.float32, device=a_RK.device)
    for e, (s, t) in enumerate(_starts_ends(ends_E)):
        c[s:t] = a[s:t] @ b[e]
    return c


def grouped_mm_wgrad_reference(a_RK, b_RN, ends_E, a_scale=None, b_scale=None, block=0) -> torch.Tensor:
    """grouped_mm_wgrad in fp32 on dequantized operands, one matmul per expert -> fp32 [E, K, N]."""
    rows, k = a_RK.shape
    n = b_RN.size(1)
    a, b = a_RK.float(), b_RN.float()
    if a_scale is not None and block:
        a = a * _expand_blocks(a_scale, (rows, None))
        b = b * _expand_blocks(b_scale, (rows, None))
    dw = torch.zeros(ends_E.numel(), k, n, dtype=torch.float32, device=a_RK.device)
    for e, (s, t) in enumerate(_starts_ends(ends_E)):
        dw[e] = a[s:t].t() @ b[s:t]
        if a_scale is not None and not block:
            dw[e] *= a_scale[e][:, None] * b_scale[e][None, :]
    return dw
