"""The CUDA kernels (csrc/cuda/) against the pure-torch reference, forward and backward.

Skipped without a GPU. Inputs are fresh random draws; sizes include odd row lengths (scalar
path), 16-byte multiples (vector path), a misaligned base pointer, empty experts and one hot
expert, and every dtype the kernels claim.
"""

import pytest
import torch

from moetrain import ops
from moetrain.ops import reference

pytestmark = [
    pytest.mark.cuda,  # skipped without a GPU (tests/conftest.py)
]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# Relative error of the combine sums against the reference (which rounds in the same op-math type).
TOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def opmath(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def choices(tokens, k, num_experts, pattern, device="cuda"):
    """[T, K] distinct experts per token: uniform, or all tokens on the same k experts (one hot
    expert and the rest empty), or crowded into the first few experts (many empty)."""
    if pattern == "hot":
        return torch.arange(k, device=device).repeat(tokens, 1)
    scores = torch.rand(tokens, num_experts, device=device)
    if pattern == "crowded":
        scores[:, min(num_experts, k + 2):] -= 2.0
    return scores.topk(k, dim=-1).indices


def plan(idx_TK, num_experts, capacity, packed):
    tokens, k = idx_TK.shape
    dest_N, _, kept_E = reference.route(idx_TK.t().reshape(-1), num_experts, capacity, packed)
    rows = tokens * k if packed else num_experts * capacity
    return dest_N.view(k, tokens).t().contiguous(), rows


def rel_err(got, want):
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("num_experts", [1, 3, 8, 64, 300, 5000])
@pytest.mark.parametrize("entries", [0, 1, 31, 1000, 50_000])
def test_route_matches_reference(num_experts, entries):
    expert_idx = torch.randint(0, num_experts, (entries,), device="cuda")
    for capacity, packed in [(-1, True), (0, True), (entries // max(1, num_experts) + 1, True),
                             (0, False), (3, False), (entries // max(1, num_experts) + 1, False)]:
        got = ops.route(expert_idx, num_experts, capacity, packed)
        want = reference.route(expert_idx, num_experts, capacity, packed)
        for name, g, w in zip(("dest", "load", "kept"), got, want):
            assert torch.equal(g, w), (name, capacity, packed)


def test_route_one_hot_expert_and_priority_order():
    # Every entry on expert 5 of 16: slots follow the given (priority) order, the rest are dropped.
    expert_idx = torch.full((4099,), 5, device="cuda")
    dest, load, kept = ops.route(expert_idx, 16, 100, packed=False)
    assert torch.equal(dest[:100].cpu(), torch.arange(500, 600))
    assert (dest[100:] == -1).all()
    assert load[5].item() == 4099 and kept[5].item() == 100 and load.sum().item() == 4099


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dim", [1, 7, 8, 64, 1000, 2056])
@pytest.mark.parametrize("layout", ["padded", "packed", "hot"])
def test_dispatch_combine_forward_backward(dtype, dim, layout):
    tokens, k, num_experts = 301, 3, 16
    idx = choices(tokens, k, num_experts, "hot" if layout == "hot" else "crowded")
    capacity, packed = (40, False) if layout in ("padded", "hot") else (-1, True)
    dest, rows = plan(idx, num_experts, capacity, packed)
    assert (dest < 0).any() or layout == "packed"  # the padded plans drop choices

    x = torch.randn(tokens, dim, device="cuda", dtype=dtype)
    weight = torch.rand(tokens, k, device="cuda", dtype=opmath(dtype))
    grad_y = torch.randn(tokens, dim, device="cuda", dtype=dtype)
    out = {}
    for impl in ops.IMPLS:
        x_in = x.clone().requires_grad_()
        w_in = weight.clone().requires_grad_()
        buf = ops.dispatch(x_in, dest, rows, impl=impl)
        # The experts' stand-in: a fresh random buffer that depends on buf, so both gradients flow.
        noise = torch.randn(buf.shape, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(7))
        expert_out = buf * 0.5 + noise
        y = ops.combine(expert_out, dest, w_in, impl=impl)
        y.backward(grad_y)
        out[impl] = (buf, y, x_in.grad, w_in.grad)
    buf_k, y_k, gx_k, gw_k = out["kernel"]
    buf_t, y_t, gx_t, gw_t = out["torch"]
    assert torch.equal(buf_k, buf_t)  # dispatch is a copy: bit-exact, zeros in unused rows
    assert rel_err(y_k, y_t) <= TOL[dtype]
    assert rel_err(gx_k, gx_t) <= TOL[dtype]
    assert rel_err(gw_k, gw_t) <= max(TOL[dtype], 1e-5 if dtype != torch.float64 else 1e-12)
    assert not torch.isnan(y_k).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 6, 8, 9])
@pytest.mark.parametrize("dim", [7, 2048])
def test_combine_kernel_against_a_naive_loop_for_every_k(dtype, k, dim):
    """combine for the choices per token its kernel unrolls (1, 2, 4, 6, 8) and those it reads at run
    time (3, 9), on the vector path (2048) and the scalar one (7), with dropped choices (capacity):
    each token's kept rows weighted and summed, against a loop over tokens and choices."""
    tokens, num_experts = 257, 16
    dest, rows = plan(choices(tokens, k, num_experts, "crowded"), num_experts, 24, packed=False)
    assert (dest < 0).any()
    buf = torch.randn(rows, dim, device="cuda", dtype=dtype)
    weight = torch.rand(tokens, k, device="cuda")
    got = torch.ops.moetrain.combine(buf, dest, weight)
    want = torch.zeros(tokens, dim, device="cuda")
    for t, j in (dest >= 0).nonzero().tolist():
        want[t] += weight[t, j] * buf[dest[t, j]].float()
    assert rel_err(got, want) <= TOL[dtype]
    unweighted = torch.ops.moetrain.combine(buf, dest, None)
    want = torch.zeros(tokens, dim, device="cuda")
    for t, j in (dest >= 0).nonzero().tolist():
        want[t] += buf[dest[t, j]].float()
    assert rel_err(unweighted, want) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_combine_backward_kernel_against_formula(dtype):
    """combine_backward's two outputs against their formulas, with and without the weight grad."""
    tokens, k, num_experts, dim = 129, 2, 8, 256
    dest, rows = plan(choices(tokens, k, num_experts, "uniform"), num_experts, 20, packed=False)
    buf = torch.randn(rows, dim, device="cuda", dtype=dtype)
    grad_y = torch.randn(tokens, dim, device="cuda", dtype=dtype)
    weight = torch.rand(tokens, k, device="cuda")
    for weight_grad in (True, False):
        grad_buf, grad_weight = torch.ops.moetrain.combine_backward(grad_y, buf, dest, weight, rows, weight_grad)
        want_buf = torch.zeros(rows, dim, device="cuda")
        want_weight = torch.zeros(tokens, k, device="cuda")
        for t, j in (dest >= 0).nonzero().tolist():
            row = dest[t, j]
            want_buf[row] = weight[t, j] * grad_y[t].float()
            want_weight[t, j] = (grad_y[t].float() * buf[row].float()).sum()
        assert rel_err(grad_buf, want_buf) <= TOL[dtype]
        if weight_grad:
            assert rel_err(grad_weight, want_weight) <= 1e-5
        else:
            assert not grad_weight.any()


def test_misaligned_rows_take_the_scalar_path():
    # Row length a multiple of 16 bytes, but the base pointer is one element off.
    tokens, dim, k, num_experts = 50, 64, 2, 4
    storage = torch.randn(tokens * dim + 1, device="cuda")
    x = storage[1:].view(tokens, dim)
    dest, rows = plan(choices(tokens, k, num_experts, "uniform"), num_experts, -1, packed=True)
    assert torch.equal(ops.dispatch(x, dest, rows), reference.dispatch(x, dest, rows))
    weight = torch.rand(tokens, k, device="cuda")
    buf = torch.randn(rows * dim + 1, device="cuda")[1:].view(rows, dim)
    assert rel_err(ops.combine(buf, dest, weight), reference.combine(buf, dest, weight)) <= 1e-6


def test_empty_inputs():
    dest = torch.empty(0, 2, dtype=torch.long, device="cuda")
    x = torch.randn(0, 16, device="cuda")
    assert ops.dispatch(x, dest, 0).shape == (0, 16)
    assert ops.combine(torch.randn(4, 16, device="cuda"), dest, torch.rand(0, 2, device="cuda")).shape == (0, 16)
    dest_N, load, kept = ops.route(torch.empty(0, dtype=torch.long, device="cuda"), 4, -1, True)
    assert dest_N.numel() == 0 and not load.any() and not kept.any()


def test_kernel_errors_name_the_argument():
    x = torch.randn(8, 16, device="cuda")
    with pytest.raises(RuntimeError, match="dest must be int64"):
        ops.dispatch(x, torch.zeros(8, 1, dtype=torch.int32, device="cuda"), 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.moetrain.combine(x, torch.zeros(8, 1, dtype=torch.long, device="cuda"),
                                   torch.rand(8, 1, device="cuda", dtype=torch.float64))
    with pytest.raises(RuntimeError, match="dest must be on cuda"):
        torch.ops.moetrain.dispatch(x, torch.zeros(8, 1, dtype=torch.long), 8)
    with pytest.raises(RuntimeError, match="padded layout needs a capacity"):
        ops.route(torch.zeros(4, dtype=torch.long, device="cuda"), 2, -1, False)


def test_kernel_errors_with_numbers_raise():
    """Messages that format sizes and counts (they once crashed the process when built by nvcc-compiled
    code; csrc/checks.cpp formats them now)."""
    x = torch.randn(8, 16, device="cuda")
    dest = torch.zeros(8, 1, dtype=torch.long, device="cuda")
    with pytest.raises(RuntimeError, match="num_rows must be >= 0, got -3"):
        torch.ops.moetrain.dispatch(x, dest, -3)
    with pytest.raises(RuntimeError, match=r"dest must be \[tokens, k\] with tokens=8, got \[7, 1\]"):
        torch.ops.moetrain.dispatch(x, dest[:7], 8)
    with pytest.raises(RuntimeError, match=r"buf must be \[num_rows, dim\]"):
        torch.ops.moetrain.combine_backward(x, x[:3], dest, torch.rand(8, 1, device="cuda"), 8, True)
    with pytest.raises(RuntimeError, match="D must be a multiple of 8, got 12"):
        torch.ops.moetrain.router_logits(torch.randn(4, 12, device="cuda", dtype=torch.bfloat16),
                                         torch.randn(2, 12, device="cuda"))
    with pytest.raises(RuntimeError, match=r"grad must be \[4, 2\]"):
        torch.ops.moetrain.router_logits_backward(torch.randn(4, 3, device="cuda"),
                                                  torch.randn(4, 16, device="cuda", dtype=torch.bfloat16),
                                                  torch.randn(2, 16, device="cuda"), True, True)
    with pytest.raises(RuntimeError, match=r"bias must be \[experts, 16\], got \[3, 8\]"):
        torch.ops.moetrain.bias_act_(x, torch.randn(3, 8, device="cuda"), 4, True)


@pytest.mark.parametrize("capacity_factor", [1.0, 0.0, -0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_moe_layer_kernel_path_matches_torch_path(capacity_factor, dtype):
    from moetrain import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(model_dim=64, num_experts=8, hidden_size=96, top_k=2, capacity_factor=capacity_factor)
    layer = layer.cuda().to(dtype)
    x = torch.randn(4, 75, 64, device="cuda", dtype=dtype)
    grad_y = torch.randn_like(x)
    results = {}
    for impl in ops.IMPLS:
        layer.impl = impl
        layer.zero_grad(set_to_none=True)
        x_in = x.clone().requires_grad_()
        y = layer(x_in)
        y.backward(grad_y)
        results[impl] = (y, x_in.grad, [p.grad.clone() for p in layer.parameters()])
    (y_k, gx_k, gp_k), (y_t, gx_t, gp_t) = results["kernel"], results["torch"]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(y_k, y_t) <= tol
    assert rel_err(gx_k, gx_t) <= tol
    for g_k, g_t in zip(gp_k, gp_t):
        assert rel_err(g_k, g_t) <= tol
