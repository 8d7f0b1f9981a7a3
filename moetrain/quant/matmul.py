"""y = x @ w.T for one quantized weight matrix w_NK, in each format.

On CPU every format is emulated exactly: activations are quantized the way the GPU path quantizes
them (per token for fp8, 1x128 groups for fp8_block, not at all for bf16 and FP4), both operands
are dequantized to fp32 and multiplied in fp32. On CUDA:
  fp8        torch._scaled_mm with per-token activation scales and per-channel weight scales;
  fp8_block  torch._scaled_mm with 1x128 activation and 128x128 weight scales (needs K % 512 == 0
             and N % 128 == 0: cuBLAS wants the K-blocks of the weight scales padded to 4);
  mxfp4, nvfp4  W4A16: Hopper has no FP4 tensor cores, so the weights are decoded to bf16 inside a
             Triton GEMM (moetrain.quant.fp4_kernel) when Triton is installed, else decoded by torch
             then multiplied in bf16;
  bf16       a plain bf16 matmul.
Shapes the fast kernels cannot take run the emulation on the GPU (dequantize, then matmul).
Shape letters: R rows, K input features, N output features.
"""

from __future__ import annotations

import torch

from moetrain.quant import fp4_kernel
from moetrain.quant.formats import FP8_BLOCK, WeightFormat, dequantize_fp8_groups, quantize_fp8_groups

# How each format's activations are grouped for FP8 quantization (0: one group per row).
ACTIVATION_GROUP = {"fp8": 0, "fp8_block": FP8_BLOCK}


def emulated_matmul(x_RK: torch.Tensor, fmt: WeightFormat, q: dict[str, torch.Tensor], k: int) -> torch.Tensor:
    """Reference semantics of every format, in fp32: quantize-dequantize x, dequantize w, multiply."""
    x_RK = x_RK.float()
    if fmt.name in ACTIVATION_GROUP:
        group = ACTIVATION_GROUP[fmt.name] or k
        x_RK = dequantize_fp8_groups(*quantize_fp8_groups(x_RK, group), group)
    return x_RK @ fmt.dequantize(q, k).t()


def _fp8_cuda(x_RK, q, k):
    xq_RK, scale_R1 = quantize_fp8_groups(x_RK, k)
    # _scaled_mm wants the second operand column-major: w_NK.t() is exactly that.
    return torch._scaled_mm(xq_RK, q["data"].t(), scale_a=scale_R1, scale_b=q["scale"].view(1, -1),
                            out_dtype=torch.bfloat16)


def _fp8_block_cuda(x_RK, q, k):
    xq_RK, scale_RB = quantize_fp8_groups(x_RK, FP8_BLOCK)
    # cuBLAS reads 1x128 activation scales K-block-major and 128x128 weight scales as [Kb, Nb].
    return torch._scaled_mm(xq_RK, q["data"].t(), scale_a=scale_RB.t().contiguous().t(),
                            scale_b=q["scale"].t(), out_dtype=torch.bfloat16)


def fast_path(fmt: WeightFormat, n: int, k: int) -> str:
    """Which CUDA path a matrix of this format and shape takes: "kernel" or "emulated"."""
    if fmt.name == "fp8":
        return "kernel" if n % 16 == 0 and k % 16 == 0 else "emulated"
    if fmt.name == "fp8_block":
        return "kernel" if n % FP8_BLOCK == 0 and k % (4 * FP8_BLOCK) == 0 else "emulated"
    if fmt.name in ("mxfp4", "nvfp4"):
        return "kernel" if fp4_kernel.supports(fmt, n, k) else "emulated"
    return "kernel"


def quantized_matmul(x_RK: torch.Tensor, fmt: WeightFormat, q: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """x_RK @ w_NK.T -> [R, N] in x's dtype; w is given by its format and stored tensors q."""
    if not (x_RK.is_cuda and fast_path(fmt, n, k) == "kernel"):
        return emulated_matmul(x_RK, fmt, q, k).to(x_RK.dtype)
    if fmt.name == "bf16":
        y_RN = x_RK.to(torch.bfloat16) @ q["data"].t()
    elif fmt.name == "fp8":
        y_RN = _fp8_cuda(x_RK, q, k)
    elif fmt.name == "fp8_block":
        y_RN = _fp8_block_cuda(x_RK, q, k)
    else:
        y_RN = x_RK.new_empty(x_RK.size(0), n, dtype=torch.bfloat16)
        stacked = {name: tensor.unsqueeze(0) for name, tensor in q.items()}
        fp4_kernel.grouped_fp4_matmul(x_RK.to(torch.bfloat16).contiguous(), fmt, stacked, k, [0], [x_RK.size(0)], y_RN)
    return y_RN.to(x_RK.dtype)


def grouped_matmul(x_RK: torch.Tensor, fmt: WeightFormat, q_G: dict[str, torch.Tensor], n: int, k: int,
                   starts: list[int], counts: list[int], y_RN: torch.Tensor) -> None:
    """For each expert g of one format: y[start_g : start_g + count_g] = x[same rows] @ w_g.T, in place.
    q_G holds the G experts' stored tensors stacked on a leading dimension."""
    fused = x_RK.is_cuda and fmt.name in ("mxfp4", "nvfp4") and fast_path(fmt, n, k) == "kernel"
    if fused and y_RN.dtype == torch.bfloat16 and y_RN.stride(1) == 1:
        # One launch for all experts of the format, written straight into y.
        fp4_kernel.grouped_fp4_matmul(x_RK.to(torch.bfloat16).contiguous(), fmt, q_G, k, starts, counts, y_RN)
        return
    for g, (start, count) in enumerate(zip(starts, counts)):
        if count:
            q = {name: tensor[g] for name, tensor in q_G.items()}
            y_RN[start : start + count] = quantized_matmul(x_RK[start : start + count], fmt, q, n, k)
