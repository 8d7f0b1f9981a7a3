"""W4A16 grouped GEMM for MXFP4 / NVFP4 experts, with the FP4 decode fused into the GEMM (Triton).

Hopper has no FP4 tensor cores, so the kernel streams the packed weights (half a byte per value
plus the block scales), decodes each tile to bf16 in registers and feeds bf16 tensor cores. The
decode is exact: an E2M1 value (2 significant bits) times an E8M0 power of two, or times an E4M3
block scale (4 significant bits), fits bf16's 8 significant bits; NVFP4's fp32 tensor scale is
applied to the fp32 accumulator. Small batches (decode) are bound by reading the weights, which is
where 4-bit weights pay: ~3.6x fewer bytes than bf16.

One launch covers every expert of a format: program (row tile, column tile, expert) computes the
rows [start_g, start_g + count_g) of expert g in the expert-major buffer.
Shape letters: G experts in the launch, R rows, K input features, N output features, B scale blocks.
"""

from __future__ import annotations

import torch

from moetrain.quant.formats import WeightFormat

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: without it the FP4 formats run the torch emulation path.
    triton = None


def available() -> bool:
    return triton is not None


def supports(fmt: WeightFormat, n: int, k: int) -> bool:
    """Whether the fused kernel can take a matrix (any N, K work; Triton must be installed)."""
    return available() and fmt.name in ("mxfp4", "nvfp4")


if triton is not None:

    @triton.jit
    def _decode_e2m1(code):
        # 4 * |value| is an integer: m << 1 for exponent 0, (2 + m) << e otherwise (E2M1, bias 1).
        exponent = (code >> 1) & 3
        mantissa = code & 1
        quadruple = tl.where(exponent == 0, mantissa << 1, (2 + mantissa) << exponent)
        magnitude = quadruple.to(tl.float32) * 0.25
        return tl.where((code & 8) != 0, -magnitude, magnitude)

    @triton.jit
    def _nan_like(code):
        return (code * 0 + 0x7FC00000).to(tl.float32, bitcast=True)  # the quiet-NaN bit pattern

    @triton.jit
    def _decode_scale(code, NVFP4: tl.constexpr):
        if NVFP4:
            # E4M3 block scale (always positive): 1024 * value = m << 1 (subnormal) or (8 + m) << e.
            exponent = (code >> 3) & 15
            mantissa = code & 7
            scaled = tl.where(exponent == 0, mantissa << 1, (8 + mantissa) << exponent)
            value = tl.where((exponent == 15) & (mantissa == 7), _nan_like(code), scaled.to(tl.float32) * (1.0 / 1024.0))
        else:
            # E8M0: the code is the fp32 exponent field. Code 0 (2^-127, an fp32 subnormal) decodes as 0.
            value = tl.where(code == 255, _nan_like(code), (code << 23).to(tl.float32, bitcast=True))
        return value

    @triton.jit
    def _fp4_grouped_kernel(
        x_ptr, w_ptr, scale_ptr, tensor_scale_ptr, y_ptr, start_ptr, count_ptr,
        N, K, stride_xr, stride_wg, stride_wn, stride_sg, stride_sn, stride_yr,
        NVFP4: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_r = tl.program_id(0)
        pid_n = tl.program_id(1)
        g = tl.program_id(2)
        count = tl.load(count_ptr + g)
        if pid_r * BLOCK_R >= count:
            return
        # 64-bit offsets: rows * stride and expert * stride pass 2^31 on large layers.
        start = tl.load(start_ptr + g).to(tl.int64)
        w_ptr += g.to(tl.int64) * stride_wg
        scale_ptr += g.to(tl.int64) * stride_sg
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < count
        col_ok = cols < N
        acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + (start + rows)[:, None] * stride_xr + ks[None, :],
                        mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
            # Stored K is padded with zero codes to whole scale blocks, so reading past K is safe
            # up to the padded width; the activation mask above zeroes those products anyway.
            byte_cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_ptr + cols[:, None] * stride_wn + byte_cols[None, :],
                             mask=col_ok[:, None] & (byte_cols[None, :] < (K + 1) // 2), other=0).to(tl.int32)
            w = tl.join(_decode_e2m1(packed & 15), _decode_e2m1(packed >> 4)).reshape(BLOCK_N, BLOCK_K)
            blocks = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            scale_code = tl.load(scale_ptr + cols[:, None] * stride_sn + blocks[None, :],
                                 mask=col_ok[:, None] & (blocks[None, :] < (K + GROUP - 1) // GROUP), other=0)
            scale = _decode_scale(scale_code.to(tl.int32), NVFP4)
            w = (w.reshape(BLOCK_N, BLOCK_K // GROUP, GROUP) * scale[:, :, None]).reshape(BLOCK_N, BLOCK_K)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        if NVFP4:
            acc = acc * tl.load(tensor_scale_ptr + g)
        tl.store(y_ptr + (start + rows)[:, None] * stride_yr + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def _tiles(max_rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_N, BLOCK_K, num_warps): thin row tiles for decode, square ones for prefill."""
    if max_rows <= 16:
        return 16, 64, 128, 4
    if max_rows <= 64:
        return 64, 64, 128, 4
    return 128, 128, 64, 8


def grouped_fp4_matmul(x_RK: torch.Tensor, fmt: WeightFormat, q: dict[str, torch.Tensor], k: int,
                       starts: list[int], counts: list[int], y_RN: torch.Tensor) -> None:
    """y[rows of expert g] = x[rows of expert g] @ dequantize(w_g).T for every g, in place in y_RN.

    q holds the stacked tensors of the G experts: data [G, N, G_K/2] uint8, scale [G, N, B],
    tensor_scale [G] (NVFP4). x_RK and y_RN are bf16 (or fp16), contiguous in their last dimension.
    """
    if not counts or max(counts) == 0:
        return
    data, scale = q["data"], q["scale"].view(torch.uint8)
    num_experts, n = data.shape[0], data.shape[1]
    nvfp4 = fmt.name == "nvfp4"
    tensor_scale = q["tensor_scale"] if nvfp4 else scale  # unused when not NVFP4
    start_G = torch.tensor(starts, dtype=torch.int32, device=x_RK.device)
    count_G = torch.tensor(counts, dtype=torch.int32, device=x_RK.device)
    block_r, block_n, block_k, warps = _tiles(max(counts))
    grid = (triton.cdiv(max(counts), block_r), triton.cdiv(n, block_n), num_experts)
    _fp4_grouped_kernel[grid](
        x_RK, data, scale, tensor_scale, y_RN, start_G, count_G,
        n, k, x_RK.stride(0), data.stride(0), data.stride(1), scale.stride(0), scale.stride(1), y_RN.stride(0),
        NVFP4=nvfp4, GROUP=fmt.block, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )
