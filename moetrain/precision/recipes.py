"""The precisions of the expert GEMMs, and of FP8's weight gradient: one list of names each, checked here.

  bf16       the GEMMs multiply in the input's dtype (bf16 under autocast), as torch does;
  fp8        E4M3 operands, fp32 scales per row and column (moetrain.precision.fp8_matmul);
  fp8_block  E4M3 operands, fp32 scales per 1x128 tile and 128x128 block (DeepSeek-V3).
The weight gradient of an FP8 layer multiplies in bf16 (the default) or in FP8 by the same recipe.
"""

from __future__ import annotations

PRECISIONS = ("bf16", "fp8", "fp8_block")  # how the expert GEMMs multiply (Experts.precision)
FP8_PRECISIONS = ("fp8", "fp8_block")  # the recipes of moetrain.precision.fp8_matmul
FP8_WGRADS = ("bf16", "fp8")  # the weight gradient's GEMM in FP8 precision (Experts.fp8_wgrad)


def check_precision(precision) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    return precision


def check_fp8_precision(precision) -> str:
    if precision not in FP8_PRECISIONS:
        raise ValueError(f"precision must be one of {list(FP8_PRECISIONS)}, got {precision!r}")
    return precision


def check_fp8_wgrad(fp8_wgrad) -> str:
    if fp8_wgrad not in FP8_WGRADS:
        raise ValueError(f"fp8_wgrad must be one of {list(FP8_WGRADS)}, got {fp8_wgrad!r}")
    return fp8_wgrad
