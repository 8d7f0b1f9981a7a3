"""moetrain.ops.router_logits: the CUDA kernels (fp32 router on 16-bit activations, no fp32 copy
of x) against the fp32 reference, forward and both gradients; skipped without a GPU except the
check that other inputs take the reference path."""

import pytest
import torch

from moetrain import MoELayer, ops
from moetrain.ops import reference

cuda = pytest.mark.cuda  # skipped without a GPU (tests/conftest.py)


def kernel_logits(x, w):
    """The op itself (router_logits sends more than 16 experts to torch; the op takes up to 64).
    Loads the extension first: run alone, no other test has registered the op yet."""
    ops.load()
    return ops._RouterLogits.apply(x, w)


def test_router_logits_off_the_kernel_path_is_the_reference():
    x = torch.randn(9, 16, dtype=torch.bfloat16)
    w = torch.randn(4, 16)
    assert torch.equal(ops.router_logits(x, w), x.float() @ w.t())
    x64 = torch.randn(9, 16, dtype=torch.float64)
    assert ops.router_logits(x64, w).dtype == torch.float64


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("tokens,dim,experts", [(1000, 2048, 8), (37, 264, 16), (300, 1024, 23), (513, 512, 64),
                                                (5, 8, 1)])
def test_router_logits_kernel_matches_fp32_reference(dtype, tokens, dim, experts):
    torch.manual_seed(tokens)
    x = torch.randn(tokens, dim, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(experts, dim, device="cuda") * dim**-0.5).requires_grad_()
    got = kernel_logits(x, w)
    want = reference.router_logits(x, w)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(want)
    got_x, got_w = torch.autograd.grad(got, [x, w], grad)
    want_x, want_w = torch.autograd.grad(want, [x, w], grad)
    assert got_x.dtype == dtype
    # grad_x is rounded to x's dtype once (the reference rounds the same fp32 sum).
    torch.testing.assert_close(got_x, want_x, rtol=1e-2 if dtype == torch.bfloat16 else 2e-3, atol=1e-3)
    torch.testing.assert_close(got_w, want_w, rtol=1e-4, atol=1e-4)


@cuda
def test_router_logits_kernel_only_w_grad_and_misaligned_input():
    x_big = torch.randn(65, 128, device="cuda", dtype=torch.bfloat16)
    x = x_big.view(-1)[8 : 8 + 64 * 128].view(64, 128)  # a 16-byte-aligned view: still the kernel path
    x_odd = x_big.view(-1)[3 : 3 + 64 * 128].view(64, 128)  # misaligned: copied first
    w_big = torch.randn(9, 128, device="cuda")
    # The kernels read w as 16-byte vectors too: a weight 4 bytes off that is copied first.
    w_odd = w_big.view(-1)[1 : 1 + 8 * 128].view(8, 128)
    for xi in (x, x_odd):
        for w_in in (torch.randn(8, 128, device="cuda"), w_odd):
            w = w_in.detach().requires_grad_()
            got = kernel_logits(xi, w)
            torch.testing.assert_close(got, xi.float() @ w.t(), rtol=1e-5, atol=1e-5)
            (gw,) = torch.autograd.grad(got.sum(), [w])
            torch.testing.assert_close(gw, xi.float().sum(0).expand(8, -1), rtol=1e-4, atol=1e-4)


@cuda
@pytest.mark.parametrize("gate", ["top", "sigmoid"])
def test_layer_with_router_kernel_matches_torch_layer(gate):
    torch.manual_seed(0)
    kernel = MoELayer(256, 8, 128, top_k=2, gate=gate, capacity_factor=1.0, impl="kernel").cuda().bfloat16()
    plain = MoELayer(256, 8, 128, top_k=2, gate=gate, capacity_factor=1.0, impl="torch").cuda().bfloat16()
    kernel.gate.float()
    plain.gate.float()
    plain.load_state_dict(kernel.state_dict())
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y_kernel, y_plain = kernel(x), plain(x)
    # The logits agree to ~1e-6, so routing (and hence the output) agrees barring a near-tie.
    torch.testing.assert_close(y_kernel, y_plain, rtol=1e-2, atol=1e-2)
    grad = torch.randn_like(y_plain)
    got = torch.autograd.grad(y_kernel, [x, kernel.gate.weight_ED], grad)
    want = torch.autograd.grad(y_plain, [x, plain.gate.weight_ED], grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
