"""The C++ kernels (impl="kernel") against the pure-torch reference and a naive loop."""

import pytest
import torch

from moetrain import ops


def naive_route(expert_idx, num_experts, capacity, packed):
    """Plain Python: slot = earlier entries with the same expert; then lay out rows."""
    load = [0] * num_experts
    slots = []
    for e in expert_idx.tolist():
        slots.append(load[e])
        load[e] += 1
    cap = len(slots) if capacity < 0 else capacity
    kept = [min(n, cap) for n in load]
    base = [sum(kept[:e]) if packed else e * cap for e in range(num_experts)]
    dest = [base[e] + s if s < cap else -1 for e, s in zip(expert_idx.tolist(), slots)]
    return torch.tensor(dest), torch.tensor(load), torch.tensor(kept)


def random_plan(tokens, k, num_experts, capacity, packed, skew=False, generator=None):
    if skew:  # every choice on expert 0 (and the next ones for k > 1): most experts stay empty
        idx = torch.arange(k).repeat(tokens, 1)
    else:
        idx = torch.stack([torch.randperm(num_experts, generator=generator)[:k] for _ in range(tokens)])
    dest_N, load, kept = ops.route(idx.t().reshape(-1), num_experts, capacity, packed, impl="torch")
    rows = tokens * k if packed else num_experts * capacity
    return idx, dest_N.view(k, tokens).t().contiguous(), rows


@pytest.mark.parametrize("packed,capacity", [(True, -1)] + [(p, c) for p in (False, True) for c in (0, 1, 3, 50)])
@pytest.mark.parametrize("num_experts", [1, 5, 256])
def test_route_matches_naive(packed, capacity, num_experts):
    expert_idx = torch.randint(0, num_experts, (97,))
    expected = naive_route(expert_idx, num_experts, capacity, packed)
    for impl in ops.IMPLS:
        for got, want in zip(ops.route(expert_idx, num_experts, capacity, packed, impl=impl), expected):
            assert torch.equal(got, want), impl


# fp32: the weight gradient sums 19 products of up to about 10 in another order than the reference,
# which moves it by up to about 19 * 10 * 2**-24 = 1e-5.
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 1e-12), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("layout", ["padded", "packed", "skewed"])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_dispatch_combine_kernel_matches_reference(dtype, tol, layout, k):
    tokens, dim, num_experts = 37, 19, 8
    capacity = 5 if layout == "padded" else -1
    idx, dest, rows = random_plan(tokens, k, num_experts, capacity, layout != "padded", skew=layout == "skewed")
    x = torch.randn(tokens, dim, dtype=dtype)
    weight = torch.rand(tokens, k, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    grad_y = torch.randn(tokens, dim, dtype=dtype)
    results = {}
    for impl in ops.IMPLS:
        xi = x.clone().requires_grad_()
        wi = weight.clone().requires_grad_()
        buf = ops.dispatch(xi, dest, rows, impl=impl)
        out = buf * 1.5 + 0.25  # a stand-in expert, so combine sees rows unlike its input
        y = ops.combine(out, dest, wi, impl=impl)
        y.backward(grad_y)
        results[impl] = (buf, y, xi.grad, wi.grad)
    for got, want in zip(results["kernel"], results["torch"]):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)
    # Unwritten rows are exactly zero; written rows are the token's copy.
    buf = results["kernel"][0]
    written = torch.zeros(rows, dtype=torch.bool)
    written[dest[dest >= 0]] = True
    assert torch.all(buf[~written] == 0)
    for t in range(tokens):
        for j in range(k):
            if dest[t, j] >= 0:
                assert torch.equal(buf[dest[t, j]], x[t])


def test_combine_matches_naive_loop():
    tokens, k, dim, num_experts = 23, 3, 7, 6
    _, dest, rows = random_plan(tokens, k, num_experts, 4, packed=False)
    buf = torch.randn(rows, dim, dtype=torch.float64)
    weight = torch.rand(tokens, k, dtype=torch.float64)
    y = ops.combine(buf, dest, weight, impl="kernel")
    for t in range(tokens):
        want = sum((weight[t, j] * buf[dest[t, j]] for j in range(k) if dest[t, j] >= 0), torch.zeros(dim, dtype=torch.float64))
        torch.testing.assert_close(y[t], want)


@pytest.mark.parametrize("packed", [False, True])
def test_kernel_gradcheck_fp64(packed):
    tokens, k, dim, num_experts = 11, 2, 5, 4
    _, dest, rows = random_plan(tokens, k, num_experts, -1 if packed else 3, packed)
    x = torch.randn(tokens, dim, dtype=torch.float64, requires_grad=True)
    w = torch.rand(tokens, k, dtype=torch.float64, requires_grad=True)
    mix = torch.randn(dim, dim, dtype=torch.float64)

    def layer(x, w):
        return ops.combine(torch.tanh(ops.dispatch(x, dest, rows, impl="kernel") @ mix), dest, w, impl="kernel")

    assert torch.autograd.gradcheck(layer, (x, w))


def test_kernel_rejects_bad_plans():
    x = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.dispatch(x, torch.tensor([[0], [9], [1], [2]]), 4)
    with pytest.raises(RuntimeError, match="two routing entries"):
        ops.dispatch(x, torch.tensor([[0], [0], [1], [2]]), 4)
    with pytest.raises(ValueError, match="impl must be one of"):
        ops.dispatch(x, torch.tensor([[0], [1], [2], [3]]), 4, impl="fast")
