"""The CUDA paths of quantized experts against the fp32 emulation and the torch formats (skipped
without a GPU): FP8 activation quantization bit for bit, every format's GEMM on every path, and
whole layers (packed and capacity layouts, one format and mixed formats) against the CPU layer."""

import pytest
import torch
import torch.nn.functional as F

from moetrain import MoELayer
from moetrain.precision import kernels
from moetrain.quant import QuantizedExperts, get_format
from moetrain.quant.experts import QuantizedWeight
from moetrain.precision.formats import quantize_fp8_groups
from moetrain.quant.matmul import ExpertInput, cuda_path, emulated_matmul

pytestmark = [
    pytest.mark.cuda,  # skipped without a GPU (tests/conftest.py)
    pytest.mark.skipif(not kernels.available(), reason="needs Triton"),
]

FORMATS = ["bf16", "fp8", "fp8_block", "mxfp4", "nvfp4"]


def as_int32(values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("group,k", [(128, 4096), (128, 300), (None, 4096), (None, 14336), (None, 200)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_activation_kernel_is_bit_identical_to_the_torch_quantizer(group, k, dtype):
    torch.manual_seed(0)
    x = (torch.randn(67, k, device="cuda") * torch.logspace(-3, 3, 67, device="cuda")[:, None]).to(dtype)
    x[1, 5], x[2], x[3, k // 2], x[4, 7] = float("inf"), 0.0, float("nan"), float("-inf")
    x[5, 9] = 1e4 if dtype == torch.float16 else 1e30  # one huge value: the rest of its group underflows
    group = group or k
    q, scale = kernels.quantize_fp8(x, group)
    q_ref, scale_ref = quantize_fp8_groups(x, group)
    assert same_bits(scale, scale_ref) and same_bits(q, q_ref)


def test_fused_swiglu_quantization_matches_torch_silu_times_up():
    torch.manual_seed(1)
    gate = torch.randn(300, 1536, device="cuda", dtype=torch.bfloat16) * 3
    up = torch.randn(300, 1536, device="cuda", dtype=torch.bfloat16)
    for group in (128, 1536):
        q, scale = kernels.quantize_fp8(gate, group, up)
        q_ref, scale_ref = quantize_fp8_groups(F.silu(gate) * up, group)
        # Triton's exp may differ from torch's in the last fp32 bit, which can flip a bf16 rounding.
        assert (q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean() < 1e-3
        torch.testing.assert_close(scale, scale_ref, rtol=1e-2, atol=0)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows", ["decode", "prefill"])
@pytest.mark.parametrize("n,k", [(256, 512), (384, 1024), (136, 200)])
def test_every_cuda_path_matches_the_emulation(name, rows, n, k):
    """One weight of 4 experts in one format, rows packed from 0 (one expert empty)."""
    torch.manual_seed(2)
    counts = [5, 0, 11, 3] if rows == "decode" else [600, 0, 1117, 300]  # 4.75 / 504 rows per expert
    starts = [sum(counts[:g]) for g in range(4)]
    weight = QuantizedWeight([name] * 4, n, k, device="cuda")
    weight.quantize(torch.randn(4, k, n, device="cuda"))
    x = torch.randn(sum(counts), k, device="cuda", dtype=torch.bfloat16)
    y = weight.cuda_forward(ExpertInput(x), as_int32(starts), as_int32(counts), x.size(0), packed=True)
    stack = weight.stacks[name]
    fmt = get_format(name)
    for g, (s, c) in enumerate(zip(starts, counts)):
        if c:
            reference = emulated_matmul(x[s : s + c], fmt, {key: t[g] for key, t in stack.stored().items()}, k)
            assert (y[s : s + c].float() - reference).norm() / reference.norm() < 5e-3, g
    expected = {"decode": "triton", "prefill": {"bf16": "grouped_mm", "fp8": "scaled_grouped_mm",
                                                "fp8_block": "triton", "mxfp4": "dequant+grouped_mm",
                                                "nvfp4": "dequant+grouped_mm"}[name]}[rows]
    if n % 16 or k % 16:  # torch's grouped GEMMs want multiples of 16
        expected = "triton"
    assert cuda_path(fmt, n, k, x.size(0) / 4, True) == expected


@pytest.mark.parametrize("expert", ["ffn", "swiglu"])
@pytest.mark.parametrize("capacity", [None, 700])
@pytest.mark.parametrize("formats", [["fp8"] * 6, ["fp8_block"] * 6, ["mxfp4"] * 6, ["nvfp4"] * 6,
                                     ["bf16", "fp8", "fp8_block", "mxfp4", "nvfp4", "fp8"]])
@pytest.mark.parametrize("counts", [[3, 0, 9, 1, 5, 14], [300, 0, 611, 129, 64, 500]])
@torch.no_grad()
def test_cuda_experts_match_the_cpu_emulation(expert, capacity, formats, counts):
    """Whole quantized experts on the expert-major buffer (packed or capacity layout) against the
    same module on the CPU."""
    torch.manual_seed(3)
    layer = MoELayer(model_dim=256, num_experts=6, hidden_size=384, top_k=2, expert=expert, impl="torch")
    if expert == "ffn":
        layer.experts.b1.normal_()
        layer.experts.b2.normal_()
    experts = QuantizedExperts.from_experts(layer.experts, formats)
    counts_E = torch.tensor(counts)
    starts = [e * capacity for e in range(6)] if capacity else [sum(counts[:e]) for e in range(6)]
    x_RD = torch.zeros(6 * capacity if capacity else sum(counts), 256)
    for s, c in zip(starts, counts):
        x_RD[s : s + c] = torch.randn(c, 256)
    x_RD = x_RD.to(torch.bfloat16)
    # The CPU emulation with bf16 activations rounds between the GEMMs as the GPU does, so only
    # accumulation order (and Triton's exp in the fused SwiGLU) can tell them apart.
    expected = experts(x_RD, counts_E, capacity).float()
    y = experts.cuda()(x_RD.cuda(), counts_E.cuda(), capacity).float().cpu()
    for s, c in zip(starts, counts):
        if c:
            assert torch.isfinite(y[s : s + c]).all()
            assert (y[s : s + c] - expected[s : s + c]).norm() / expected[s : s + c].norm() < 1e-2
