"""Triton kernels for quantized experts on the GPU: FP8 activation quantization, one grouped GEMM
for every weight format, and FP4 -> bf16 weight decoding for large batches.

  quantize_fp8          x [R, K] -> E4M3 [R, K] + fp32 scales [R, ceil(K/group)] in one read and
                        one write, bit-identical to formats.quantize_fp8_groups. With `up` it first
                        forms SwiGLU's silu(x) * up (rounded to x's dtype at each step, as torch
                        rounds it), so the down projection's input is never written in bf16.
  dispatch_quantize     rows of tokens copied into the expert layout and quantized per row in the
                        same pass (the bf16 rows the weight gradient reads, and the FP8 rows the
                        forward GEMM reads), bit-identical to copying then quantize_fp8.
  grouped_gemm          y[rows of g] = x[rows of g] @ w_g.T for the G experts of one format, one
                        launch, weights decoded in registers: bf16 as is; fp8 and fp8_block by FP8
                        tensor-core dots of the quantized activations with the stored bytes, scaled
                        per row/channel (fp8) or per 1x128 and 128x128 block (fp8_block) in fp32;
                        mxfp4 and nvfp4 decoded to x's dtype (W4A16: Hopper has no FP4 tensor cores).
  dequantize_fp4        MXFP4 / NVFP4 weights [G, N, K/2] -> bf16 [G, N, K], for a bf16 grouped GEMM
                        when there are enough rows per expert that the GEMM, not the weight read, costs.

The row layout comes as per-expert start and count tensors on the device: nothing waits for the
host. The GEMM's programs walk a tile list (row tile of some expert, column tile), grouped so that
programs running together share weight and activation tiles in L2.
Shape letters: G experts, R rows, K input features, N output features, B scale blocks along K.
"""

from __future__ import annotations

import torch

from moetrain.precision.formats import E4M3_MAX, FP8_BLOCK, WeightFormat

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: without it every format runs the torch paths.
    triton = None

# The weight formats the grouped GEMM decodes (its FORMAT argument).
FORMAT_CODES = {"bf16": 0, "fp8": 1, "fp8_block": 2, "mxfp4": 3, "nvfp4": 4}


def available() -> bool:
    return triton is not None


if triton is not None:
    _E4M3_MAX = tl.constexpr(E4M3_MAX)  # what a jitted function may read of a module constant

    @triton.jit
    def _fp8_scale(amax, all_finite):
        """formats.fp8_scale: amax / 448 (IEEE division), 1 where amax is 0, NaN unless all_finite."""
        scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, _E4M3_MAX, tl.float32)), 1.0)
        return tl.where(all_finite, scale, float("nan"))

    @triton.jit
    def _e4m3_codes(x, scale):
        """formats.e4m3_encode(x / scale) for fp32 x and scale of one shape: IEEE division, saturation
        to +-448, NaN kept, round to nearest even."""
        scaled = tl.clamp(tl.math.div_rn(x, scale), -_E4M3_MAX, _E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
        return scaled.to(tl.float8e4nv)

    @triton.jit
    def _fp8_scale_and_codes(x, finite, mask):
        """Rows of groups x [GROUPS, SIZE] (fp32) -> (E4M3 values, fp32 scale per group), with the
        exact arithmetic of formats.quantize_fp8_groups (IEEE divisions, round-to-nearest-even)."""
        amax = tl.max(tl.where(finite & mask, tl.abs(x), 0.0), axis=1)
        all_finite = tl.min(tl.where(mask, finite, True).to(tl.int32), axis=1) == 1
        scale = _fp8_scale(amax, all_finite)
        return _e4m3_codes(x, tl.broadcast_to(scale[:, None], x.shape)), scale

    @triton.jit
    def _quantize_fp8_kernel(
        x_ptr, up_ptr, q_ptr, scale_ptr, R, K, stride_x, stride_up, stride_q, stride_s,
        GROUP: tl.constexpr, GROUP_P2: tl.constexpr, GROUPS: tl.constexpr, ROWS: tl.constexpr, SWIGLU: tl.constexpr,
    ):
        # A program quantizes GROUPS groups of each of ROWS rows: item i of its [ROWS * GROUPS, GROUP]
        # tile is group i % GROUPS of row i // GROUPS (several rows a program when a row is short, so
        # that each program moves enough bytes to keep the memory system busy).
        item = tl.arange(0, ROWS * GROUPS)
        row_I = tl.program_id(0).to(tl.int64) * ROWS + item // GROUPS
        group_I = tl.program_id(1) * GROUPS + item % GROUPS
        within_S = tl.arange(0, GROUP_P2)
        col_IS = group_I[:, None] * GROUP + within_S[None, :]
        mask_IS = (row_I[:, None] < R) & (within_S[None, :] < GROUP) & (col_IS < K)
        x_IS = tl.load(x_ptr + row_I[:, None] * stride_x + col_IS, mask=mask_IS, other=0.0)
        dtype = x_IS.dtype
        x_IS = x_IS.to(tl.float32)
        if SWIGLU:
            # silu(gate) * up as torch computes it in x's dtype: each op in fp32, rounded once.
            up_IS = tl.load(up_ptr + row_I[:, None] * stride_up + col_IS, mask=mask_IS, other=0.0).to(tl.float32)
            silu_IS = tl.math.div_rn(x_IS, 1.0 + tl.exp(-x_IS)).to(dtype).to(tl.float32)
            x_IS = (silu_IS * up_IS).to(dtype).to(tl.float32)
        finite_IS = tl.abs(x_IS) < float("inf")  # False for +-Inf and NaN
        q_IS, scale_I = _fp8_scale_and_codes(x_IS, finite_IS, mask_IS)
        tl.store(q_ptr + row_I[:, None] * stride_q + col_IS, q_IS.to(tl.uint8, bitcast=True), mask=mask_IS)
        tl.store(scale_ptr + row_I * stride_s + group_I, scale_I, mask=(row_I < R) & (group_I * GROUP < K))

    @triton.jit
    def _swiglu_pairs(gate_up_ptr, row_I, c0, R, H, CHUNK: tl.constexpr):
        """The [ROWS, CHUNK] pairs (gate, up) of interleaved gate_up at rows row_I, pairs c0 to
        c0 + CHUNK, in fp32; with the [ROWS, 2 * CHUNK] offsets and mask of their values, and the mask
        of the pairs (rows and columns in range). Loaded as flat rows, so that each thread reads runs of
        adjacent values (vector loads), then split into gate and up in registers."""
        mask_IC = (row_I[:, None] < R) & (c0 + tl.arange(0, CHUNK)[None, :] < H)
        flat_F = 2 * c0 + tl.arange(0, 2 * CHUNK)
        mask_IF = (row_I[:, None] < R) & (flat_F[None, :] < 2 * H)
        at_IF = row_I[:, None] * (2 * H) + flat_F[None, :]
        gu_IF = tl.load(gate_up_ptr + at_IF, mask=mask_IF, other=0.0).to(tl.float32)
        gate, up = tl.split(tl.reshape(gu_IF, [row_I.shape[0], CHUNK, 2]))
        return gate, up, at_IF, mask_IF, mask_IC

    @triton.jit
    def _magnitudes(x_IC, mask_IC):
        """|x| where x is finite and in range, else 0; and 1 where x is finite or out of range, else 0
        (the two running tiles a row's scale is taken from: _row_scale)."""
        ok_IC = tl.abs(x_IC) < float("inf")  # False for +-Inf and NaN
        return tl.where(ok_IC & mask_IC, tl.abs(x_IC), 0.0), tl.where(mask_IC, ok_IC, True).to(tl.int32)

    @triton.jit
    def _row_scale(amax_IC, finite_IC):
        """formats.fp8_scale of each row of the running tiles of _magnitudes -> [ROWS, 1]."""
        return _fp8_scale(tl.max(amax_IC, axis=1), tl.min(finite_IC, axis=1) == 1)[:, None]

    @triton.jit
    def _swiglu_h(gate_up_ptr, row_I, c0, R, H, CHUNK: tl.constexpr, dtype: tl.constexpr):
        """h = silu(gate) * up at [ROWS, CHUNK] pairs from c0 as moetrain.ops.swiglu's kernel computes it
        (fp32, rounded once to dtype), and the mask of those in range."""
        gate, up, _, _, mask_IC = _swiglu_pairs(gate_up_ptr, row_I, c0, R, H, CHUNK)
        return (gate * tl.sigmoid(gate) * up).to(dtype), mask_IC

    @triton.jit
    def _store_rows_and_codes(out_ptr, q_ptr, row_I, c0, C, x_IC, mask_IC, scale_I1, CHUNK: tl.constexpr):
        """x's values at [ROWS, CHUNK] columns from c0 of row-major [R, C] out, and their E4M3 codes
        under the rows' scales at the same places of q."""
        at_IC = row_I[:, None] * C + (c0 + tl.arange(0, CHUNK))[None, :]
        tl.store(out_ptr + at_IC, x_IC, mask=mask_IC)
        codes_IC = _e4m3_codes(x_IC.to(tl.float32), tl.broadcast_to(scale_I1, x_IC.shape))
        tl.store(q_ptr + at_IC, codes_IC.to(tl.uint8, bitcast=True), mask=mask_IC)

    @triton.jit
    def _swiglu_quantize_kernel(gate_up_ptr, h_ptr, q_ptr, scale_ptr, R, H, ROWS: tl.constexpr, CHUNK: tl.constexpr,
                                ONE_PASS: tl.constexpr):
        # ROWS rows a program. ONE_PASS (CHUNK >= H): the rows are held whole, h computed once, its
        # row maxima taken and h written with its E4M3 codes. Else the rows are walked CHUNK pairs at a
        # time, twice: the first pass takes the rows' largest magnitudes, the second computes h again
        # from gate_up (its slice of the rows is in L2 by then) and writes h and its codes. Either way
        # the SwiGLU kernel and the row quantizer, with h never read back.
        row_I = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        dtype = h_ptr.dtype.element_ty
        if ONE_PASS:
            h_IC, mask_IC = _swiglu_h(gate_up_ptr, row_I, 0, R, H, CHUNK, dtype)
            amax_IC, finite_IC = _magnitudes(h_IC.to(tl.float32), mask_IC)
            scale_I1 = _row_scale(amax_IC, finite_IC)
            _store_rows_and_codes(h_ptr, q_ptr, row_I, 0, H, h_IC, mask_IC, scale_I1, CHUNK)
        else:
            amax_IC = tl.zeros([ROWS, CHUNK], tl.float32)
            finite_IC = tl.full([ROWS, CHUNK], 1, tl.int32)
            for c0 in range(0, H, CHUNK):
                h_IC, mask_IC = _swiglu_h(gate_up_ptr, row_I, c0, R, H, CHUNK, dtype)
                magnitude_IC, ok_IC = _magnitudes(h_IC.to(tl.float32), mask_IC)
                amax_IC, finite_IC = tl.maximum(amax_IC, magnitude_IC), tl.minimum(finite_IC, ok_IC)
            scale_I1 = _row_scale(amax_IC, finite_IC)
            for c0 in range(0, H, CHUNK):
                h_IC, mask_IC = _swiglu_h(gate_up_ptr, row_I, c0, R, H, CHUNK, dtype)
                _store_rows_and_codes(h_ptr, q_ptr, row_I, c0, H, h_IC, mask_IC, scale_I1, CHUNK)
        tl.store(scale_ptr + row_I[:, None], scale_I1, mask=row_I[:, None] < R)

    @triton.jit
    def _swiglu_gradients(grad_h_ptr, gate_up_ptr, row_I, c0, R, H, CHUNK: tl.constexpr, dtype: tl.constexpr):
        """d(gate) and d(up) of h = silu(gate) * up at [ROWS, CHUNK] pairs from c0, as moetrain.ops.swiglu's
        backward kernel computes them (fp32, rounded once to dtype), with the flat offsets and mask of
        the pairs' values and the pairs' mask (_swiglu_pairs)."""
        gate, up, at_IF, mask_IF, mask_IC = _swiglu_pairs(gate_up_ptr, row_I, c0, R, H, CHUNK)
        col_C = c0 + tl.arange(0, CHUNK)
        grad_h = tl.load(grad_h_ptr + row_I[:, None] * H + col_C[None, :], mask=mask_IC, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        grad_up = grad_h * gate * sig
        # d silu(g) / dg = sig(g) * (1 + g * (1 - sig(g))), as the backward kernel writes it
        grad_gate = grad_h * up * sig * (1.0 + gate * (1.0 - sig))
        return grad_gate.to(dtype), grad_up.to(dtype), at_IF, mask_IF, mask_IC

    @triton.jit
    def _pair_magnitudes(d_gate, d_up, mask_IC):
        """_magnitudes of both values of each pair, the larger magnitude and both finite."""
        gate_IC, gate_ok_IC = _magnitudes(d_gate.to(tl.float32), mask_IC)
        up_IC, up_ok_IC = _magnitudes(d_up.to(tl.float32), mask_IC)
        return tl.maximum(gate_IC, up_IC), tl.minimum(gate_ok_IC, up_ok_IC)

    @triton.jit
    def _store_pairs_and_codes(grad_ptr, q_ptr, d_gate, d_up, at_IF, mask_IF, scale_I1, ROWS: tl.constexpr,
                               CHUNK: tl.constexpr):
        """d(gate) and d(up) interleaved again as flat rows (adjacent values in a thread: vector stores),
        and their E4M3 codes."""
        scale_IC = tl.broadcast_to(scale_I1, d_gate.shape)
        q_IC2 = tl.join(_e4m3_codes(d_gate.to(tl.float32), scale_IC), _e4m3_codes(d_up.to(tl.float32), scale_IC))
        flat: tl.constexpr = [ROWS, 2 * CHUNK]
        tl.store(grad_ptr + at_IF, tl.reshape(tl.join(d_gate, d_up), flat), mask=mask_IF)
        tl.store(q_ptr + at_IF, tl.reshape(q_IC2.to(tl.uint8, bitcast=True), flat), mask=mask_IF)

    @triton.jit
    def _swiglu_backward_quantize_kernel(grad_h_ptr, gate_up_ptr, grad_ptr, q_ptr, scale_ptr, R, H,
                                         ROWS: tl.constexpr, CHUNK: tl.constexpr, ONE_PASS: tl.constexpr):
        # ROWS rows a program; the row's 2H gradient values (d(gate), d(up), rounded to grad's dtype)
        # under one scale, stored interleaved with their E4M3 codes. ONE_PASS (CHUNK >= H): the rows
        # held whole, computed once; else walked CHUNK pairs at a time, twice (the largest magnitudes,
        # then the same values computed again and written), as in _swiglu_quantize_kernel.
        row_I = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        dtype = grad_ptr.dtype.element_ty
        if ONE_PASS:
            d_gate, d_up, at_IF, mask_IF, mask_IC = _swiglu_gradients(grad_h_ptr, gate_up_ptr, row_I, 0, R, H, CHUNK,
                                                                      dtype)
            amax_IC, finite_IC = _pair_magnitudes(d_gate, d_up, mask_IC)
            scale_I1 = _row_scale(amax_IC, finite_IC)
            _store_pairs_and_codes(grad_ptr, q_ptr, d_gate, d_up, at_IF, mask_IF, scale_I1, ROWS, CHUNK)
        else:
            amax_IC = tl.zeros([ROWS, CHUNK], tl.float32)
            finite_IC = tl.full([ROWS, CHUNK], 1, tl.int32)
            for c0 in range(0, H, CHUNK):
                d_gate, d_up, _, _, mask_IC = _swiglu_gradients(grad_h_ptr, gate_up_ptr, row_I, c0, R, H, CHUNK, dtype)
                magnitude_IC, ok_IC = _pair_magnitudes(d_gate, d_up, mask_IC)
                amax_IC, finite_IC = tl.maximum(amax_IC, magnitude_IC), tl.minimum(finite_IC, ok_IC)
            scale_I1 = _row_scale(amax_IC, finite_IC)
            for c0 in range(0, H, CHUNK):
                d_gate, d_up, at_IF, mask_IF, _ = _swiglu_gradients(grad_h_ptr, gate_up_ptr, row_I, c0, R, H, CHUNK,
                                                                    dtype)
                _store_pairs_and_codes(grad_ptr, q_ptr, d_gate, d_up, at_IF, mask_IF, scale_I1, ROWS, CHUNK)
        tl.store(scale_ptr + row_I[:, None], scale_I1, mask=row_I[:, None] < R)

    @triton.jit
    def _source_row_values(x_ptr, source_I, row_I, c0, T, R, K, CHUNK: tl.constexpr):
        """Columns c0 to c0 + CHUNK of x[source[r]] for the rows row_I (zeros where source[r] == T),
        and the mask of those in range."""
        col_C = c0 + tl.arange(0, CHUNK)
        mask_IC = (row_I[:, None] < R) & (col_C[None, :] < K)
        x_IC = tl.load(x_ptr + source_I[:, None] * K + col_C[None, :], mask=mask_IC & (source_I[:, None] < T),
                       other=0.0)
        return x_IC, mask_IC

    @triton.jit
    def _dispatch_quantize_kernel(x_ptr, source_ptr, out_ptr, q_ptr, scale_ptr, T, R, K, ROWS: tl.constexpr,
                                  CHUNK: tl.constexpr, ONE_PASS: tl.constexpr):
        # ROWS rows a program: out[r] = x[source[r]] (zeros where source[r] == T) and out[r]'s E4M3
        # codes under one scale a row. ONE_PASS (CHUNK >= K): the rows held whole, read once; else
        # walked CHUNK values at a time, twice (the largest magnitudes, then the values read again,
        # from L2 by then, and written), as in _swiglu_quantize_kernel.
        row_I = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        source_I = tl.load(source_ptr + row_I, mask=row_I < R, other=T).to(tl.int64)
        if ONE_PASS:
            x_IC, mask_IC = _source_row_values(x_ptr, source_I, row_I, 0, T, R, K, CHUNK)
            amax_IC, finite_IC = _magnitudes(x_IC.to(tl.float32), mask_IC)
            scale_I1 = _row_scale(amax_IC, finite_IC)
            _store_rows_and_codes(out_ptr, q_ptr, row_I, 0, K, x_IC, mask_IC, scale_I1, CHUNK)
        else:
            amax_IC = tl.zeros([ROWS, CHUNK], tl.float32)
            finite_IC = tl.full([ROWS, CHUNK], 1, tl.int32)
            for c0 in range(0, K, CHUNK):
                x_IC, mask_IC = _source_row_values(x_ptr, source_I, row_I, c0, T, R, K, CHUNK)
                magnitude_IC, ok_IC = _magnitudes(x_IC.to(tl.float32), mask_IC)
                amax_IC, finite_IC = tl.maximum(amax_IC, magnitude_IC), tl.minimum(finite_IC, ok_IC)
            scale_I1 = _row_scale(amax_IC, finite_IC)
            for c0 in range(0, K, CHUNK):
                x_IC, mask_IC = _source_row_values(x_ptr, source_I, row_I, c0, T, R, K, CHUNK)
                _store_rows_and_codes(out_ptr, q_ptr, row_I, c0, K, x_IC, mask_IC, scale_I1, CHUNK)
        tl.store(scale_ptr + row_I[:, None], scale_I1, mask=row_I[:, None] < R)

    @triton.jit
    def _decode_e2m1_pairs(packed):
        """Bytes of two E2M1 codes (uint32, element 2i in the low nibble) -> 2^-14 times the values
        of both codes, as fp32 tensors (low, high). A code's exponent and mantissa bits, moved to the
        top of an fp16's exponent and mantissa fields, are that fp16 (also for the subnormal code 1,
        which lands on fp16's subnormal 2^-15); the block scale restores the 2^14. One multiply
        moves the magnitude bits of both codes at once (to bits 9-11 and 25-27), one the sign bits
        (to 15 and 31); the masks drop the cross terms. That is ~3 integer operations a value."""
        magnitudes = ((packed & 0x77) * 0x200200) & 0x0E000E00
        signs = ((packed & 0x88) * 0x1001000) & 0x80008000
        halves = magnitudes | signs
        low = halves.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        high = (halves >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        return low, high

    @triton.jit
    def _decode_fp4_scale(code, NVFP4: tl.constexpr):
        """Stored block-scale bytes (int32) -> fp32: E4M3 for NVFP4 (0x7F is NaN), E8M0 for MXFP4 (the
        code is an fp32 exponent field; 255 is NaN; code 0, 2^-127, an fp32 subnormal, decodes as 0)."""
        if NVFP4:  # the hardware conversion; NaN spelled out (Triton's interpreter decodes it as 480)
            value = code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            value = tl.where(code == 0x7F, float("nan"), value)
        else:
            value = tl.where(code == 255, float("nan"), (code << 23).to(tl.float32, bitcast=True))
        return value

    @triton.jit
    def _decode_fp4_tile(packed, scale_code, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SCALE_BLOCK: tl.constexpr, NVFP4: tl.constexpr):
        """Packed bytes [BLOCK_N, BLOCK_K/2] (uint8) and their scale codes [BLOCK_N, BLOCK_K/SCALE_BLOCK]
        -> fp32 weights [BLOCK_N, BLOCK_K] (element 2i in the low nibble, 2i+1 in the high one)."""
        low, high = _decode_e2m1_pairs(packed.to(tl.uint32))
        w = tl.join(low, high).reshape(BLOCK_N, BLOCK_K)
        # 2^14 folded into the block scale: one multiply per block instead of per value. Exact while
        # the scale stays below 2^114 (block maxima under ~1e35; NVFP4's block scales always are).
        scale = _decode_fp4_scale(scale_code, NVFP4) * 16384.0
        w = w.reshape(BLOCK_N, BLOCK_K // SCALE_BLOCK, SCALE_BLOCK) * scale[:, :, None]
        return w.reshape(BLOCK_N, BLOCK_K)

    @triton.jit
    def _grouped_gemm_kernel(
        x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, tensor_scale_ptr, y_ptr, start_ptr, count_ptr,
        N, K, ROW_TILES, NUM_EXPERTS, stride_xr, stride_xsr, stride_wg, stride_wn, stride_wsg, stride_wsn, stride_yr,
        FORMAT: tl.constexpr, SCALE_BLOCK: tl.constexpr, EXPERTS_P2: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_R: tl.constexpr, EVEN_K: tl.constexpr,
    ):
        # Tile (row tile t, column tile n), ordered in bands of GROUP_R row tiles so that the
        # programs running at once read few distinct activation and weight tiles.
        pid = tl.program_id(0)
        column_tiles = tl.cdiv(N, BLOCK_N)
        band = pid // (GROUP_R * column_tiles)
        first = band * GROUP_R
        band_rows = min(ROW_TILES - first, GROUP_R)
        tile = first + (pid % (GROUP_R * column_tiles)) % band_rows
        pid_n = (pid % (GROUP_R * column_tiles)) // band_rows
        # Row tile -> expert: tile_end[g] is the number of row tiles of experts 0..g (a few hundred
        # bytes every program reads, instead of a launch that would compute them).
        experts = tl.arange(0, EXPERTS_P2)
        expert_counts = tl.load(count_ptr + experts, mask=experts < NUM_EXPERTS, other=0)
        tile_end = tl.cumsum(tl.cdiv(expert_counts, BLOCK_R), 0)
        g = tl.sum(((tile_end <= tile) & (experts < NUM_EXPERTS)).to(tl.int32))
        if g >= NUM_EXPERTS:
            return  # past the last expert's tiles: the grid is sized for the worst case
        first_tile = tl.sum(tl.where(experts == g - 1, tile_end, 0))  # row tiles of experts before g
        start = tl.load(start_ptr + g).to(tl.int64)
        count = tl.load(count_ptr + g)
        rows = (tile - first_tile) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < count
        col_ok = cols < N
        g64 = g.to(tl.int64)
        w_ptr += g64 * stride_wg
        w_scale_ptr += g64 * stride_wsg
        # Masks along K only for a ragged last K tile: a mask that changes along the contiguous
        # dimension stops Triton from loading 16 bytes at a time.
        x_ptrs = x_ptr + (start + rows)[:, None] * stride_xr + tl.arange(0, BLOCK_K)[None, :]
        if FORMAT >= 3:  # FP4: two values a byte, one scale code per SCALE_BLOCK values
            w_ptrs = w_ptr + cols[:, None] * stride_wn + tl.arange(0, BLOCK_K // 2)[None, :]
            w_scale_ptrs = w_scale_ptr + cols[:, None] * stride_wsn + tl.arange(0, BLOCK_K // SCALE_BLOCK)[None, :]
        else:
            w_ptrs = w_ptr + cols[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
        acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=row_ok[:, None], other=0)
            else:
                x = tl.load(x_ptrs, mask=row_ok[:, None] & (k0 + tl.arange(0, BLOCK_K)[None, :] < K), other=0)
            if FORMAT >= 3:  # FP4: stored K is padded with zero codes to whole scale blocks
                if EVEN_K:
                    packed = tl.load(w_ptrs, mask=col_ok[:, None], other=0)
                    scale_code = tl.load(w_scale_ptrs, mask=col_ok[:, None], other=0)
                else:
                    byte_cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                    packed = tl.load(w_ptrs, mask=col_ok[:, None] & (byte_cols[None, :] < (K + 1) // 2), other=0)
                    blocks = k0 // SCALE_BLOCK + tl.arange(0, BLOCK_K // SCALE_BLOCK)
                    scale_code = tl.load(w_scale_ptrs, mask=col_ok[:, None] & (blocks[None, :] < tl.cdiv(K, SCALE_BLOCK)),
                                         other=0)
                w = _decode_fp4_tile(packed, scale_code.to(tl.int32), BLOCK_N, BLOCK_K, SCALE_BLOCK,
                                     FORMAT == 4)
                acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
                w_scale_ptrs += BLOCK_K // SCALE_BLOCK
                w_ptrs += BLOCK_K // 2
            else:
                if EVEN_K:
                    w = tl.load(w_ptrs, mask=col_ok[:, None], other=0)
                else:
                    w = tl.load(w_ptrs, mask=col_ok[:, None] & (k0 + tl.arange(0, BLOCK_K)[None, :] < K), other=0)
                if FORMAT == 0:  # bf16 weights
                    acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
                elif FORMAT == 1:  # FP8 weights and FP8 activations, both passed as bytes
                    acc = tl.dot(x.to(tl.float8e4nv, bitcast=True), tl.trans(w.to(tl.float8e4nv, bitcast=True)), acc)
                else:  # FP8, scaled per K block: one 1x128 activation and one 128x128 weight scale
                    product = tl.dot(x.to(tl.float8e4nv, bitcast=True), tl.trans(w.to(tl.float8e4nv, bitcast=True)))
                    block = k0 // SCALE_BLOCK
                    x_scale = tl.load(x_scale_ptr + (start + rows) * stride_xsr + block, mask=row_ok, other=0.0)
                    w_scale = tl.load(w_scale_ptr + (cols // SCALE_BLOCK) * stride_wsn + block, mask=col_ok, other=0.0)
                    acc += product * x_scale[:, None] * w_scale[None, :]
                w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if FORMAT == 1:  # per-token activation scale times per-channel weight scale
            x_scale = tl.load(x_scale_ptr + (start + rows) * stride_xsr, mask=row_ok, other=0.0)
            w_scale = tl.load(w_scale_ptr + cols * stride_wsn, mask=col_ok, other=0.0)
            acc = acc * x_scale[:, None] * w_scale[None, :]
        if FORMAT == 4:
            acc = acc * tl.load(tensor_scale_ptr + g)
        tl.store(y_ptr + (start + rows)[:, None] * stride_yr + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _dequantize_fp4_kernel(
        w_ptr, w_scale_ptr, tensor_scale_ptr, out_ptr, N, K, stride_wg, stride_wn, stride_wsg, stride_wsn,
        stride_og, stride_on,
        SCALE_BLOCK: tl.constexpr, NVFP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
    ):
        pid_k, pid_n, g = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        byte_cols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        blocks = pid_k * (BLOCK_K // SCALE_BLOCK) + tl.arange(0, BLOCK_K // SCALE_BLOCK)
        col_ok = cols < N
        if EVEN_K:  # no mask along K: 16-byte loads
            byte_ok = col_ok[:, None]
            block_ok = col_ok[:, None]
        else:
            byte_ok = col_ok[:, None] & (byte_cols[None, :] < (K + 1) // 2)
            block_ok = col_ok[:, None] & (blocks[None, :] < tl.cdiv(K, SCALE_BLOCK))
        packed = tl.load(w_ptr + g * stride_wg + cols[:, None] * stride_wn + byte_cols[None, :], mask=byte_ok, other=0)
        scale_code = tl.load(w_scale_ptr + g * stride_wsg + cols[:, None] * stride_wsn + blocks[None, :], mask=block_ok,
                             other=0)
        w = _decode_fp4_tile(packed, scale_code.to(tl.int32), BLOCK_N, BLOCK_K, SCALE_BLOCK, NVFP4)
        if NVFP4:
            w = w * tl.load(tensor_scale_ptr + g)
        ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + g * stride_og + cols[:, None] * stride_on + ks[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=col_ok[:, None] & (ks[None, :] < K))


# Elements (a power of two) and warps of a quantize_fp8 program: whole groups, and whole rows when
# they are shorter, up to this many elements. On an H200 (65536-131072 rows of 1536-4096 columns,
# one scale a row) 4096 elements on 4 warps ran at 1.05-1.3x the 2048 on 8 warps before, the
# fastest of 2048-16384 elements on 4, 8 or 16 warps.
QUANTIZE_ELEMENTS, QUANTIZE_WARPS = 4096, 4


def quantize_fp8(x_RK: torch.Tensor, group: int, up_RK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values [R, K] and fp32 scales [R, ceil(K/group)] of x (or of silu(x) * up), per row and
    group of `group` columns (group >= K: one scale per row)."""
    rows, k = x_RK.shape
    group = min(group, k)
    num_groups = -(-k // group)
    q_RK = torch.empty(rows, k, dtype=torch.uint8, device=x_RK.device)
    scale_RB = torch.empty(rows, num_groups, dtype=torch.float32, device=x_RK.device)
    if rows == 0:
        return q_RK.view(torch.float8_e4m3fn), scale_RB
    group_p2 = triton.next_power_of_2(group)
    groups = max(1, min(triton.next_power_of_2(num_groups), QUANTIZE_ELEMENTS // group_p2))
    rows_each = max(1, min(triton.next_power_of_2(rows), QUANTIZE_ELEMENTS // (groups * group_p2)))
    up_RK = x_RK if up_RK is None else up_RK
    _quantize_fp8_kernel[(triton.cdiv(rows, rows_each), triton.cdiv(num_groups, groups))](
        x_RK, up_RK, q_RK, scale_RB, rows, k, x_RK.stride(0), up_RK.stride(0), q_RK.stride(0), scale_RB.stride(0),
        GROUP=group, GROUP_P2=group_p2, GROUPS=groups, ROWS=rows_each, SWIGLU=up_RK is not x_RK,
        num_warps=QUANTIZE_WARPS,
    )
    return q_RK.view(torch.float8_e4m3fn), scale_RB


# The SwiGLU quantizing kernels' tile: pairs a program holds at a time (a whole row, several short
# rows, or a slice of a row wider than this, which is then walked twice), and their warps.
SWIGLU_CHUNK, SWIGLU_WARPS = 2048, 8


def _swiglu_tile(hidden: int) -> tuple[int, int, bool]:
    """(rows a program, pairs of a row per slice, whether one slice holds the whole row) for the
    SwiGLU quantizing kernels."""
    chunk = min(SWIGLU_CHUNK, triton.next_power_of_2(max(1, hidden)))
    return max(1, SWIGLU_CHUNK // chunk), chunk, chunk >= hidden


def swiglu_quantize(gate_up_RN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h = silu(gate) * up of interleaved [R, 2H] (moetrain.ops.swiglu's kernel, bit for bit) -> (h [R, H]
    in gate_up's dtype, its E4M3 values [R, H], fp32 scales [R]: quantize_fp8(h, H) bit for bit)."""
    rows, hidden = gate_up_RN.size(0), gate_up_RN.size(1) // 2
    h = gate_up_RN.new_empty(rows, hidden)
    q = torch.empty(rows, hidden, dtype=torch.uint8, device=gate_up_RN.device)
    scale = torch.empty(rows, dtype=torch.float32, device=gate_up_RN.device)
    if rows:
        rows_each, chunk, one_pass = _swiglu_tile(hidden)
        _swiglu_quantize_kernel[(triton.cdiv(rows, rows_each),)](
            gate_up_RN, h, q, scale, rows, hidden, ROWS=rows_each, CHUNK=chunk, ONE_PASS=one_pass,
            num_warps=SWIGLU_WARPS)
    return h, q.view(torch.float8_e4m3fn), scale


def swiglu_backward_quantize(grad_h_RH: torch.Tensor, gate_up_RN: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d(gate, up) of h = silu(gate) * up (moetrain.ops.swiglu's backward kernel, bit for bit) -> (the
    gradient [R, 2H] interleaved in gate_up's dtype, its E4M3 values [R, 2H], fp32 scales [R]: one per
    row of 2H, quantize_fp8(grad, 2H) bit for bit)."""
    rows, hidden = gate_up_RN.size(0), gate_up_RN.size(1) // 2
    grad = torch.empty_like(gate_up_RN)
    q = torch.empty(rows, 2 * hidden, dtype=torch.uint8, device=gate_up_RN.device)
    scale = torch.empty(rows, dtype=torch.float32, device=gate_up_RN.device)
    if rows:
        rows_each, chunk, one_pass = _swiglu_tile(hidden)
        _swiglu_backward_quantize_kernel[(triton.cdiv(rows, rows_each),)](
            grad_h_RH, gate_up_RN, grad, q, scale, rows, hidden, ROWS=rows_each, CHUNK=chunk, ONE_PASS=one_pass,
            num_warps=SWIGLU_WARPS)
    return grad, q.view(torch.float8_e4m3fn), scale


# The dispatching quantizer's tile: values of a row a program holds at a time, and its warps.
DISPATCH_CHUNK, DISPATCH_WARPS = 4096, 8


def dispatch_quantize(x_TK: torch.Tensor, source_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of tokens and their row-wise FP8 codes in one pass: x_RK[r] = x[source[r]] (zeros where
    source[r] == T, one past the last token), its E4M3 values [R, K] and fp32 scales [R] (quantize_fp8(
    x_RK, K) bit for bit)."""
    x_TK, source_R = x_TK.contiguous(), source_R.contiguous()
    tokens, k = x_TK.shape
    rows = source_R.size(0)
    x_RK = x_TK.new_empty(rows, k)
    q_RK = torch.empty(rows, k, dtype=torch.uint8, device=x_TK.device)
    scale_R = torch.empty(rows, dtype=torch.float32, device=x_TK.device)
    if rows and k:
        chunk = min(DISPATCH_CHUNK, triton.next_power_of_2(k))
        rows_each = max(1, DISPATCH_CHUNK // chunk)
        _dispatch_quantize_kernel[(triton.cdiv(rows, rows_each),)](
            x_TK, source_R, x_RK, q_RK, scale_R, tokens, rows, k, ROWS=rows_each, CHUNK=chunk, ONE_PASS=chunk >= k,
            num_warps=DISPATCH_WARPS)
    elif rows:  # rows of no values: formats.fp8_scale of an amax of 0
        scale_R.fill_(1.0)
    return x_RK, q_RK.view(torch.float8_e4m3fn), scale_R


def default_tiles(fmt: WeightFormat, rows_per_expert: float) -> tuple[int, int, int, int, int]:
    """(BLOCK_R, BLOCK_N, BLOCK_K, num_warps, num_stages) for a format and batch size. Few rows per
    expert (decode): thin row tiles, narrow column tiles so that many programs stream the weights;
    many rows: square tiles for the tensor cores. fp8_block needs BLOCK_K = 128 (its scale blocks),
    the FP4 formats a multiple of their scale block."""
    block_k = FP8_BLOCK if fmt.name in ("fp8", "fp8_block") else 64 if fmt.name == "bf16" else 128
    if rows_per_expert <= 16:
        return 16, 64, block_k, 4, 4
    if rows_per_expert <= 64:
        return 64, 64, block_k, 4, 4
    return 128, 128, block_k if fmt.name != "mxfp4" and fmt.name != "nvfp4" else 64, 8, 3


def grouped_gemm(x_RK: torch.Tensor, x_scale: torch.Tensor | None, fmt: WeightFormat, q_G: dict[str, torch.Tensor],
                 k: int, starts_G: torch.Tensor, counts_G: torch.Tensor, y_RN: torch.Tensor,
                 tiles: tuple[int, int, int, int, int] | None = None) -> None:
    """y[starts_G[g] + i] = x[starts_G[g] + i] @ w_g.T for i < counts_G[g], every g, in place in y_RN.

    x_RK: bf16/fp16 activations, or for fp8 and fp8_block their E4M3 values with x_scale the fp32
    scales from quantize_fp8 (per row / per 1x128 group). q_G: the G experts' stored tensors
    stacked on dim 0. starts_G, counts_G: int32 on the device. Rows no expert owns are not written.
    tiles: instead of default_tiles (the benchmark's tile sweep)."""
    data = q_G["data"]
    num_experts, n = data.shape[0], data.shape[1]
    rows = x_RK.size(0)
    if rows == 0 or num_experts == 0:
        return
    code = FORMAT_CODES[fmt.name]
    block_r, block_n, block_k, warps, stages = tiles or default_tiles(fmt, rows / num_experts)
    row_tiles = triton.cdiv(rows, block_r) + num_experts  # each expert wastes at most one partial tile
    if code in (1, 2):
        x_RK = x_RK.view(torch.uint8)
    else:
        x_scale = x_RK  # unused
    w_scale = q_G.get("scale", data)
    if w_scale.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        w_scale = w_scale.view(torch.uint8)
    tensor_scale = q_G.get("tensor_scale", w_scale)
    scale_block = {"fp8_block": FP8_BLOCK, "mxfp4": 32, "nvfp4": 16}.get(fmt.name, 1)
    if code in (1, 2):
        data = data.view(torch.uint8)
    grid = (row_tiles * triton.cdiv(n, block_n),)
    _grouped_gemm_kernel[grid](
        x_RK, x_scale, data, w_scale, tensor_scale, y_RN, starts_G, counts_G,
        n, k, row_tiles, num_experts, x_RK.stride(0), x_scale.stride(0), data.stride(0), data.stride(1),
        w_scale.stride(0), w_scale.stride(1) if w_scale.dim() > 1 else 0, y_RN.stride(0),
        FORMAT=code, SCALE_BLOCK=scale_block,
        EXPERTS_P2=triton.next_power_of_2(num_experts), BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_R=8, EVEN_K=k % block_k == 0, num_warps=warps, num_stages=stages,
    )


def dequantize_fp4(fmt: WeightFormat, q_G: dict[str, torch.Tensor], k: int, dtype=torch.bfloat16) -> torch.Tensor:
    """The G experts' FP4 weights as [G, N, K] in dtype. Exact for MXFP4 and NVFP4's block scales
    (an E2M1 value times an E8M0 or E4M3 scale fits bf16); NVFP4's fp32 tensor scale is folded in
    and rounds once to dtype."""
    data, scale = q_G["data"], q_G["scale"].view(torch.uint8)
    num_experts, n = data.shape[0], data.shape[1]
    out_GNK = torch.empty(num_experts, n, k, dtype=dtype, device=data.device)
    nvfp4 = fmt.name == "nvfp4"
    tensor_scale = q_G["tensor_scale"] if nvfp4 else scale
    block_n, block_k = 32, 128
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n), num_experts)
    _dequantize_fp4_kernel[grid](
        data, scale, tensor_scale, out_GNK, n, k, data.stride(0), data.stride(1), scale.stride(0), scale.stride(1),
        out_GNK.stride(0), out_GNK.stride(1),
        SCALE_BLOCK=fmt.block, NVFP4=nvfp4, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=4,
    )
    return out_GNK
