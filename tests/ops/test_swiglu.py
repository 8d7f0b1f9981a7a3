"""Gated experts with the fused, interleaved gate/up weight (moetrain.ops.swiglu, SwiGLUExperts)
against the formula written out in float64: act(x @ w_gate) * (x @ w_up), forward and backward, on
the CPU (torch ops) and, with a GPU, the Triton kernel; and state dicts of the separate-weight
layout, which must still load."""

import pytest
import torch
import torch.nn.functional as F

from moetrain import MoELayer
from moetrain.moe.experts import SwiGLUExperts
from moetrain.ops import swiglu

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")])
DEVICES = ["cpu", CUDA]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative error bounds against float64: one or two roundings of the output dtype (torch's fp32 GELU
# on CUDA is accurate to a few 1e-4 in its tails, so fp32 GELU gets that bound).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.5e-2, torch.float16: 3e-3}
GELU_FP32_TOL = 1e-3
FORMULAS = {"silu": lambda g: g * torch.sigmoid(g), "gelu": lambda g: 0.5 * g * (1 + torch.erf(g / 2**0.5)),
            "relu": lambda g: g.clamp_min(0)}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("rows,hidden", [(1, 1), (37, 29), (300, 1024), (4099, 96)])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_gated_activation_matches_formula(device, dtype, rows, hidden, activation):
    gate = torch.randn(rows, hidden, dtype=torch.float64) * 3
    up = torch.randn(rows, hidden, dtype=torch.float64)
    gate_up = swiglu.interleave_gate_up(gate, up).to(device, dtype).requires_grad_()
    got = swiglu.gated_activation(gate_up, activation)
    assert got.shape == (rows, hidden) and got.dtype == dtype
    g64, u64 = (t.detach().clone().double().cpu().requires_grad_() for t in swiglu.split_gate_up(gate_up))
    want = FORMULAS[activation](g64) * u64
    tol = GELU_FP32_TOL if (activation, dtype) == ("gelu", torch.float32) else TOL[dtype]
    assert _rel(got.cpu(), want) < tol
    grad = torch.randn(rows, hidden, dtype=torch.float64)
    (grad_gate_up,) = torch.autograd.grad(got, gate_up, grad.to(device, dtype))
    want_gate, want_up = torch.autograd.grad(want, [g64, u64], grad)
    got_gate, got_up = swiglu.split_gate_up(grad_gate_up.cpu())
    assert _rel(got_gate, want_gate) < 2 * tol and _rel(got_up, want_up) < 2 * tol


@pytest.mark.parametrize("device", DEVICES)
def test_gated_activation_empty_and_bad_shapes(device):
    empty = torch.zeros(0, 8, device=device, requires_grad=True)
    h = swiglu.gated_activation(empty)
    assert h.shape == (0, 4)
    (grad,) = torch.autograd.grad(h.sum(), empty)
    assert grad.shape == (0, 8)
    with pytest.raises(ValueError, match="interleaved"):
        swiglu.gated_activation(torch.randn(3, 7, device=device))
    with pytest.raises(ValueError, match="activation must be one of"):
        swiglu.gated_activation(torch.randn(3, 8, device=device), "tanh")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_kernel_runs_on_cuda_and_compiles_into_one_graph():
    gate_up = torch.randn(515, 2 * 300, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert swiglu.kernel_runs(gate_up, "silu")
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: swiglu.gated_activation(t) * 2, fullgraph=True)
    got = compiled(gate_up)
    want = swiglu.reference(gate_up.double(), "silu") * 2
    assert _rel(got, want) < TOL[torch.bfloat16]
    got.sum().backward()
    assert gate_up.grad is not None and torch.isfinite(gate_up.grad).all()


def _naive_swiglu(x_TD, topk_idx_TK, topk_weight_TK, w_gate, w_up, w_down):
    """Token by token, choice by choice, with the separate matrices."""
    y_TD = torch.zeros_like(x_TD)
    for t in range(x_TD.size(0)):
        for k in range(topk_idx_TK.size(1)):
            e = topk_idx_TK[t, k]
            y_TD[t] += topk_weight_TK[t, k] * ((F.silu(x_TD[t] @ w_gate[e]) * (x_TD[t] @ w_up[e])) @ w_down[e])
    return y_TD


@pytest.mark.parametrize("capacity_factor", [0.0, -2.0, 4.0])
def test_swiglu_layer_matches_separate_matrices(capacity_factor):
    torch.manual_seed(torch.seed() % 2**31)
    layer = MoELayer(12, 5, 20, top_k=2, expert="swiglu", capacity_factor=capacity_factor).double()
    x = torch.randn(23, 12, dtype=torch.float64)
    y = layer(x)
    assert layer.stats.dropped_fraction == 0  # capacities large enough: every choice is computed
    routed = layer.gate(x, 2)
    ex = layer.experts
    w_gate, w_up = (w.detach().clone() for w in (ex.w_gate, ex.w_up))
    want = _naive_swiglu(x, routed.topk_idx_TK, routed.topk_weight_TK.detach(), w_gate, w_up, ex.w_down.detach())
    assert torch.allclose(y, want, atol=1e-12, rtol=1e-10)


def test_separate_weight_state_dict_loads_into_fused_layout():
    torch.manual_seed(torch.seed() % 2**31)
    num_experts, dim, hidden = 4, 6, 10
    w_gate, w_up, w_down = torch.randn(num_experts, dim, hidden), torch.randn(num_experts, dim, hidden), torch.randn(num_experts, hidden, dim)
    experts = SwiGLUExperts(num_experts, dim, hidden)
    experts.load_state_dict({"w_gate": w_gate, "w_up": w_up, "w_down": w_down})
    assert torch.equal(experts.w_gate, w_gate) and torch.equal(experts.w_up, w_up)
    assert set(experts.state_dict()) == {"w_gate_up", "w_down"}
    # Column 2j is gate unit j, column 2j + 1 up unit j.
    assert torch.equal(experts.w_gate_up[:, :, 2 * 3], w_gate[:, :, 3]) and torch.equal(experts.w_gate_up[:, :, 7], w_up[:, :, 3])
    with pytest.raises(RuntimeError, match="w_gate_up"):
        SwiGLUExperts(num_experts, dim, hidden).load_state_dict({"w_gate": w_gate, "w_down": w_down})


def test_fused_initialisation_draws_the_separate_matrices_in_order():
    """Same seed, same values as separate gate, up and down parameters drawn in that order."""
    seed = torch.seed() % 2**31
    torch.manual_seed(seed)
    experts = SwiGLUExperts(3, 8, 16)
    torch.manual_seed(seed)
    bound_in, bound_hidden = 8**-0.5, 16**-0.5
    w_gate = torch.empty(3, 8, 16).uniform_(-bound_in, bound_in)
    w_up = torch.empty(3, 8, 16).uniform_(-bound_in, bound_in)
    w_down = torch.empty(3, 16, 8).uniform_(-bound_hidden, bound_hidden)
    assert torch.equal(experts.w_gate, w_gate) and torch.equal(experts.w_up, w_up) and torch.equal(experts.w_down, w_down)
