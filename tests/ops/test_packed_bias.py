"""moetrain.ops.packed_bias (the packed layout's expert bias + ReLU, a Triton kernel on CUDA)
against torch's ops on the same rows, forward and backward; and the row -> expert map it reads."""

import pytest
import torch

from moetrain import MoELayer
from moetrain.ops import packed_bias
from moetrain.ops.grouped import expert_of_rows

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 7], [4], [0, 2, 0]])
def test_expert_of_rows_matches_a_loop(counts):
    counts_E = torch.tensor(counts)
    rows = sum(counts) + 3  # padding rows go to the last expert
    want = [e for e, c in enumerate(counts) for _ in range(c)] + [len(counts) - 1] * 3
    got = expert_of_rows(counts_E, rows)
    assert got.dtype == torch.int32 and got.tolist() == want


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("rows,cols,experts", [(0, 64, 3), (1, 1, 1), (37, 300, 5), (4100, 1024, 64)])
@pytest.mark.parametrize("relu", [True, False])
def test_packed_bias_act_matches_torch(dtype, rows, cols, experts, relu):
    counts = torch.multinomial(torch.ones(experts), rows, replacement=True).bincount(minlength=experts) if rows else torch.zeros(experts, dtype=torch.long)
    counts_E = counts.cuda()
    expert_R = expert_of_rows(counts_E, rows)
    y = torch.randn(rows, cols, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(experts, cols, device="cuda", dtype=dtype, requires_grad=True)
    assert packed_bias.kernel_runs(y, b)
    got = packed_bias.packed_bias_act(y, b, expert_R, relu)
    z = y.double() + b.double()[expert_R.long()]
    want = z.clamp_min(0) if relu else z
    assert torch.equal(got, want.to(dtype))  # one rounding of the exact sum: bit-identical
    grad = torch.randn(rows, cols, device="cuda", dtype=dtype)
    grad_y, grad_b = torch.autograd.grad(got, [y, b], grad)
    mask = (z > 0) if relu else torch.ones_like(z, dtype=torch.bool)
    assert torch.equal(grad_y, torch.where(mask, grad, 0))
    want_b = torch.zeros(experts, cols, dtype=torch.float64, device="cuda").index_add_(
        0, expert_R.long(), torch.where(mask, grad, 0).double())
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert (grad_b.double() - want_b).abs().max() <= tol * max(1.0, want_b.abs().max().item())


@pytest.mark.cuda
@cuda
def test_dropless_ffn_layer_on_cuda_matches_torch_path():
    torch.manual_seed(torch.seed() % 2**31)
    layer = MoELayer(64, 6, 96, top_k=2, capacity_factor=0.0, expert="ffn").cuda()
    with torch.no_grad():
        layer.experts.b1.normal_()
        layer.experts.b2.normal_()
    twin = MoELayer(64, 6, 96, top_k=2, capacity_factor=0.0, expert="ffn", impl="torch").cuda()
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(333, 64, device="cuda")
    y, y_twin = layer(x), twin(x)
    assert torch.allclose(y, y_twin, atol=1e-4, rtol=1e-4)
    grads = torch.autograd.grad(y.square().sum(), [layer.experts.b1, layer.experts.w1])
    grads_twin = torch.autograd.grad(y_twin.square().sum(), [twin.experts.b1, twin.experts.w1])
    for g, g_twin in zip(grads, grads_twin):
        assert torch.allclose(g, g_twin, atol=1e-3, rtol=1e-3)
