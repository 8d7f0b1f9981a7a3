"""Each built-in gate against its paper's definition (tests/reference_gates.py), on fresh random
inputs in fp32 and fp64: logits, balance-loss distribution, choices and combine weights."""

import math

import pytest
import torch

import reference_gates as ref
from moetrain.moe import CosineGate, SigmoidGate, TopKGate

DTYPES = [torch.float32, torch.float64]


def assert_routes_like(out, want, dtype):
    probs, idx, weight, logits = want
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(out.logits_TE.double(), logits, **tol)
    torch.testing.assert_close(out.probs_TE.double(), probs, **tol)
    assert torch.equal(out.topk_idx_TK, idx)
    torch.testing.assert_close(out.topk_weight_TK.double(), weight, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_top_gate_is_switch_and_gshard_softmax_top_k(top_k, normalize, dtype):
    torch.manual_seed(top_k)
    gate = TopKGate(12, 7, normalize=normalize).to(dtype)
    x = torch.randn(33, 12, dtype=dtype)
    out = gate(x, top_k)
    assert_routes_like(out, ref.switch_top_k(x, gate.weight_ED.detach(), top_k, normalize), dtype)
    sums = out.topk_weight_TK.sum(-1)
    if normalize:  # renormalised weights sum to one; Switch's raw probabilities do not
        torch.testing.assert_close(sums, torch.ones_like(sums))
    elif top_k < 7:
        assert (sums < 1 - 1e-3).any()


def test_switch_jitter_only_in_training():
    """Switch's jitter multiplies the router input by U(1 - eps, 1 + eps) noise in training; in
    eval mode the gate is deterministic and equals the noiseless reference."""
    torch.manual_seed(0)
    eps = 0.2
    gate = TopKGate(16, 8, jitter_eps=eps)
    x = torch.randn(64, 16)
    want = ref.switch_top_k(x, gate.weight_ED.detach(), 2)
    gate.eval()
    first, second = gate(x, 2), gate(x, 2)
    assert_routes_like(first, want, torch.float32)
    assert torch.equal(first.topk_weight_TK, second.topk_weight_TK)
    gate.train()
    noisy = gate(x, 2)
    moved = (noisy.logits_TE.double() - want[3]).abs()
    # |sum_d x_d (u_d - 1) w_ed| <= eps * sum_d |x_d w_ed|: noise of the documented size, on the input.
    bound = eps * (x.double().abs() @ gate.weight_ED.detach().double().abs().t())
    assert (moved <= bound + 1e-5).all()
    assert moved.max() > 0.05 * bound.max()  # and there is noise
    assert not torch.equal(noisy.topk_idx_TK, gate(x, 2).topk_idx_TK)  # fresh noise each call
    gate.jitter_eps = 0.0
    assert_routes_like(gate(x, 2), want, torch.float32)  # no jitter configured: none in training either


def skewed_sigmoid_gate(num_experts, dtype, **kwargs):
    gate = SigmoidGate(10, num_experts, **kwargs).to(dtype)
    with torch.no_grad():  # a bias large enough to change choices (DeepSeek-V3's bias is per expert)
        gate.expert_bias.copy_(torch.linspace(-0.3, 0.3, num_experts, dtype=dtype)[torch.randperm(num_experts)])
    return gate


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "settings",
    [
        {"top_k": 2},  # Kimi-K2-like: one group
        {"top_k": 3, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},  # DeepSeek-V3-like
        {"top_k": 2, "n_group": 4, "topk_group": 1, "routed_scaling_factor": 1.8, "normalize": False},
        {"top_k": 4, "n_group": 2, "topk_group": 2, "routed_scaling_factor": 0.5},
    ],
)
def test_sigmoid_gate_is_deepseek_v3_routing(settings, dtype):
    torch.manual_seed(len(settings))
    settings = dict(settings)
    top_k = settings.pop("top_k")
    gate = skewed_sigmoid_gate(16, dtype, **settings)
    x = torch.randn(41, 10, dtype=dtype)
    out = gate(x, top_k)
    want = ref.sigmoid_top_k(x, gate.weight_ED.detach(), gate.expert_bias, top_k, **settings)
    assert_routes_like(out, want, dtype)
    # The bias chose (the unbiased ranking differs somewhere) but does not weigh.
    unbiased = ref.sigmoid_top_k(x, gate.weight_ED.detach(), torch.zeros(16), top_k, **settings)
    assert not torch.equal(unbiased[1], want[1])
    scores = torch.sigmoid(x.double() @ gate.weight_ED.detach().double().t()).gather(1, out.topk_idx_TK)
    if settings.get("normalize", True):
        scores = scores / scores.sum(-1, keepdim=True)
    torch.testing.assert_close(out.topk_weight_TK.double(), scores * settings.get("routed_scaling_factor", 1.0),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalize", [False, True])
def test_cosine_gate_is_x_moe(normalize, dtype):
    torch.manual_seed(3)
    gate = CosineGate(12, 6, proj_dim=5, init_temperature=0.3, normalize=normalize).to(dtype)
    with torch.no_grad():  # directions of very different lengths: only their angle may count
        gate.expert_dirs_EP.mul_(torch.logspace(-1, 1, 6, dtype=dtype).unsqueeze(1))
        gate.proj.bias.normal_()
    x = torch.randn(37, 12, dtype=dtype) * torch.logspace(-1, 1, 37, dtype=dtype).unsqueeze(1)
    params = (gate.proj.weight.detach(), gate.proj.bias.detach(), gate.expert_dirs_EP.detach(), gate.log_scale.item())
    assert_routes_like(gate(x, 2), ref.cosine_top_k(x, *params, 2, normalize), dtype)
    # Bounded logits: |cos| <= 1, times 1 / temperature.
    assert gate(x, 2).logits_TE.abs().max() <= 1 / 0.3 + 1e-5


def test_cosine_gate_temperature_is_learnt_and_capped():
    torch.manual_seed(4)
    gate = CosineGate(8, 4, proj_dim=6, init_temperature=0.5)
    x = torch.randn(20, 8)
    for log_scale in (math.log(3.0), math.log(1000.0)):  # scale 3, and one past the cap of 100
        with torch.no_grad():
            gate.log_scale.fill_(log_scale)
        params = (gate.proj.weight.detach(), gate.proj.bias.detach(), gate.expert_dirs_EP.detach(), log_scale)
        assert_routes_like(gate(x, 2), ref.cosine_top_k(x, *params, 2), torch.float32)
    out = gate(x, 1)
    out.topk_weight_TK.sum().backward()
    assert gate.log_scale.grad == 0  # past the cap the scale is a constant
