"""Expert GEMM backends (moetrain/ops/grouped.py) against a per-expert loop written out here.

Runs on the CPU (bmm, loop, and torch._grouped_mm where this torch has a CPU kernel) and, with a
GPU, on CUDA in bf16 (torch._grouped_mm on sm90+, moetrain's Triton grouped GEMMs) and fp32.
"""

import logging

import pytest
import torch
from conftest import assert_no_host_sync

from moetrain.ops import grouped

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def reference_matmul(x_RI, w_EIO, counts, capacity):
    """Float64 per-expert products; rows outside every expert's block are zero."""
    out = torch.zeros(x_RI.size(0), w_EIO.size(2), dtype=torch.float64, device=x_RI.device)
    start = 0
    for e, count in enumerate(counts):
        if capacity is not None:
            start = e * capacity
        out[start:start + count] = x_RI[start:start + count].double() @ w_EIO[e].double()
        start += count
    return out


def layout(counts, capacity, in_dim, dtype, device):
    """A buffer as dispatch leaves it: real rows random, padding rows zero."""
    rows = len(counts) * capacity if capacity is not None else sum(counts) + 5
    x = torch.zeros(rows, in_dim, dtype=dtype, device=device)
    start = 0
    for e, count in enumerate(counts):
        if capacity is not None:
            start = e * capacity
        x[start:start + count] = torch.randn(count, in_dim, dtype=dtype, device=device)
        start += count
    return x


def cases(device):
    yield "bmm", 6, torch.float32
    yield "loop", None, torch.float32
    yield "loop", 6, torch.float32
    yield "auto", None, torch.float32
    if device == "cuda":
        yield "grouped_mm", None, torch.bfloat16
        yield "grouped_mm", 6, torch.bfloat16
        yield "auto", None, torch.bfloat16
        yield "bmm", 6, torch.bfloat16
        yield "triton", None, torch.bfloat16
        yield "triton", 6, torch.bfloat16
        yield "triton", None, torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_expert_matmul_matches_per_expert_loop(device):
    counts = [3, 0, 6, 1, 0]  # empty experts and a full one
    for backend, capacity, dtype in cases(device):
        x = layout(counts, capacity, 16, dtype, device).requires_grad_()
        w = torch.randn(len(counts), 16, 24, dtype=dtype, device=device, requires_grad=True)
        counts_E = torch.tensor(counts, device=device)
        y = grouped.expert_matmul(x, w, counts_E, capacity, backend=backend)
        want = reference_matmul(x, w, counts, capacity)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        used = want.abs().sum(1) > 0
        assert torch.allclose(y[used].double(), want[used], rtol=tol, atol=tol), (backend, capacity)
        assert y.shape == want.shape and torch.isfinite(y).all(), (backend, capacity)

        grad = torch.randn_like(y)
        grad[~used] = 0  # outputs of padding rows are never read, so they get no gradient
        y.backward(grad)
        x_ref = x.detach().double().requires_grad_()
        w_ref = w.detach().double().requires_grad_()
        reference_matmul(x_ref, w_ref, counts, capacity).backward(grad.double())
        assert torch.allclose(x.grad.double(), x_ref.grad, rtol=tol, atol=tol), (backend, capacity)
        assert torch.allclose(w.grad.double(), w_ref.grad, rtol=tol, atol=tol * 4), (backend, capacity)


def test_bad_backend_and_bmm_without_capacity_are_refused():
    x, w = torch.randn(4, 8), torch.randn(2, 8, 8)
    with pytest.raises(ValueError, match="backend must be one of"):
        grouped.expert_matmul(x, w, torch.tensor([2, 2]), None, backend="cutlass")
    with pytest.raises(ValueError, match="needs the padded layout"):
        grouped.expert_matmul(x, w, torch.tensor([2, 2]), None, backend="bmm")
    with pytest.raises(ValueError, match="backend must be one of"):
        grouped.set_default_backend("fast")
    with pytest.raises(ValueError, match="backend 'triton' runs on CUDA tensors, got cpu"):
        grouped.expert_matmul(x, w, torch.tensor([2, 2]), None, backend="triton")


def test_default_backend_override_and_logged_choice(caplog):
    x, w = torch.randn(6, 8), torch.randn(2, 8, 4)
    counts = torch.tensor([2, 4])
    want = torch.cat([x[:2] @ w[0], x[2:] @ w[1]])
    grouped._logged.clear()
    with caplog.at_level(logging.INFO, logger="moetrain"):
        assert torch.allclose(grouped.expert_matmul(x, w, counts, None), want, atol=1e-6)
    assert "expert GEMMs use loop" in caplog.text
    try:
        grouped.set_default_backend("loop")
        assert torch.allclose(grouped.expert_matmul(x, w, counts, 3), torch.cat([x[:3] @ w[0], x[3:] @ w[1]]), atol=1e-6)
    finally:
        grouped.set_default_backend("auto")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capacity", [None, 4])
def test_expert_bias_value_and_gradient(device, dtype, capacity):
    counts = torch.tensor([3, 0, 4], device=device)
    rows = 3 * 4 if capacity else 9  # packed: 7 real rows and 2 padding rows
    expert_of_row = torch.arange(rows) // 4 if capacity else torch.tensor([0, 0, 0, 2, 2, 2, 2, -1, -1])
    real = torch.tensor([r % 4 < [3, 0, 4][r // 4] for r in range(rows)]) if capacity else expert_of_row >= 0
    y = torch.randn(rows, 5, device=device, dtype=dtype)
    b = torch.randn(3, 5, device=device, dtype=dtype)
    grad = torch.randn(rows, 5, device=device, dtype=dtype) * real.to(device).unsqueeze(1)  # padding rows unread
    want_b_grad = torch.zeros(3, 5, dtype=torch.float64)
    want_b_grad.index_add_(0, expert_of_row[real], grad[real.to(device)].double().cpu())
    for fn in (lambda y, b: y + grouped.expert_bias(b, counts, capacity, rows),
               lambda y, b: grouped.add_expert_bias(y, b, counts, capacity)):
        b_in = b.clone().requires_grad_()
        out = fn(y, b_in)
        assert out.dtype == dtype and out.shape == y.shape
        want = y[real.to(device)].double() + b.double()[expert_of_row[real].to(device)]
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
        assert torch.allclose(out[real.to(device)].double(), want, rtol=tol, atol=tol)
        out.backward(grad)
        assert torch.allclose(b_in.grad.double().cpu(), want_b_grad, rtol=3 * tol, atol=3 * tol)


@pytest.mark.parametrize("device", DEVICES)
def test_group_ends_are_cumulative_counts_with_the_padding_in_the_last_group(device):
    counts = torch.randint(0, 9, (7,), generator=torch.Generator().manual_seed(3))
    rows = int(counts.sum()) + 5
    ends = grouped.group_ends(counts.to(device), rows, torch.device(device))
    want = counts.cumsum(0)
    want[-1] = rows
    assert ends.dtype == torch.int32 and ends.device.type == device
    assert torch.equal(ends.cpu(), want.to(torch.int32))


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8_block"])
def test_a_dropless_layer_step_never_waits_for_the_gpu(precision):
    """A wait inside the step keeps the host from queueing ahead (a setitem of a Python number on a
    CUDA tensor once cost two waits a step): torch's sync debug mode turns any wait into an error."""
    from moetrain import MoELayer  # noqa: PLC0415
    from moetrain.precision.fp8_matmul import fp8_supported  # noqa: PLC0415

    if precision != "bf16" and not fp8_supported(torch.device("cuda"), precision)[0]:
        pytest.skip(f"precision={precision!r} does not run on this GPU")
    torch.manual_seed(0)
    layer = MoELayer(256, 8, 128, top_k=2, expert="swiglu", activation="silu", capacity_factor=0.0,
                     precision=precision).cuda().bfloat16()
    layer.gate.float()
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        torch.autograd.grad(layer(x).float().sum(), [x] + list(layer.parameters()))

    assert_no_host_sync(step)
