"""Low-precision number formats and the weight formats built from them.

Element codecs (bit-exact, from the specs):
  FP8 E4M3 ("fn": no infinities)  bias 7, largest 448; stored as torch.float8_e4m3fn.
  FP4 E2M1 (OCP MX spec)          bias 1, magnitudes 0 0.5 1 1.5 2 3 4 6, no Inf or NaN;
                                  stored two per byte, element 2i in the low nibble.
  E8M0 scale (OCP MX spec)        2^(code - 127), code 255 is NaN; stored as torch.float8_e8m0fnu.
Every conversion rounds to nearest, ties to even, and saturates to the largest finite value.

Weight formats quantize one matrix w_NK (N output features, K input features: the reduction runs
over K, so scaling blocks run along K as the hardware formats require):
  fp8        E4M3 values, one fp32 scale per output channel (row of w_NK).
  fp8_block  E4M3 values, one fp32 scale per 128x128 block (DeepSeek-V3); activations are then
             quantized at run time in 1x128 groups.
  mxfp4      E2M1 values, one E8M0 scale per 32 elements along K (OCP MX).
  nvfp4      E2M1 values, one E4M3 scale per 16 elements along K, one fp32 scale per matrix.
A NaN or +-Inf weight makes its whole scaling group (channel or block) NaN; other groups are
unaffected. Sizes that are not a multiple of the block are padded with zeros inside the last block.

Shape letters: N output features, K input features, R rows (tokens), B blocks along K, S block size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of E2M1's largest value (6 = 1.5 * 2^2): the MX spec's emax_elem
E8M0_BIAS = 127
E8M0_NAN = 255
FP8_BLOCK = 128

# FP4 E2M1 magnitudes by code 0..7 (0bEEM); codes 8..15 are the same with the sign bit set.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding to nearest: the magnitude moves up one code past each midpoint. At an exact midpoint,
# ties-to-even keeps the code whose last bit is 0, so ties at 0.75, 1.75 and 3.5 (between an odd
# and an even code) go up and the others stay down. Beyond 5 everything is 6: saturation.
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


# ---------------------------------------------------------------- element codecs


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> uint8 E2M1 codes 0..15. NaN encodes as a zero."""
    magnitude = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, tie_goes_up in _E2M1_MIDPOINTS:
        code += (magnitude >= midpoint) if tie_goes_up else (magnitude > midpoint)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes -> fp32 values."""
    table = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), device=code.device)
    return table[code.long()]


def pack_fp4(code: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2M] -> bytes [..., M]: element 2i in the low nibble, 2i+1 in the high one."""
    if code.size(-1) % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got shape {tuple(code.shape)}")
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., M] -> uint8 codes [..., 2M]; the exact inverse of pack_fp4."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, saturating: torch's cast alone maps overflow to NaN on some versions."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu -> fp32 powers of two (code 255 -> NaN)."""
    return code.to(torch.float32)


# ---------------------------------------------------------------- blocks and scales


def pad_to_blocks(x_NK: torch.Tensor, block: int) -> torch.Tensor:
    """Zero-pad the last dimension up to a multiple of block and view it as [..., B, S]."""
    k = x_NK.size(-1)
    padded = math.ceil(k / block) * block
    if padded != k:
        x_NK = torch.nn.functional.pad(x_NK, (0, padded - k))
    return x_NK.unflatten(-1, (padded // block, block))


def finite_amax(x: torch.Tensor, dim) -> tuple[torch.Tensor, torch.Tensor]:
    """(largest finite magnitude, whether every value is finite) over dim."""
    finite = torch.isfinite(x)
    amax = torch.where(finite, x.abs(), torch.zeros((), dtype=x.dtype, device=x.device)).amax(dim=dim)
    return amax, finite.all(dim=dim)


def fp8_scale(amax: torch.Tensor, all_finite: torch.Tensor) -> torch.Tensor:
    """fp32 scale that maps amax onto E4M3's largest value; 1 for an all-zero group, NaN if non-finite."""
    # A tensor divisor: CUDA turns division by a Python number into multiplication by its rounded
    # reciprocal, which would make the scales differ from the CPU's (and the Triton kernel's) in the
    # last bit.
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    return torch.where(all_finite, scale, torch.full_like(scale, math.nan))


def mx_scale(amax: torch.Tensor, all_finite: torch.Tensor) -> torch.Tensor:
    """E8M0 shared scale of the OCP MX spec: 2^(floor(log2(amax)) - emax_elem), clamped to the
    E8M0 range; a zero block gets the smallest scale and a non-finite block the NaN code."""
    # frexp writes amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1, exactly.
    _, exponent = torch.frexp(amax)
    shared = torch.where(amax > 0, exponent - 1 - E2M1_EMAX, torch.full_like(exponent, -E8M0_BIAS))
    code = (shared.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
    code = torch.where(all_finite, code, torch.full_like(code, E8M0_NAN))
    return code.view(torch.float8_e8m0fnu)


def quantize_fp8_groups(x_RK: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations -> (E4M3 values [R, K], fp32 scales [R, ceil(K/group)]): one scale per row
    and group of `group` consecutive elements (group = K: per-token; 128: DeepSeek-V3's 1x128)."""
    k = x_RK.size(-1)
    x_RBS = pad_to_blocks(x_RK.float(), group)
    amax_RB, finite_RB = finite_amax(x_RBS, -1)
    scale_RB = fp8_scale(amax_RB, finite_RB)
    q_RK = e4m3_encode(x_RBS / scale_RB.unsqueeze(-1)).flatten(-2)[..., :k]
    return q_RK, scale_RB


def dequantize_fp8_groups(q_RK: torch.Tensor, scale_RB: torch.Tensor, group: int) -> torch.Tensor:
    k = q_RK.size(-1)
    return (pad_to_blocks(q_RK.float(), group) * scale_RB.unsqueeze(-1)).flatten(-2)[..., :k]


def quantize_fp8_blocks(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Matrices [..., N, K] -> (E4M3 values [..., N, K] contiguous, fp32 scales [..., ceil(N/128),
    ceil(K/128)]): one scale per 128x128 block (DeepSeek-V3), ragged edges zero-padded inside their
    block. Any leading dims are a batch (FP8 training quantizes all experts' weights at once); torch
    ops only, so the same arithmetic runs on every device and under torch.compile."""
    *batch, n, k = w_NK.shape
    rows, cols = math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK)
    # Zero-pad both dimensions to whole blocks and view the blocks as [..., Nb, S, Kb, S].
    padded = torch.nn.functional.pad(w_NK.float(), (0, cols * FP8_BLOCK - k, 0, rows * FP8_BLOCK - n))
    w_NbSKbS = padded.view(*batch, rows, FP8_BLOCK, cols, FP8_BLOCK)
    amax, finite = finite_amax(w_NbSKbS, (-3, -1))
    scale_NbKb = fp8_scale(amax, finite)
    q = e4m3_encode(w_NbSKbS / scale_NbKb[..., :, None, :, None])
    return q.flatten(-2, -1).flatten(-3, -2)[..., :n, :k].contiguous(), scale_NbKb


def dequantize_fp8_blocks(q_NK: torch.Tensor, scale_NbKb: torch.Tensor) -> torch.Tensor:
    """The inverse of quantize_fp8_blocks up to its rounding -> fp32 [..., N, K]."""
    n, k = q_NK.shape[-2:]
    scale_NK = scale_NbKb.repeat_interleave(FP8_BLOCK, -2).repeat_interleave(FP8_BLOCK, -1)[..., :n, :k]
    return q_NK.float() * scale_NK


# ---------------------------------------------------------------- weight formats


@dataclass(frozen=True)
class WeightFormat:
    """How one weight matrix w_NK is stored. quantize returns named tensors (the checkpoint's
    buffers); dequantize inverts it exactly up to the format's rounding."""

    name: str
    bits: int  # bits per stored element, for the memory report
    description: str

    def quantize(self, w_NK: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError  # pragma: no cover - interface

    def dequantize(self, q: dict[str, torch.Tensor], k: int) -> torch.Tensor:
        raise NotImplementedError  # pragma: no cover - interface


class BF16(WeightFormat):
    def quantize(self, w_NK):
        return {"data": w_NK.to(torch.bfloat16)}

    def dequantize(self, q, k):
        return q["data"].float()


class FP8PerChannel(WeightFormat):
    def quantize(self, w_NK):
        amax_N, finite_N = finite_amax(w_NK.float(), -1)
        scale_N = fp8_scale(amax_N, finite_N)
        return {"data": e4m3_encode(w_NK.float() / scale_N.unsqueeze(-1)), "scale": scale_N}

    def dequantize(self, q, k):
        return q["data"].float() * q["scale"].unsqueeze(-1)


class FP8Blockwise(WeightFormat):
    def quantize(self, w_NK):
        q_NK, scale_NbKb = quantize_fp8_blocks(w_NK)
        return {"data": q_NK, "scale": scale_NbKb}

    def dequantize(self, q, k):
        return dequantize_fp8_blocks(q["data"], q["scale"])


class MXFP4(WeightFormat):
    block = 32

    def quantize(self, w_NK):
        w_NBS = pad_to_blocks(w_NK.float(), self.block)
        amax_NB, finite_NB = finite_amax(w_NBS, -1)
        scale_NB = mx_scale(amax_NB, finite_NB)
        # Dividing by a power of two is exact; values past 6 (amax can reach 8x the scale) saturate.
        code = e2m1_encode(w_NBS / e8m0_decode(scale_NB).unsqueeze(-1))
        return {"data": pack_fp4(code.flatten(-2)), "scale": scale_NB}

    def dequantize(self, q, k):
        value_NBS = pad_to_blocks(e2m1_decode(unpack_fp4(q["data"])), self.block)
        return (value_NBS * e8m0_decode(q["scale"]).unsqueeze(-1)).flatten(-2)[..., :k]


class NVFP4(WeightFormat):
    block = 16

    def quantize(self, w_NK):
        amax, _ = finite_amax(w_NK.float(), (0, 1))
        # The fp32 tensor scale puts the largest block scale at E4M3's top, so the E4M3 block
        # scales keep their full range for the rest.
        tensor_scale = torch.where(amax > 0, amax / (E4M3_MAX * E2M1_MAX), torch.ones_like(amax))
        w_NBS = pad_to_blocks(w_NK.float(), self.block)
        amax_NB, finite_NB = finite_amax(w_NBS, -1)
        block_scale_NB = e4m3_encode(amax_NB / E2M1_MAX / tensor_scale)
        block_scale_NB = torch.where(finite_NB, block_scale_NB.float(), math.nan).to(torch.float8_e4m3fn)
        effective_NB = block_scale_NB.float() * tensor_scale
        # A block scale that rounds to zero means every value in the block rounds to zero.
        safe_NB = torch.where(effective_NB > 0, effective_NB, torch.ones_like(effective_NB))
        code = e2m1_encode(torch.where(effective_NB.unsqueeze(-1) > 0, w_NBS / safe_NB.unsqueeze(-1), 0.0))
        return {"data": pack_fp4(code.flatten(-2)), "scale": block_scale_NB, "tensor_scale": tensor_scale}

    def dequantize(self, q, k):
        value_NBS = pad_to_blocks(e2m1_decode(unpack_fp4(q["data"])), self.block)
        scale_NB = q["scale"].float() * q["tensor_scale"]
        return (value_NBS * scale_NB.unsqueeze(-1)).flatten(-2)[..., :k]


FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        BF16("bf16", 16, "bfloat16, unquantized"),
        FP8PerChannel("fp8", 8, "FP8 E4M3, fp32 scale per output channel, per-token FP8 activations"),
        FP8Blockwise("fp8_block", 8, "FP8 E4M3, fp32 scale per 128x128 block, 1x128 FP8 activation groups"),
        MXFP4("mxfp4", 4, "FP4 E2M1, E8M0 scale per 32 elements (OCP MX), bf16 activations"),
        NVFP4("nvfp4", 4, "FP4 E2M1, E4M3 scale per 16 elements + fp32 tensor scale, bf16 activations"),
    )
}


def get_format(name: str) -> WeightFormat:
    if name not in FORMATS:
        raise ValueError(f"quantization format must be one of {sorted(FORMATS)}, got {name!r}")
    return FORMATS[name]
