"""Bit-exact checks of the quantization formats against the specs and naive per-block references.

The E2M1 table below is written from the OCP MX spec (sign, 2 exponent bits with bias 1, 1 mantissa
bit, no Inf/NaN); E4M3 is decoded by its formula and cross-checked with torch.float8_e4m3fn; E8M0
with torch.float8_e8m0fnu. References round with plain Python loops over the table.
"""

import math

import pytest
import torch

from moetrain.precision import formats
from moetrain.precision.formats import (
    FORMATS, e2m1_decode, e2m1_encode, e4m3_encode, get_format, mx_scale, pack_fp4, quantize_fp8_groups, unpack_fp4,
)

# code: value, from the spec's bit fields S EE M (bias 1; exponent 0 is subnormal: 0.M * 2^0).
E2M1_SPEC = {
    0b0000: 0.0, 0b0001: 0.5, 0b0010: 1.0, 0b0011: 1.5, 0b0100: 2.0, 0b0101: 3.0, 0b0110: 4.0, 0b0111: 6.0,
    0b1000: -0.0, 0b1001: -0.5, 0b1010: -1.0, 0b1011: -1.5, 0b1100: -2.0, 0b1101: -3.0, 0b1110: -4.0, 0b1111: -6.0,
}


def reference_e2m1_code(value: float) -> int:
    """Nearest E2M1 value, ties to the even code, saturating at +-6 (naive search over the table)."""
    sign = 8 if math.copysign(1.0, value) < 0 else 0
    magnitude = min(abs(value), 6.0)
    best = min(range(8), key=lambda c: (abs(E2M1_SPEC[c] - magnitude), c % 2))
    return sign | best


def e4m3_formula(code: int) -> float:
    """E4M3 ("fn") from its bit fields: bias 7, subnormals at exponent 0, S.1111.111 is NaN, no Inf."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def test_e2m1_every_code_point_decodes_and_encodes_exactly():
    codes = torch.arange(16, dtype=torch.uint8)
    decoded = e2m1_decode(codes)
    expected = torch.tensor([E2M1_SPEC[c] for c in range(16)])
    assert torch.equal(decoded, expected)
    assert torch.equal(torch.signbit(decoded), torch.signbit(expected))  # -0 keeps its sign
    assert torch.equal(e2m1_encode(expected), codes)


def test_e2m1_rounding_ties_to_even_and_saturation():
    magnitudes = sorted(set(abs(v) for v in E2M1_SPEC.values()))
    midpoints = [(a + b) / 2 for a, b in zip(magnitudes, magnitudes[1:])]
    nudged = [m + d for m in midpoints for d in (-1e-6, 1e-6)]
    special = midpoints + nudged + [6.5, 7.9, 100.0, 1e30, math.inf, 1e-30, 0.0]
    values = torch.tensor(special + [-v for v in special] + (torch.randn(2000) * 4).tolist())
    codes = e2m1_encode(values)
    assert codes.tolist() == [reference_e2m1_code(v) for v in values.tolist()]


def test_fp4_pack_layout_and_round_trip():
    # Element 2i goes to the low nibble (the layout of torch.float4_e2m1fn_x2 and the MX spec's byte order).
    assert pack_fp4(torch.tensor([0x1, 0x2, 0xF, 0x0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]
    codes = torch.randint(0, 16, (3, 5, 38), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (3, 5, 19) and packed.dtype == torch.uint8
    assert torch.equal(unpack_fp4(packed), codes)
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_fp4(unpack_fp4(every_byte)), every_byte)
    with pytest.raises(ValueError, match="even last dimension"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


def test_e4m3_every_code_point_matches_the_spec_and_round_trips():
    codes = torch.arange(256, dtype=torch.uint8)
    torch_values = codes.view(torch.float8_e4m3fn).float()
    formula = torch.tensor([e4m3_formula(c) for c in range(256)])
    assert torch.equal(torch.isnan(torch_values), torch.isnan(formula))
    finite = ~torch.isnan(formula)
    assert torch.equal(torch_values[finite], formula[finite])
    assert formula[finite].abs().max().item() == formats.E4M3_MAX
    assert torch.equal(e4m3_encode(formula[finite]).view(torch.uint8), codes[finite])


def test_e4m3_encode_rounds_to_nearest_even_and_saturates():
    positive = sorted(e4m3_formula(c) for c in range(0x7F))  # every finite non-negative value
    lows, highs = torch.tensor(positive[:-1]), torch.tensor(positive[1:])
    midpoints = (lows + highs) / 2
    low_codes = e4m3_encode(lows).view(torch.uint8)
    # At a midpoint the even code (mantissa LSB 0) wins; just off it, the nearer neighbour.
    expected = torch.where(low_codes % 2 == 0, low_codes, low_codes + 1)
    assert torch.equal(e4m3_encode(midpoints).view(torch.uint8), expected)
    assert torch.equal(e4m3_encode(torch.nextafter(midpoints, lows)).view(torch.uint8), low_codes)
    assert torch.equal(e4m3_encode(torch.nextafter(midpoints, highs)).view(torch.uint8), low_codes + 1)
    saturated = e4m3_encode(torch.tensor([449.0, 1e6, math.inf, -464.0, -math.inf])).float()
    assert saturated.tolist() == [448.0, 448.0, 448.0, -448.0, -448.0]
    assert torch.isnan(e4m3_encode(torch.tensor([math.nan])).float()).all()


def test_e8m0_shared_scale_follows_the_mx_spec():
    mantissas = torch.rand(200) + 1.0  # [1, 2)
    exponents = torch.randint(-120, 120, (200,))
    amax = mantissas * torch.pow(2.0, exponents.float())
    scale = mx_scale(amax, torch.ones(200, dtype=torch.bool))
    # floor(log2(amax)) - emax_elem(E2M1) = exponent - 2, stored with bias 127.
    assert torch.equal(scale.view(torch.uint8).long(), exponents + 127 - 2)
    assert torch.equal(scale.float(), torch.pow(2.0, (exponents - 2).float()))
    edge = torch.tensor([0.0, 2.0**-140, 2.0**127 * 1.5, 4.0, 7.99, 8.0, math.inf, math.nan])
    finite = torch.isfinite(edge)
    codes = mx_scale(torch.where(finite, edge, 0.0), finite).view(torch.uint8).tolist()
    # Zero and tiny blocks clamp to the smallest scale; fp32's largest values reach only 2^125.
    assert codes == [0, 0, 252, 127, 127, 128, 255, 255]


def reference_mxfp4(w_NK: torch.Tensor):
    """Naive per-block OCP MX quantization -> (codes [N, K], scale exponents [N, B])."""
    n, k = w_NK.shape
    codes, exponents = torch.zeros(n, k, dtype=torch.uint8), torch.zeros(n, math.ceil(k / 32), dtype=torch.long)
    for r in range(n):
        for b in range(0, k, 32):
            block = w_NK[r, b : b + 32].tolist()
            amax = max(abs(v) for v in block)
            shared = max(-127, min(127, math.floor(math.log2(amax)) - 2)) if amax > 0 else -127
            exponents[r, b // 32] = shared
            for i, v in enumerate(block):
                codes[r, b + i] = reference_e2m1_code(v / 2.0**shared)
    return codes, exponents


def test_mxfp4_matches_the_spec_with_ragged_blocks():
    torch.manual_seed(0)
    w = torch.randn(7, 75) * torch.logspace(-3, 3, 7).unsqueeze(1)  # K=75: the last block holds 11 values
    w[0, :32] = 0.0  # an all-zero block gets the smallest scale and zero codes
    q = get_format("mxfp4").quantize(w)
    codes, exponents = reference_mxfp4(w)
    assert q["data"].shape == (7, 48)  # 3 blocks of 32 values, two per byte
    assert torch.equal(unpack_fp4(q["data"])[:, :75], codes)
    assert torch.equal(unpack_fp4(q["data"])[:, 75:], torch.zeros(7, 21, dtype=torch.uint8))
    assert torch.equal(q["scale"].view(torch.uint8).long(), exponents + 127)
    expected = torch.tensor([[E2M1_SPEC[c] for c in row] for row in codes.tolist()])
    expected = expected * torch.pow(2.0, exponents.float()).repeat_interleave(32, 1)[:, :75]
    assert torch.equal(get_format("mxfp4").dequantize(q, 75), expected)


def test_nvfp4_matches_the_recipe_with_ragged_blocks():
    torch.manual_seed(1)
    w = torch.randn(5, 37) * torch.logspace(-2, 2, 5).unsqueeze(1)  # K=37: blocks of 16, 16 and 5
    q = get_format("nvfp4").quantize(w)
    tensor_scale = w.abs().max().item() / (448.0 * 6.0)
    assert q["tensor_scale"].item() == pytest.approx(tensor_scale, rel=1e-7)
    ts = q["tensor_scale"].item()
    dequantized = get_format("nvfp4").dequantize(q, 37)
    for r in range(5):
        for b in range(0, 37, 16):
            block = w[r, b : b + 16]
            # E4M3 block scale: the reference rounding is torch's own float8_e4m3fn cast.
            block_scale = torch.tensor(block.abs().max().item() / 6.0 / ts).to(torch.float8_e4m3fn)
            assert q["scale"][r, b // 16].view(torch.uint8) == block_scale.view(torch.uint8)
            effective = block_scale.float().item() * ts
            for i, v in enumerate(block.tolist()):
                code = reference_e2m1_code(v / effective)
                assert unpack_fp4(q["data"])[r, b + i].item() == code
                assert dequantized[r, b + i].item() == pytest.approx(E2M1_SPEC[code] * effective, rel=1e-6)


def test_fp8_per_channel_and_blockwise_scales_with_ragged_blocks():
    torch.manual_seed(2)
    w = torch.randn(200, 300) * torch.logspace(-2, 2, 200).unsqueeze(1)
    q = get_format("fp8").quantize(w)
    scale = w.abs().amax(1) / 448.0
    assert torch.equal(q["scale"], scale)
    assert torch.equal(q["data"].view(torch.uint8), (w / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8))

    q = get_format("fp8_block").quantize(w)
    assert q["scale"].shape == (2, 3) and q["data"].shape == (200, 300)
    for i in range(2):
        for j in range(3):
            block = w[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]
            block_scale = block.abs().max() / 448.0
            assert q["scale"][i, j] == block_scale
            stored = q["data"][128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]
            assert torch.equal(stored.view(torch.uint8), (block / block_scale).to(torch.float8_e4m3fn).view(torch.uint8))


def test_fp8_activation_groups():
    torch.manual_seed(3)
    x = torch.randn(6, 300) * 10
    q, scale = quantize_fp8_groups(x, 128)
    assert q.shape == (6, 300) and scale.shape == (6, 3)
    for j in range(3):
        group = x[:, 128 * j : 128 * (j + 1)]
        assert torch.equal(scale[:, j], group.abs().amax(1) / 448.0)
        expected = (group / scale[:, j : j + 1]).to(torch.float8_e4m3fn).float()
        assert torch.equal(q[:, 128 * j : 128 * (j + 1)].float(), expected)


@pytest.mark.parametrize("name", ["fp8", "fp8_block", "mxfp4", "nvfp4"])
def test_nan_and_inf_poison_only_their_scaling_group(name):
    torch.manual_seed(4)
    fmt = get_format(name)
    w = torch.randn(160, 200)
    bad = w.clone()
    bad[3, 5], bad[150, 190] = math.nan, -math.inf
    poisoned = fmt.dequantize(fmt.quantize(bad), 200)
    clean = fmt.dequantize(fmt.quantize(torch.where(torch.isfinite(bad), bad, 0.0)), 200)
    group = {"fp8": (1, 200), "fp8_block": (128, 128), "mxfp4": (1, 32), "nvfp4": (1, 16)}[name]
    hit = torch.zeros(160, 200, dtype=torch.bool)
    for r, c in ((3, 5), (150, 190)):
        r0, c0 = r // group[0] * group[0], c // group[1] * group[1]
        hit[r0 : r0 + group[0], c0 : c0 + group[1]] = True
    assert torch.isnan(poisoned[hit]).all()
    assert torch.equal(poisoned[~hit], clean[~hit])


# Relative Frobenius error on N(0, 1) weights: FP8 keeps 3 mantissa bits (~2.5%); FP4 keeps 1,
# and smaller blocks with finer scales (NVFP4) beat power-of-two scales on 32 values (MXFP4).
ERROR_BOUNDS = {"bf16": 0.003, "fp8": 0.03, "fp8_block": 0.03, "mxfp4": 0.125, "nvfp4": 0.105}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_error_bounds_on_random_weights(name):
    torch.manual_seed(5)
    w = torch.randn(256, 512)
    fmt = get_format(name)
    error = fmt.dequantize(fmt.quantize(w), 512) - w
    assert error.norm() / w.norm() < ERROR_BOUNDS[name]
    if name == "mxfp4":
        # Elementwise: half the widest E2M1 gap (4 -> 6) is one scale unit, but amax up to 8
        # scale units saturates to 6, so no value moves by more than 2 units of its block scale.
        scale = get_format(name).quantize(w)["scale"].float().repeat_interleave(32, 1)
        assert (error.abs() <= 2 * scale).all()
    if name in ("fp8", "fp8_block"):
        # E4M3 normals keep 3 mantissa bits: relative error <= 2^-4, subnormals <= 2^-10 units.
        scale = w.abs().amax(1, keepdim=True) / 448.0 if name == "fp8" else w.abs().max() / 448.0
        assert (error.abs() <= torch.maximum(w.abs() * 2**-4, scale * 2**-10)).all()


def test_unknown_format_is_a_clear_error():
    allowed = r"\['bf16', 'fp8', 'fp8_block', 'mxfp4', 'nvfp4'\]"
    with pytest.raises(ValueError, match=f"quantization format must be one of {allowed}, got 'fp3'"):
        get_format("fp3")
