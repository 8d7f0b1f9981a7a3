"""moetrain.ops.bias_act (the padded layout's fused expert epilogue) against the pure-torch
reference: bit-identical forward, matching gradients, on the CPU kernel and (with a GPU) the CUDA one.
Row lengths cover the 16-byte vector path and the scalar path; a NaN input stays NaN through ReLU."""

import pytest
import torch

from moetrain import MoELayer, ops
from moetrain.ops import reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
GRAD_TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("dim", [64, 37])
@pytest.mark.parametrize("relu", [True, False])
def test_bias_act_matches_reference(device, dtype, dim, relu):
    experts, capacity = 5, 7
    y = torch.randn(experts * capacity, dim, device=device, dtype=dtype)
    y[3, 1] = float("nan")
    b = torch.randn(experts, dim, device=device, dtype=dtype, requires_grad=True)
    want = reference.bias_act(y, b, capacity, relu)
    y_in = y.clone().requires_grad_()
    got = ops.bias_act(y_in * 1, b, capacity, relu)  # * 1: a non-leaf the op may overwrite
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    grad = torch.randn_like(want)
    grad_want = torch.autograd.grad(want, [b], grad)[0]
    keep = ~y.isnan()  # the NaN row's gradient is NaN in both; compare the rest
    grad_y_got, grad_b_got = torch.autograd.grad(got, [y_in, b], grad)
    y_leaf = y.clone().requires_grad_()
    grad_y_want = torch.autograd.grad(reference.bias_act(y_leaf, b, capacity, relu), [y_leaf], grad)[0]
    assert torch.equal(grad_y_got[keep], grad_y_want[keep])
    scale = grad_want.nan_to_num().abs().max()
    assert ((grad_b_got - grad_want).nan_to_num().abs().max() <= GRAD_TOL[dtype] * scale)


@pytest.mark.parametrize("device", DEVICES)
def test_bias_act_takes_the_3d_block_layout_and_checks_shapes(device):
    y = torch.randn(3, 4, 16, device=device)
    b = torch.randn(3, 16, device=device)
    assert torch.equal(ops.bias_act(y.clone(), b, 4, True), reference.bias_act(y, b, 4, True))
    with pytest.raises(ValueError, match="rows_per_expert"):
        ops.bias_act(y.clone(), b, 5, True)
    with pytest.raises(ValueError, match="bias must be"):
        ops.bias_act(y.clone(), b[:, :8], 4, True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_ffn_experts_fused_epilogue_equals_the_torch_path(device, activation):
    """The MoE layer (padded layout) with the fused epilogue gives the pure-torch layer's output,
    and its gradients, on random biases."""
    torch.manual_seed(0)
    kernel = MoELayer(32, 4, 48, top_k=2, capacity_factor=1.0, activation=activation, impl="kernel").to(device)
    plain = MoELayer(32, 4, 48, top_k=2, capacity_factor=1.0, activation=activation, impl="torch").to(device)
    with torch.no_grad():
        kernel.experts.b1.normal_()
        kernel.experts.b2.normal_()
    plain.load_state_dict(kernel.state_dict())
    x = torch.randn(50, 32, device=device, requires_grad=True)
    y_kernel, y_plain = kernel(x), plain(x)
    # The epilogue is bit-exact (tested above); the layers' combine sums round differently on a GPU.
    torch.testing.assert_close(y_kernel, y_plain, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(y_plain)
    got = torch.autograd.grad(y_kernel, [x, *kernel.parameters()], grad)
    want = torch.autograd.grad(y_plain, [x, *plain.parameters()], grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
