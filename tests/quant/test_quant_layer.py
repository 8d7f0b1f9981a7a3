"""Quantized experts inside MoELayer: against a naive per-token loop and the bf16 layer; the
per-expert policy, calibration, memory report, checkpoint round trip; the FP4 Triton kernel."""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import reference_gates
from moetrain import MoELayer
from moetrain.moe import FFNExperts, moe_layers
from moetrain.quant import (
    QuantizedExperts, QuantPolicy, calibrate, expert_memory, format_memory, get_format, load_quantized,
    quantize_model, save_quantized,
)
from moetrain.quant.matmul import emulated_matmul, per_expert_scaled_mm, quantize_activations

MIXED = ["bf16", "fp8", "fp8_block", "mxfp4", "nvfp4", "fp8"]


def make_layer(expert: str, capacity_factor: float, seed: int = 0, **kwargs) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(model_dim=96, num_experts=6, hidden_size=80, top_k=2, expert=expert,
                     capacity_factor=capacity_factor, impl="torch", **kwargs)
    if expert == "ffn":
        with torch.no_grad():  # non-zero biases, so a bias on the wrong row would show
            layer.experts.b1.normal_()
            layer.experts.b2.normal_()
    return layer


# ---- weights quantized from the format specs, not by moetrain.precision.formats ------------------------
# E2M1 (OCP MX spec, FP4): sign, 2 exponent bits (bias 1), 1 mantissa bit; codes 0..7 are these
# magnitudes. E4M3 ("fn", OCP FP8): bias 7, subnormals at exponent 0, largest finite 448.
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
E4M3_MAGNITUDES = torch.tensor(
    [(m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7) for e in range(16) for m in range(8)][:127],
    dtype=torch.float64,
)  # codes 0x00..0x7E: 0x7F is NaN


def round_to_grid(v: torch.Tensor, magnitudes: torch.Tensor) -> torch.Tensor:
    """Nearest magnitude of the grid (codes in increasing order), ties to the even code, saturating
    at the largest; the sign is kept."""
    distance = (v.double().abs().unsqueeze(-1) - magnitudes).abs()
    nearest = distance == distance.min(-1, keepdim=True).values
    odd = torch.arange(len(magnitudes)) % 2
    code = torch.where(nearest, 2 * torch.arange(len(magnitudes)) + odd * 4 * len(magnitudes), 10**9).argmin(-1)
    return torch.copysign(magnitudes[code], v.double())


def spec_quantized(name: str, w_NK: torch.Tensor) -> torch.Tensor:
    """w_NK quantized and dequantized per format, from the specs (float64; scaling blocks along K)."""
    w = w_NK.double()
    n, k = w.shape
    if name == "bf16":
        return w_NK.bfloat16().double()
    if name == "fp8":  # per output channel: scale = amax / 448
        scale = w.abs().amax(1, keepdim=True) / 448
        return round_to_grid(w / scale, E4M3_MAGNITUDES) * scale
    if name == "fp8_block":  # DeepSeek-V3: one scale per 128x128 block
        out = torch.empty_like(w)
        for r in range(0, n, 128):
            for c in range(0, k, 128):
                block = w[r : r + 128, c : c + 128]
                scale = block.abs().max() / 448
                out[r : r + 128, c : c + 128] = round_to_grid(block / scale, E4M3_MAGNITUDES) * scale
        return out
    if name == "mxfp4":  # OCP MX: 32 elements share 2^(floor(log2 amax) - emax_elem), emax_elem(E2M1) = 2
        out = torch.empty_like(w)
        for c in range(0, k, 32):
            block = w[:, c : c + 32]
            amax = block.abs().amax(1, keepdim=True)
            scale = torch.pow(2.0, torch.floor(torch.log2(amax)) - 2).clamp(min=2.0**-127)
            out[:, c : c + 32] = round_to_grid(block / scale, E2M1_MAGNITUDES) * scale
        return out
    if name == "nvfp4":  # NVFP4: an fp32 tensor scale, an E4M3 scale per 16 elements, E2M1 values
        tensor_scale = torch.tensor(float(w.abs().max()) / (448 * 6), dtype=torch.float32).double()
        out = torch.empty_like(w)
        for c in range(0, k, 16):
            block = w[:, c : c + 16]
            block_scale = round_to_grid(block.abs().amax(1, keepdim=True).float().double() / 6 / tensor_scale,
                                        E4M3_MAGNITUDES)
            scale = (block_scale * tensor_scale).float().double()  # the effective scale, an fp32 number
            out[:, c : c + 16] = round_to_grid(block / scale, E2M1_MAGNITUDES) * scale
        return out
    raise ValueError(name)


def spec_activations(name: str, x_RK: torch.Tensor) -> torch.Tensor:
    """fp8: E4M3 activations per token (fp8) or per 1x128 group (fp8_block), scale = amax / 448."""
    if name not in ("fp8", "fp8_block"):
        return x_RK.double()
    group = x_RK.size(-1) if name == "fp8" else 128
    out = torch.empty(x_RK.shape, dtype=torch.float64)
    for c in range(0, x_RK.size(-1), group):
        part = x_RK[:, c : c + group].double()
        scale = part.abs().amax(1, keepdim=True).float().double() / 448
        out[:, c : c + group] = round_to_grid(part / scale, E4M3_MAGNITUDES) * scale
    return out


def test_spec_reference_quantizes_like_the_formats_promise():
    """The reference itself: grid points stay, midpoints go to the even code, overflow saturates."""
    assert round_to_grid(torch.tensor([0.25, 0.75, 2.5, 5.0, 7.0, -100.0]), E2M1_MAGNITUDES).tolist() == [
        0.0, 1.0, 2.0, 4.0, 6.0, -6.0]
    codes = torch.arange(127, dtype=torch.uint8)
    assert torch.equal(E4M3_MAGNITUDES.float(), codes.view(torch.float8_e4m3fn).float())  # torch agrees
    assert round_to_grid(torch.tensor([1000.0, 1.0 + 1 / 16, 1.0 + 3 / 16]), E4M3_MAGNITUDES).tolist() == [
        448.0, 1.0, 1.25]


def dequantized_weights(experts, formats):
    """{(name, e): w_NK as expert e's format stores it}, quantized by the spec reference above."""
    names = ("w1", "w2") if isinstance(experts, FFNExperts) else ("w_gate", "w_up", "w_down")
    out = {}
    for name in names:
        for e, w_IO in enumerate(getattr(experts, name).detach()):
            out[name, e] = spec_quantized(formats[e], w_IO.t())
    return out


def naive_quantized_expert(x_D, experts, formats, weights, e):
    """One token through expert e with e's format, written from the format semantics alone (float64)."""
    name = formats[e]

    def linear(x, weight):
        return (spec_activations(name, x.unsqueeze(0)) @ weights[weight, e].t()).squeeze(0)

    if isinstance(experts, FFNExperts):
        h = experts.act(linear(x_D, "w1") + experts.b1[e].double())
        return linear(h, "w2") + experts.b2[e].double()
    return linear(experts.act(linear(x_D, "w_gate")) * linear(x_D, "w_up"), "w_down")


@pytest.mark.parametrize("capacity_factor", [0.0, 4.0])  # packed (dropless) and padded layouts
@pytest.mark.parametrize("expert", ["ffn", "swiglu"])
@torch.no_grad()
def test_mixed_format_layer_matches_a_naive_token_loop(expert, capacity_factor):
    layer = make_layer(expert, capacity_factor)
    x = torch.randn(2, 15, 96)
    float_experts = layer.experts
    weights = dequantized_weights(float_experts, MIXED)
    layer.experts = QuantizedExperts.from_experts(float_experts, MIXED)
    y = layer(x).reshape(-1, 96)
    assert layer.stats.dropped_fraction == 0.0
    assert (layer.stats.tokens_per_expert > 0).all()  # every format's expert is exercised
    _, idx_TK, weight_TK, _ = reference_gates.route_like(layer.gate, x.reshape(-1, 96), 2)
    for t, x_D in enumerate(x.reshape(-1, 96)):
        expected = sum(
            weight * naive_quantized_expert(x_D, float_experts, MIXED, weights, e)
            for e, weight in zip(idx_TK[t].tolist(), weight_TK[t].double())
        )
        torch.testing.assert_close(y[t].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["fp8", "fp8_block", "mxfp4", "nvfp4"])
@torch.no_grad()
def test_one_format_layer_matches_the_spec_reference_over_many_blocks(name):
    """Dimensions past one scaling block in both directions (2x2 FP8 blocks of 128, 5 MXFP4 blocks
    of 32, 10 NVFP4 blocks of 16 along K = 160), weights of widely different magnitudes per row."""
    torch.manual_seed(5)
    layer = MoELayer(model_dim=160, num_experts=3, hidden_size=144, top_k=2, capacity_factor=0.0, impl="torch")
    with torch.no_grad():
        layer.experts.w1.mul_(torch.logspace(-2, 2, 144).view(1, 1, 144))  # rows of w_NK (N = H) differ
        layer.experts.b1.normal_()
        layer.experts.b2.normal_()
    formats = [name] * 3
    weights = dequantized_weights(layer.experts, formats)
    float_experts = layer.experts
    layer.experts = QuantizedExperts.from_experts(float_experts, formats)
    x = torch.randn(12, 160)
    y = layer(x)
    _, idx_TK, weight_TK, _ = reference_gates.route_like(layer.gate, x, 2)
    for t in range(12):
        expected = sum(weight * naive_quantized_expert(x[t], float_experts, formats, weights, e)
                       for e, weight in zip(idx_TK[t].tolist(), weight_TK[t].double()))
        torch.testing.assert_close(y[t].double(), expected, rtol=1e-5, atol=1e-4)


# Layer output error against the bf16 layer, relative Frobenius norm (measured ~0.05, 0.06, 0.15-0.2).
LAYER_BOUNDS = {"fp8": 0.08, "fp8_block": 0.08, "mxfp4": 0.25, "nvfp4": 0.23}


@pytest.mark.parametrize("name", ["bf16", "fp8", "fp8_block", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("expert", ["ffn", "swiglu"])
@torch.no_grad()
def test_quantized_layer_output_is_within_bounds_of_bf16(expert, name):
    layer = make_layer(expert, 1.0, seed=1)
    bf16 = copy.deepcopy(layer)
    for param in bf16.experts.parameters():
        if param.dim() == 3:  # weight matrices; biases stay float in QuantizedExperts too
            param.copy_(param.bfloat16().float())
    x = torch.randn(64, 96)
    reference = bf16(x)
    quantize_model(layer, QuantPolicy(name))
    y = layer(x)
    if name == "bf16":
        torch.testing.assert_close(y, reference, rtol=1e-6, atol=1e-6)
    else:
        assert 0 < (y - reference).norm() / reference.norm() < LAYER_BOUNDS[name]


def test_policy_gives_the_hot_experts_the_precise_format():
    policy = QuantPolicy(format="mxfp4", hot_format="fp8", hot_fraction=0.25)
    counts = torch.tensor([5, 90, 3, 40, 41, 7, 0, 12])
    assert policy.expert_formats(8, counts) == ["mxfp4", "fp8", "mxfp4", "mxfp4", "fp8", "mxfp4", "mxfp4", "mxfp4"]
    assert QuantPolicy("nvfp4").expert_formats(3) == ["nvfp4"] * 3
    with pytest.raises(ValueError, match="needs calibration counts"):
        policy.expert_formats(8)
    with pytest.raises(ValueError, match="hot_fraction must be a number in"):
        QuantPolicy(hot_fraction=1.5)
    with pytest.raises(ValueError, match="quantization format must be one of"):
        QuantPolicy(format="int4")


@torch.no_grad()
def test_calibration_counts_routing_and_drives_the_plan():
    torch.manual_seed(2)
    model = nn.Sequential(MoELayer(32, 8, 48, impl="torch"), nn.ReLU(), MoELayer(32, 8, 48, top_k=1, impl="torch"))
    batches = [torch.randn(40, 32) for _ in range(3)]
    counts = calibrate(model, batches)
    # Independent count: route with the reference gates and histogram their choices.
    expected = [torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long)]
    for x in batches:
        first, second = model[0], model[2]
        expected[0] += torch.bincount(reference_gates.route_like(first.gate, x, 2)[1].flatten(), minlength=8)
        h = model[1](first(x))
        expected[1] += torch.bincount(reference_gates.route_like(second.gate, h, 1)[1].flatten(), minlength=8)
    assert all(torch.equal(c, e) for c, e in zip(counts, expected))
    plan = quantize_model(model, QuantPolicy("nvfp4", hot_format="fp8", hot_fraction=0.5), counts)
    for layer_counts, formats in zip(counts, plan):
        hot = sorted(torch.argsort(layer_counts, descending=True, stable=True)[:4].tolist())
        assert [e for e, f in enumerate(formats) if f == "fp8"] == hot
    assert all(isinstance(layer.experts, QuantizedExperts) for layer in moe_layers(model))


def test_memory_report_counts_the_stored_bytes():
    layer = make_layer("swiglu", 1.0)  # D=96, H=80, 6 experts, 3 matrices each
    quantize_model(layer, QuantPolicy("mxfp4"))
    report = expert_memory(layer)
    # w_gate, w_up: N=80, K=96 -> 3 blocks of 32; w_down: N=96, K=80 -> 3 blocks (padded to 96).
    per_expert = 2 * (80 * 96 // 2 + 80 * 3) + (96 * 96 // 2 + 96 * 3)
    assert report["mxfp4"].bytes == 6 * per_expert
    assert report["mxfp4"].elements == 6 * 3 * 96 * 80
    assert "total" in format_memory(report)
    unquantized = expert_memory(make_layer("ffn", 1.0))["unquantized"]
    assert unquantized.bytes == 4 * 2 * 6 * 96 * 80  # fp32 w1 and w2


@torch.no_grad()
def test_quantized_checkpoint_loads_back_exactly(tmp_path):
    def build(seed):
        return nn.Sequential(make_layer("ffn", 0.0, seed=seed), make_layer("swiglu", 1.0, seed=seed + 1))

    model = build(3)
    x = torch.randn(30, 96)
    plan = quantize_model(model, QuantPolicy("nvfp4", hot_format="fp8_block"), calibrate(model, [x]))
    expected = model(x)
    save_quantized(model, plan, str(tmp_path / "model.q.pt"))
    fresh = build(10)  # different float weights: everything must come from the file
    assert load_quantized(fresh, str(tmp_path / "model.q.pt")) == plan
    assert torch.equal(fresh(x), expected)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                                  b.view(torch.uint8) if b.element_size() == 1 else b), name


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from moetrain.precision import kernels
    from moetrain.quant import get_format
    from moetrain.precision.formats import quantize_fp8_groups
    from moetrain.quant.matmul import emulated_matmul
    torch.manual_seed(0)
    as_int32 = lambda values: torch.tensor(values, dtype=torch.int32)
    # Ragged experts (one empty, a gap of rows nobody owns) in thin row tiles, then in 128-row tiles.
    for counts, starts in (([5, 0, 19], [0, 5, 7]), ([150, 0, 140], [0, 150, 152])):
        total = starts[-1] + counts[-1]
        # K a multiple of the K tile or not (masked loads along K), for each kind of weight decode.
        for name, n, k in (("bf16", 40, 128), ("fp8", 40, 200), ("fp8_block", 136, 256), ("mxfp4", 40, 80),
                           ("nvfp4", 24, 256)):
            fmt = get_format(name)
            qs = [fmt.quantize(torch.randn(n, k)) for _ in range(3)]
            stacked = {key: torch.stack([q[key] for q in qs]) for key in qs[0]}
            # fp16: the interpreter multiplies bf16 as raw bits.
            x = torch.randn(total, k).half()
            if name == "bf16":
                stacked["data"] = stacked["data"].half()
            xq, x_scale = quantize_fp8_groups(x.float(), k if name == "fp8" else 128) if "fp8" in name else (x, None)
            y = torch.zeros(total, n, dtype=torch.half)
            kernels.grouped_gemm(xq, x_scale, fmt, stacked, k, as_int32(starts), as_int32(counts), y)
            for q, s, c in zip(qs, starts, counts):
                torch.testing.assert_close(y[s:s + c].float(), emulated_matmul(x[s:s + c].float(), fmt, q, k).half().float(),
                                           rtol=2e-3, atol=2e-3)
            assert y[counts[0]:starts[2]].abs().sum() == 0
            if name in ("mxfp4", "nvfp4"):
                w = kernels.dequantize_fp4(fmt, stacked, k, torch.float32)
                for g, q in enumerate(qs):  # exact up to NVFP4's fp32 tensor scale, folded in
                    torch.testing.assert_close(w[g], fmt.dequantize(q, k), rtol=1e-6, atol=0)
    # Every byte (two E2M1 codes) with every NVFP4 block scale and a range of MXFP4 ones (MXFP4's
    # code 0, 2^-127, decodes as 0 on the GPU), decoded to fp32 by the kernel and by the format.
    codes = torch.arange(256, dtype=torch.uint8).repeat(128, 1)  # [128 channels, 512 values]
    for name, scale in (("nvfp4", torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn)),
                        ("mxfp4", torch.arange(64, 192, dtype=torch.uint8).view(torch.float8_e8m0fnu))):
        fmt = get_format(name)
        q = {"data": codes, "scale": scale[:, None].expand(128, 512 // fmt.block).contiguous(),
             "tensor_scale": torch.tensor(1.0)}
        w = kernels.dequantize_fp4(fmt, {key: t.unsqueeze(0) for key, t in q.items()}, 512, torch.float32)[0]
        expected = fmt.dequantize(q, 512)
        assert torch.equal(w.nan_to_num(7.0), expected.nan_to_num(7.0)), name
    # FP8 activations: the scales are bit-exact. The interpreter's own fp32 -> E4M3 cast misrounds
    # (values just below a power of two drop a binade, some ties go up, NaN becomes a number), so
    # here the codes are only checked to within a factor of two; the GPU test checks them bit for bit.
    # (Several rows a program: 4 rows of 3 groups at k=300, 32 rows of one group at k=40.)
    for group, k in ((128, 300), (96, 96), (128, 256), (64, 40)):
        x = (torch.randn(7, k) * 3).half()
        x[1, 5], x[2], x[3, k - 1] = float("inf"), 0.0, float("nan")
        q, scale = kernels.quantize_fp8(x, group)
        q_ref, scale_ref = quantize_fp8_groups(x.float(), group)
        assert torch.equal(scale.nan_to_num(-1.0), scale_ref.nan_to_num(-1.0))
        finite = torch.isfinite(q_ref.float())
        assert ((q.float() - q_ref.float()).abs() <= q_ref.float().abs() / 2)[finite].all()
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests run the kernels there")
def test_triton_kernels_in_the_interpreter():
    """The Triton kernels' logic, run by Triton's CPU interpreter (the GPU runs are the CUDA tests)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests compile and run the kernels there")
def test_triton_kernels_compile_for_hopper():
    """What the interpreter cannot see (globals, types, FP8 tensor-core dots): the kernels compiled
    for sm_90 by Triton's own compiler, on this CPU, for one decode and one prefill tile."""
    pytest.importorskip("triton.backends.nvidia")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moetrain.precision import kernels

    def compile_ptx(fn, types: dict, constants: dict, **options) -> str:
        signature = {**types, **dict.fromkeys(constants, "constexpr")}
        return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants), target=GPUTarget("cuda", 90, 32),
                              options=options).asm["ptx"]

    ptx = compile_ptx(kernels._quantize_fp8_kernel,
                      {"x_ptr": "*bf16", "up_ptr": "*bf16", "q_ptr": "*u8", "scale_ptr": "*fp32", "R": "i32", "K": "i32",
                       "stride_x": "i32", "stride_up": "i32", "stride_q": "i32", "stride_s": "i32"},
                      {"GROUP": 128, "GROUP_P2": 128, "GROUPS": 8, "ROWS": 2, "SWIGLU": True}, num_warps=8)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx  # hardware RNE cast, IEEE division
    gemm_types = {"x_scale_ptr": "*fp32", "tensor_scale_ptr": "*fp32", "y_ptr": "*bf16", "start_ptr": "*i32",
                  "count_ptr": "*i32", **dict.fromkeys(["N", "K", "ROW_TILES", "NUM_EXPERTS", "stride_xr", "stride_xsr",
                                                       "stride_wg", "stride_wn", "stride_wsg", "stride_wsn", "stride_yr"], "i32")}
    for name, x_type, scale_type, tiles in (("fp8_block", "*u8", "*fp32", (16, 64, 128, 4, 4)),
                                            ("nvfp4", "*bf16", "*u8", (128, 128, 64, 8, 3))):
        block_r, block_n, block_k, warps, stages = tiles
        ptx = compile_ptx(kernels._grouped_gemm_kernel,
                          {"x_ptr": x_type, "w_ptr": "*u8", "w_scale_ptr": scale_type, **gemm_types},
                          {"FORMAT": kernels.FORMAT_CODES[name], "SCALE_BLOCK": 128 if name == "fp8_block" else 16,
                           "EXPERTS_P2": 8, "BLOCK_R": block_r, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_R": 8,
                           "EVEN_K": name == "nvfp4"},
                          num_warps=warps, num_stages=stages)
        # FP8 operands for FP8 weights; Hopper's warp-group MMAs for the 128-row tile
        assert ("e4m3" in ptx if name == "fp8_block" else "wgmma" in ptx)
    compile_ptx(kernels._dequantize_fp4_kernel,
                {"w_ptr": "*u8", "w_scale_ptr": "*u8", "tensor_scale_ptr": "*fp32", "out_ptr": "*bf16",
                 **dict.fromkeys(["N", "K", "stride_wg", "stride_wn", "stride_wsg", "stride_wsn", "stride_og", "stride_on"], "i32")},
                {"SCALE_BLOCK": 32, "NVFP4": False, "BLOCK_N": 32, "BLOCK_K": 128, "EVEN_K": True}, num_warps=4)


def rowwise_scaled_mm_runs(device: str) -> bool:
    """Whether this torch's _scaled_mm takes per-row scales on the device (CPU: torch 2.14 yes, 2.11 no)."""
    a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device), scale_b=torch.ones(1, 16, device=device),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("segments", [[(0, 0, 17), (2, 20, 5)], [(0, 0, 16), (1, 16, 32)]])
def test_fp8_gemm_rows_are_realigned_to_16(segments, device):
    """The per-expert FP8 path (torch._scaled_mm, the fallback without Triton) on ragged experts."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not rowwise_scaled_mm_runs(device):
        pytest.skip(f"torch {torch.__version__} has no row-wise _scaled_mm on {device}")
    torch.manual_seed(7)
    fmt = get_format("fp8")
    qs = [fmt.quantize(torch.randn(64, 128, device=device)) for _ in range(3)]
    stacked = {key: torch.stack([q[key] for q in qs]) for key in qs[0]}
    x = torch.randn(60, 128, device=device)
    y = torch.zeros(60, 64, device=device)
    per_expert_scaled_mm(fmt, *quantize_activations(x, fmt), stacked, segments, y)
    owned = torch.zeros(60, dtype=torch.bool, device=device)
    for g, start, count in segments:
        reference = emulated_matmul(x[start : start + count], fmt, qs[g], 128)
        assert (y[start : start + count] - reference).norm() / reference.norm() < 4e-3  # bf16 output rounding
        owned[start : start + count] = True
    assert torch.equal(y[~owned], torch.zeros_like(y[~owned]))


def test_every_quant_config_builds_a_policy():
    from importlib import resources

    OmegaConf = pytest.importorskip("omegaconf").OmegaConf

    # The configs as the installed package ships them (moetrain.conf), wherever that is.
    folder = resources.files("moetrain.conf").joinpath("quant")
    configs = sorted((p for p in folder.iterdir() if p.name.endswith(".yaml")), key=lambda p: p.name)
    assert {c.name[: -len(".yaml")] for c in configs} >= {"none", "fp8", "fp8_block", "mxfp4", "nvfp4", "mixed"}
    for path in configs:
        cfg = OmegaConf.to_container(OmegaConf.create(path.read_text()))
        assert set(cfg) == {"format", "hot_format", "hot_fraction", "calibration_batches", "export"}, path
        if cfg["format"] is not None:
            policy = QuantPolicy(cfg["format"], cfg["hot_format"], cfg["hot_fraction"])
            assert policy.needs_calibration == (cfg["calibration_batches"] > 0), path
