"""The fused LM head + cross-entropy against the unfused head and F.cross_entropy: loss and both
gradients, over ragged chunks, ignored positions, 16-bit operands, autocast and a scaled loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.ops.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy


def reference(hidden, weight, targets):
    return F.cross_entropy((hidden @ weight.t()).float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX)


def inputs(B, T, D, V, dtype=torch.float32, device="cpu", ignored=0.2, seed=None):
    generator = torch.Generator().manual_seed(torch.randint(1 << 30, ()).item() if seed is None else seed)
    hidden = torch.randn(B, T, D, generator=generator).to(device, dtype)
    weight = (torch.randn(V, D, generator=generator) / D ** 0.5).to(device, dtype)
    targets = torch.randint(V, (B, T), generator=generator)
    targets[torch.rand(B, T, generator=generator) < ignored] = IGNORE_INDEX
    return hidden.requires_grad_(), weight.requires_grad_(), targets.to(device)


def both(hidden, weight, targets, grad_scale=1.0, **kwargs):
    results = []
    for fn in (lambda h, w, t: linear_cross_entropy(h, w, t, **kwargs), reference):
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        loss = fn(h, w, targets)
        (loss * grad_scale).backward()
        results.append((loss.detach(), h.grad, w.grad))
    return results


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, None])
def test_loss_and_gradients_equal_the_unfused_head_in_fp32(chunk_tokens):
    (loss, grad_h, grad_w), (ref_loss, ref_h, ref_w) = both(*inputs(3, 21, 16, 50), chunk_tokens=chunk_tokens)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_h, ref_h, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad_w, ref_w, rtol=1e-5, atol=1e-7)


def test_ignored_positions_get_no_gradient_and_do_not_count():
    hidden, weight, targets = inputs(2, 9, 8, 30, ignored=0.5)
    (loss, grad_h, _), _ = both(hidden, weight, targets, chunk_tokens=4)
    ignored = targets == IGNORE_INDEX
    assert bool(ignored.any()) and bool((~ignored).any())
    assert bool(grad_h[ignored].eq(0).all()) and bool(grad_h[~ignored].ne(0).any(dim=-1).all())
    kept = reference(hidden[~ignored][None], weight, targets[~ignored][None])  # the mean over kept ones only
    torch.testing.assert_close(loss, kept.detach(), rtol=1e-5, atol=1e-6)


def test_all_ignored_gives_the_reference_nan_and_zero_gradients():
    hidden, weight, targets = inputs(1, 5, 4, 11)
    targets[:] = IGNORE_INDEX
    (loss, grad_h, grad_w), (ref_loss, ref_h, ref_w) = both(hidden, weight, targets)
    assert loss.isnan() and ref_loss.isnan()
    assert bool(grad_h.eq(0).all()) and bool(grad_w.eq(0).all())


def test_a_scaled_loss_scales_both_gradients():
    (_, grad_h, grad_w), (_, ref_h, ref_w) = both(*inputs(2, 10, 8, 40), grad_scale=0.37, chunk_tokens=6)
    torch.testing.assert_close(grad_h, ref_h, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad_w, ref_w, rtol=1e-5, atol=1e-7)


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_bf16_operands_are_as_close_to_exact_as_the_unfused_head():
    hidden, weight, targets = inputs(2, 33, 32, 96, dtype=torch.bfloat16)
    (loss, grad_h, grad_w), (ref_loss, ref_h, ref_w) = both(hidden, weight, targets, chunk_tokens=10)
    assert grad_h.dtype == grad_w.dtype == torch.bfloat16
    # Exact: the same bf16 inputs in fp64.
    _, exact_h, exact_w = both(hidden.double(), weight.double(), targets)[1]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-3)
    for fused, unfused, exact in ((grad_h, ref_h, exact_h), (grad_w, ref_w, exact_w)):
        # Rounding to bf16 alone costs about 2**-9; the fused sum of chunks may add a little to it.
        assert relative_error(fused, exact) <= max(2 * relative_error(unfused, exact), 4e-3)


def test_under_autocast_an_fp32_weight_gets_an_fp32_gradient():
    hidden, weight, targets = inputs(2, 12, 16, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, targets, chunk_tokens=5)
        ref_hidden, ref_weight = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        ref = F.cross_entropy(F.linear(ref_hidden, ref_weight).float().flatten(0, 1), targets.flatten())
    loss.backward()
    ref.backward()
    assert weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-3, atol=1e-3)
    # Both round the operands and the logits' gradient to bf16, at different points: elementwise they
    # may differ by a bf16 step of a small value, so each is held to the exact head (the operands
    # rounded to bf16, then fp64), as close as the unfused head under autocast is.
    _, exact_h, exact_w = both(hidden.detach().bfloat16().double(), weight.detach().bfloat16().double(), targets)[1]
    for fused, unfused, exact in ((hidden.grad, ref_hidden.grad, exact_h), (weight.grad, ref_weight.grad, exact_w)):
        assert relative_error(fused, exact) <= max(2 * relative_error(unfused, exact), 4e-3)


def test_mismatched_shapes_and_dtypes_are_refused():
    hidden, weight, targets = inputs(2, 4, 8, 10)
    with pytest.raises(ValueError, match="targets must have"):
        linear_cross_entropy(hidden, weight, targets[:, :3])
    with pytest.raises(ValueError, match="last dimension"):
        linear_cross_entropy(hidden[..., :4], weight, targets)
    with pytest.raises(ValueError, match="one dtype"):
        linear_cross_entropy(hidden, weight.detach().bfloat16(), targets)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_the_gpu_it_matches_the_unfused_head(dtype):
    (loss, grad_h, grad_w), (ref_loss, ref_h, ref_w) = both(*inputs(4, 300, 128, 1000, dtype=dtype, device="cuda"),
                                                            chunk_tokens=256)
    tolerance = dict(rtol=2e-2, atol=1e-4) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(grad_h, ref_h, **tolerance)
    torch.testing.assert_close(grad_w, ref_w, **tolerance)
