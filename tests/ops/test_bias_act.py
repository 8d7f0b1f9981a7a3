"""moetrain.ops.bias_act (the padded layout's fused expert epilogue) against the pure-torch
reference: bit-identical forward, matching gradients, on the CPU kernel and (with a GPU) the CUDA one.
Row lengths cover the 16-byte vector path and the scalar path; a NaN input stays NaN through ReLU."""

import pytest
import torch

from moetrain import MoELayer, ops
from moetrain.ops import reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
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


# ---------------------------------------------------------------------------------------------
# bias_act_backward: the op the backward of bias_act runs, against reference.bias_act_backward.
# grad_in must be bit-identical to threshold_backward; grad_bias equal within the difference two
# fp32 sums in different orders can have, plus one rounding to the gradient's dtype.

BWD_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BWD_DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    return t.view(INT_VIEW[t.element_size()])


def _backward_inputs(shape, dtype, device, relu):
    """Fresh random grad and, for ReLU, a forward output with many exact zeros and negatives, -0.0,
    positive subnormals (grad must pass) and NaN (grad must pass, as threshold_backward lets it);
    grad is NaN at a few places where out <= 0 (grad_in must be 0 there, not NaN * 0)."""
    grad = torch.randn(shape, device=device, dtype=dtype)
    if not relu:
        return grad, None
    out = torch.randn(shape, device=device, dtype=dtype)
    pick = torch.rand(shape, device=device)
    out[pick < 0.3] = 0.0
    out[pick > 0.97] = -0.0
    subnormal = torch.finfo(dtype).tiny / 4
    out[(pick > 0.94) & (pick <= 0.97)] = subnormal
    out[(pick > 0.92) & (pick <= 0.94)] = float("nan")
    grad[(pick < 0.05) | (pick > 0.99)] = float("nan")  # only where out is 0 or -0.0
    return grad, out


def _check_backward(grad, out, rows_per_expert, bias_grad):
    ops.load()
    got_in, got_b = torch.ops.moetrain.bias_act_backward(grad, out, rows_per_expert, bias_grad)
    want_in, want_b = reference.bias_act_backward(grad, out, rows_per_expert, bias_grad)
    if out is None:
        assert got_in is grad  # identity: the gradient itself, no copy
    assert got_in.shape == grad.shape and got_in.dtype == grad.dtype
    assert torch.equal(_bits(got_in.contiguous()), _bits(want_in.contiguous()))
    if not bias_grad:
        assert got_b.numel() == 0
        return got_in, got_b
    dim = grad.size(-1)
    assert got_b.dtype == grad.dtype and got_b.shape == want_b.shape == (grad[..., 0].numel() // rows_per_expert, dim)
    acc = reference.opmath_dtype(grad.dtype)
    abs_sum = want_in.to(acc).abs().reshape(-1, rows_per_expert, dim).sum(1)
    tol = (2 * torch.finfo(grad.dtype).eps * want_b.to(acc).abs() + rows_per_expert * torch.finfo(acc).eps * abs_sum
           + torch.finfo(grad.dtype).tiny)
    assert torch.isfinite(want_b).all()
    assert ((got_b.to(acc) - want_b.to(acc)).abs() <= tol).all()
    return got_in, got_b


# (experts, rows_per_expert, O): the vector path, O not a multiple of 8, E=1 with many rows, C=1, O=1.
BWD_SHAPES = [(5, 7, 64), (3, 9, 37), (1, 1000, 24), (40, 1, 72), (4, 6, 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", BWD_DTYPES, ids=BWD_DTYPE_IDS.get)
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("relu", [True, False], ids=["relu", "identity"])
@pytest.mark.parametrize("bias_grad", [True, False], ids=["bias_grad", "no_bias_grad"])
def test_bias_act_backward_matches_reference(device, dtype, shape, relu, bias_grad):
    experts, capacity, dim = shape
    grad, out = _backward_inputs((experts * capacity, dim), dtype, device, relu)
    _check_backward(grad, out, capacity, bias_grad)


# GPU sizes: one chunk and many chunks per expert, short rows (few vectors), mixtral-like long rows,
# 64 fine-grained experts, rows per expert that no chunk size divides.
CUDA_BWD_SHAPES = [(8, 2048, 512), (1, 8192, 64), (3, 5000, 40), (2, 333, 14336), (64, 96, 1408), (16, 40, 2048)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", BWD_DTYPES, ids=BWD_DTYPE_IDS.get)
@pytest.mark.parametrize("shape", CUDA_BWD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("relu", [True, False], ids=["relu", "identity"])
def test_bias_act_backward_cuda_large(dtype, shape, relu):
    experts, capacity, dim = shape
    grad, out = _backward_inputs((experts * capacity, dim), dtype, "cuda", relu)
    got_in, got_b = _check_backward(grad, out, capacity, True)
    # No atomics: a second call gives the same bits.
    again_in, again_b = torch.ops.moetrain.bias_act_backward(grad, out, capacity, True)
    assert torch.equal(_bits(again_b), _bits(got_b)) and torch.equal(_bits(again_in), _bits(got_in))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=BWD_DTYPE_IDS.get)
@pytest.mark.parametrize("misaligned", ["grad", "out"])
def test_bias_act_backward_misaligned_storage(device, dtype, misaligned):
    """A view one element into its storage cannot take 16-byte vectors: the scalar path runs."""
    experts, capacity, dim = 3, 50, 64

    def shifted(t):
        view = torch.empty(t.numel() + 1, device=device, dtype=dtype)[1:].view_as(t)
        return view.copy_(t)

    grad, out = _backward_inputs((experts * capacity, dim), dtype, device, relu=True)
    if misaligned == "grad":
        _check_backward(shifted(grad), out, capacity, True)
        _check_backward(shifted(torch.randn_like(grad)), None, capacity, True)
    else:
        _check_backward(grad, shifted(out), capacity, True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("relu", [True, False], ids=["relu", "identity"])
def test_bias_act_backward_block_layout_and_broadcast_grad(device, relu):
    """grad as the 3-d block [E, C, O], and a stride-0 grad as autograd gives for y.sum()."""
    experts, capacity, dim = 4, 6, 40
    grad, out = _backward_inputs((experts, capacity, dim), torch.float32, device, relu)
    _check_backward(grad, out, capacity, True)
    expanded = torch.randn(1, dim, device=device).expand(experts * capacity, dim)
    _check_backward(expanded, None if out is None else out.view(-1, dim), capacity, True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sizes", [(0, 16), (6, 0)], ids=["no_rows", "no_columns"])
def test_bias_act_backward_empty(device, sizes):
    ops.load()
    grad = torch.randn(sizes, device=device)
    got_in, got_b = torch.ops.moetrain.bias_act_backward(grad, torch.randn(sizes, device=device), 3, True)
    assert got_in.shape == grad.shape and got_b.shape == (sizes[0] // 3, sizes[1])


@pytest.mark.parametrize("device", DEVICES)
def test_bias_act_backward_rejects_bad_arguments(device):
    ops.load()
    op = torch.ops.moetrain.bias_act_backward
    grad = torch.randn(12, 8, device=device)
    with pytest.raises(RuntimeError, match="rows_per_expert=5"):
        op(grad, None, 5, True)
    with pytest.raises(RuntimeError, match="rows_per_expert must be positive, got 0"):
        op(grad, None, 0, True)
    with pytest.raises(RuntimeError, match=r"out must have grad's shape \[12, 8\]"):
        op(grad, torch.randn(12, 4, device=device), 4, True)
    with pytest.raises(RuntimeError, match="out must have grad's dtype"):
        op(grad, torch.randn(12, 8, device=device, dtype=torch.float64), 4, True)
    with pytest.raises(RuntimeError, match="grad must be float32, float64, float16 or bfloat16, got Int"):
        op(grad.int(), None, 4, True)
