"""MoELayer (kernel and torch paths) against a naive loop over tokens and experts.

The naive loop routes with tests/reference_gates.py (the papers' definitions, reading only the
gate's parameters), never with the gate under test; expert biases are non-zero and the inputs
share a common direction, so routing is skewed and tokens really drop under a capacity."""

import math

import pytest
import torch
import torch.nn.functional as F

import reference_gates
from moetrain import MoELayer
from moetrain.moe import SigmoidGate, is_expert_param, moe_layers, update_router_biases

GATES = {
    "top": {},
    "top_normalized": {"gate": "top", "gate_kwargs": {"normalize": True}},
    "cosine": {"gate": "cosine", "gate_kwargs": {"proj_dim": 8}},
    "sigmoid": {"gate": "sigmoid", "gate_kwargs": {"n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5}},
}


def expert_of(layer, e, x_D):
    ex = layer.experts
    if hasattr(ex, "w1"):
        return ex.act(x_D @ ex.w1[e] + ex.b1[e]) @ ex.w2[e] + ex.b2[e]
    return (F.silu(x_D @ ex.w_gate[e]) * (x_D @ ex.w_up[e])) @ ex.w_down[e]


def naive_moe(layer, x, top_k, capacity_factor, batch_prioritized=False):
    """Token by token: the reference gate's choice, who keeps a slot, then the weighted sum of the
    kept experts' outputs."""
    x_TD = x.reshape(-1, layer.model_dim)
    probs, idx_TK, weight, logits = reference_gates.route_like(layer.gate, x_TD, top_k)
    idx = idx_TK.tolist()
    tokens, experts = x_TD.size(0), layer.num_experts
    # Tutel's capacity, k * int(|cf| * ceil(T / E)), and moetrain's floor of k rows (routing.py).
    cap = None if capacity_factor == 0 else top_k * max(int(abs(capacity_factor) * math.ceil(tokens / experts)), 1)
    order = list(range(tokens))
    if batch_prioritized:  # V-MoE / Tutel: the token's raw top router score goes first
        if isinstance(layer.gate, SigmoidGate):
            best = torch.sigmoid(logits).gather(1, idx_TK).max(-1).values.tolist()
        else:
            best = probs.max(-1).values.tolist()
        order.sort(key=lambda t: -best[t])
    used = [0] * experts
    keep = [[False] * top_k for _ in range(tokens)]
    for j in range(top_k):
        for t in order:
            e = idx[t][j]
            if cap is None or used[e] < cap:
                keep[t][j] = True
            used[e] += 1
    rows = []
    for t in range(tokens):
        y_D = torch.zeros(layer.model_dim, dtype=x.dtype)
        for j in range(top_k):
            if keep[t][j]:
                y_D = y_D + weight[t, j].to(x.dtype) * expert_of(layer, idx[t][j], x_TD[t])
        if layer.shared is not None:
            y_D = y_D + layer.shared(x_TD[t : t + 1])[0]
        rows.append(y_D)
    dropped = 1 - sum(map(sum, keep)) / (tokens * top_k)
    return torch.stack(rows).view_as(x), dropped, used


def skewed(*shape, dtype=torch.float64, seed=11):
    """Random tokens sharing one common direction, so the router prefers a few experts."""
    generator = torch.Generator().manual_seed(seed)
    common = 1.5 * torch.randn(shape[-1], generator=generator, dtype=dtype)
    return torch.randn(*shape, generator=generator, dtype=dtype) + common


def make_layer(gate, impl="kernel", **overrides):
    kwargs = dict(model_dim=12, num_experts=6, hidden_size=10, top_k=2, capacity_factor=1.0, impl=impl)
    kwargs.update(GATES[gate])
    kwargs.update(overrides)
    layer = MoELayer(**kwargs)
    with torch.no_grad():  # non-zero expert biases (a bias on the wrong row must show), and a
        for name in ("b1", "b2"):  # selection bias for the sigmoid gate
            if hasattr(layer.experts, name):
                getattr(layer.experts, name).normal_()
        if isinstance(layer.gate, SigmoidGate):
            layer.gate.expert_bias.copy_(0.2 * torch.randn(layer.num_experts))
    return layer


def run_both(gate, x, call_kwargs=None, **overrides):
    """Same weights, kernel and torch paths; returns outputs and gradients of each."""
    results = {}
    for impl in ("kernel", "torch"):
        torch.manual_seed(7)
        layer = make_layer(gate, impl=impl, **overrides).double()
        xi = x.clone().requires_grad_()
        y = layer(xi, **(call_kwargs or {}))
        grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)
        (y * grad).sum().backward()
        results[impl] = (layer, xi, y)
    return results


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("capacity_factor", [1.0, 0.5, 0.0, -0.6])
@pytest.mark.parametrize("shared", [0, 1])
def test_layer_matches_naive_loop(gate, capacity_factor, shared):
    x = skewed(3, 13, 12)  # 39 tokens: divisible by nothing useful
    results = run_both(gate, x, capacity_factor=capacity_factor, num_shared_experts=shared)
    (kl, kx, ky), (tl, tx, ty) = results["kernel"], results["torch"]
    torch.testing.assert_close(ky, ty)
    torch.testing.assert_close(kx.grad, tx.grad)
    for (name, kp), tp in zip(kl.named_parameters(), tl.parameters()):
        torch.testing.assert_close(kp.grad, tp.grad, msg=name)
    with torch.no_grad():
        want, dropped, load = naive_moe(kl, x, 2, capacity_factor)
    torch.testing.assert_close(ky, want)
    assert kl.stats.dropped_fraction == pytest.approx(dropped)
    assert kl.stats.tokens_per_expert.tolist() == load
    if capacity_factor == 0:
        assert kl.stats.dropped_fraction == 0 and kl.stats.capacity == max(load)
    else:
        assert dropped > 0.05  # the capacity really bites, so who keeps a slot is checked


@pytest.mark.parametrize("top_k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("expert", ["ffn", "swiglu"])
def test_top_k_and_expert_types(top_k, expert):
    x = skewed(29, 12)
    results = run_both("top", x, num_experts=8, top_k=top_k, expert=expert, capacity_factor=1.25)
    layer, _, y = results["kernel"]
    torch.testing.assert_close(y, results["torch"][2])
    with torch.no_grad():
        torch.testing.assert_close(y, naive_moe(layer, x, top_k, 1.25)[0])


def test_gradients_match_naive_loop():
    torch.manual_seed(0)
    layer = make_layer("top", num_shared_experts=1, capacity_factor=0.75).double()
    x = skewed(21, 12)
    grads = []
    for fn in (lambda: layer(x), lambda: naive_moe(layer, x, 2, 0.75)[0]):
        layer.zero_grad()
        (fn() * torch.linspace(-1, 1, 12, dtype=torch.float64)).sum().backward()
        grads.append([p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_gradcheck_whole_layer_fp64():
    torch.manual_seed(1)
    layer = make_layer("top", capacity_factor=0.0, num_shared_experts=1).double()
    x = torch.randn(9, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: layer(x), (x,))


def test_many_experts_empty_experts_and_one_hot_expert():
    torch.manual_seed(2)
    layer = make_layer("top", num_experts=256, top_k=4, capacity_factor=0.0).double()
    x = torch.randn(17, 12, dtype=torch.float64)  # 68 choices over 256 experts: most are empty
    y = layer(x)
    assert (layer.stats.tokens_per_expert == 0).sum() > 150
    torch.testing.assert_close(y, naive_moe(layer, x, 4, 0.0)[0])
    # Every token on one expert: make the router prefer expert 3 for any input.
    with torch.no_grad():
        layer.gate.weight_ED.zero_()
        layer.gate.weight_ED[3] = 1.0
    x = torch.rand(40, 12, dtype=torch.float64) + 0.5
    for cf in (1.0, 0.0):
        y = layer(x, top_k=1, capacity_factor=cf)
        assert layer.stats.tokens_per_expert[3] == 40
        torch.testing.assert_close(y, naive_moe(layer, x, 1, cf)[0])
    assert layer.stats.dropped_fraction == 0
    layer(x, top_k=1, capacity_factor=1.0)
    assert layer.stats.dropped_fraction == pytest.approx(1 - 1 / 40)  # capacity 1*ceil(40/256) = 1


def test_batch_prioritized_keeps_confident_tokens():
    torch.manual_seed(3)
    x = skewed(30, 12)
    results = run_both("top", x, batch_prioritized=True, capacity_factor=0.5)
    layer, _, y = results["kernel"]
    torch.testing.assert_close(y, results["torch"][2])
    with torch.no_grad():
        want, dropped, _ = naive_moe(layer, x, 2, 0.5, batch_prioritized=True)
    torch.testing.assert_close(y, want)
    assert dropped > 0


def test_eval_mode_is_deterministic_and_jitter_free():
    """Switch jitter is training-time noise: in eval mode two calls agree exactly and equal the
    noiseless reference; in training the noise changes the output."""
    torch.manual_seed(8)
    layer = make_layer("top", gate_kwargs={"jitter_eps": 0.3}, capacity_factor=0.0).double()
    x = skewed(40, 12)
    layer.eval()
    first, second = layer(x), layer(x)
    assert torch.equal(first, second)
    with torch.no_grad():
        torch.testing.assert_close(first, naive_moe(layer, x, 2, 0.0)[0])
    layer.train()
    assert not torch.allclose(layer(x), first)


def test_per_call_overrides_and_bf16():
    layer = MoELayer(model_dim=16, num_experts=4, hidden_size=24, top_k=2)
    x = torch.randn(2, 7, 16)
    assert layer(x, top_k=1, capacity_factor=0).shape == x.shape and layer.stats.dropped_fraction == 0
    assert layer.top_k == 2 and layer.capacity_factor == 1.0  # overrides do not stick
    y32 = layer(x)
    yb = layer.to(torch.bfloat16)(x.bfloat16())
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), y32, rtol=5e-2, atol=5e-2)


def test_losses_match_hand_formulas():
    """f_e counts every choice, kept or dropped (Switch: the fraction of tokens routed to e)."""
    torch.manual_seed(4)
    layer = MoELayer(model_dim=8, num_experts=5, hidden_size=4, top_k=2, balance_loss_weight=0.3, z_loss_weight=0.07,
                     capacity_factor=0.5)
    x = skewed(11, 8, dtype=torch.float32)
    layer(x)
    assert layer.stats.dropped_fraction > 0
    logits = x @ layer.gate.weight_ED.detach().t()
    probs = torch.softmax(logits, -1)
    chosen = probs.topk(2, -1).indices.flatten().tolist()
    balance = 5 * sum(chosen.count(e) / 22 * probs[:, e].mean() for e in range(5))
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 11
    assert layer.stats.balance_loss.item() == pytest.approx(float(balance), rel=1e-5)
    assert layer.stats.z_loss.item() == pytest.approx(z, rel=1e-5)
    assert layer.aux_loss.item() == pytest.approx(0.3 * float(balance) + 0.07 * z, rel=1e-5)
    layer.aux_loss.backward()
    assert layer.gate.weight_ED.grad.abs().sum() > 0


def test_sigmoid_gate_bias_moves_load_toward_balance():
    torch.manual_seed(5)
    layer = MoELayer(model_dim=16, num_experts=8, hidden_size=8, top_k=2, gate="sigmoid",
                     gate_kwargs={"bias_update_rate": 0.02})
    with torch.no_grad():
        layer.gate.weight_ED[:2] += 0.5  # skew: experts 0 and 1 win for typical inputs
    x = torch.randn(256, 16).abs()

    def imbalance():
        layer.eval()
        layer(x)
        layer.train()
        load = layer.stats.tokens_per_expert.float()
        return (load.max() / load.mean()).item()

    before = imbalance()
    for _ in range(60):
        layer(x)
        update_router_biases(layer)
    after = imbalance()
    assert before > 2.5 and after < 1.5, (before, after)
    assert layer.gate.expert_bias[:2].max() < 0 < layer.gate.expert_bias[2:].max()
    assert "gate.expert_bias" in layer.state_dict() and not layer.gate.expert_bias.requires_grad


def test_a_skipped_step_leaves_the_sigmoid_gate_as_it_was():
    """update_bias(skip): a skipped step (skip true) moves no bias and keeps the load for the next
    update; a kept one (skip false) is update_bias() itself, against the formula written out."""
    torch.manual_seed(7)
    layer = MoELayer(model_dim=16, num_experts=8, hidden_size=8, top_k=2, gate="sigmoid",
                     gate_kwargs={"bias_update_rate": 0.02})
    gate = layer.gate
    gate.expert_bias.copy_(torch.randn(8) * 0.1)
    layer(torch.randn(64, 16))
    bias, load = gate.expert_bias.clone(), gate.pending_load.clone()
    assert load.sum() == 64 * 2
    update_router_biases(layer, skip=torch.tensor(True))
    assert torch.equal(gate.expert_bias, bias) and torch.equal(gate.pending_load, load)
    layer(torch.randn(64, 16))  # the skipped step's load and this one's are balanced together
    load = gate.pending_load.clone()
    assert load.sum() == 2 * 64 * 2
    update_router_biases(layer, skip=torch.tensor(False))
    assert torch.equal(gate.expert_bias, bias + 0.02 * torch.sign(load.mean() - load))
    assert torch.equal(gate.pending_load, torch.zeros(8))


def test_sigmoid_group_limited_routing_stays_in_groups():
    torch.manual_seed(6)
    gate = SigmoidGate(8, 16, n_group=4, topk_group=1)
    out = gate(torch.randn(50, 8), 3)
    groups = out.topk_idx_TK // 4
    assert torch.all(groups == groups[:, :1])  # all three choices in one group


def test_expert_params_are_marked_and_layers_found():
    model = torch.nn.Sequential(MoELayer(8, 4, 8, num_shared_experts=1), torch.nn.Linear(8, 8))
    marked = {name for name, p in model.named_parameters() if is_expert_param(p)}
    assert marked == {"0.experts.w1", "0.experts.b1", "0.experts.w2", "0.experts.b2"}
    assert len(moe_layers(model)) == 1


@pytest.mark.parametrize(
    "kwargs,call,match",
    [
        ({"top_k": 5}, None, r"top_k must be an integer in \[1, num_experts=4\]"),
        ({"gate": "nope"}, None, r"gate must be one of \['cosine', 'sigmoid', 'top'\]"),
        ({"activation": "tanhh"}, None, r"activation must be one of \['gelu', 'relu', 'silu'\]"),
        ({"expert": "mlp"}, None, r"expert must be one of \['ffn', 'swiglu'\]"),
        ({"model_dim": 8.5}, None, r"model_dim must be a positive integer"),
        ({"hidden_size": 0}, None, r"hidden_size must be a positive integer"),
        ({"impl": "cuda"}, None, r"impl must be one of \('kernel', 'torch'\)"),
        ({"gate_kwargs": {"temperature": 1}}, None, r"gate_kwargs \['temperature'\] do not fit gate TopKGate"),
        ({}, torch.randn(3, 7), r"x's last dimension must be model_dim=8"),
        ({}, "top_k", r"top_k must be an integer in \[1, num_experts=4\], got 0"),
    ],
)
def test_bad_input_names_the_argument(kwargs, call, match):
    base = dict(model_dim=8, num_experts=4, hidden_size=8)
    with pytest.raises(ValueError, match=match):
        layer = MoELayer(**{**base, **kwargs})
        if isinstance(call, torch.Tensor):
            layer(call)
        elif call == "top_k":
            layer(torch.randn(3, 8), top_k=0)


def test_router_stays_fp32_under_autocast():
    """Under bf16 autocast (the trainer's mixed precision) the router logits are still the fp32
    product of the input and the router weight, not a bf16 matmul's."""
    torch.manual_seed(0)
    layer = MoELayer(model_dim=64, num_experts=8, hidden_size=32, top_k=2, impl="torch")
    x = torch.randn(40, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
    logits = layer.stats.router_logits
    want = x @ layer.gate.weight_ED.t()
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, rtol=1e-6, atol=1e-6)
    bf16 = (x.bfloat16() @ layer.gate.weight_ED.bfloat16().t()).float()
    assert (bf16 - want).abs().max() > 1e-3  # so the check above can tell the two apart


@pytest.mark.parametrize("expert", ["ffn", "swiglu"])
@pytest.mark.parametrize("capacity_factor", [0.0, 1.25])
def test_autocast_dispatches_tokens_in_the_autocast_dtype(monkeypatch, expert, capacity_factor):
    """Under bf16 autocast the tokens reach dispatch (and the experts) already in bf16 while the
    router reads fp32, and the layer computes what its experts would from fp32 tokens: the same
    output bit for bit as a dispatch of the fp32 tokens (a copy commutes with the cast), gradients
    within bf16 rounding, fp32 gradient for the fp32 input."""
    from moetrain import ops  # noqa: PLC0415

    torch.manual_seed(1)
    layer = MoELayer(64, 4, 32, top_k=2, expert=expert, activation="silu" if expert == "swiglu" else "relu",
                     capacity_factor=capacity_factor)
    x = torch.randn(48, 64, requires_grad=True)
    seen = []
    dispatch = ops.dispatch
    monkeypatch.setattr(ops, "dispatch", lambda x_TD, *a, **k: seen.append(x_TD.dtype) or dispatch(x_TD, *a, **k))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert seen == [torch.bfloat16]
    (gx,) = torch.autograd.grad(y.float().sum(), [x])
    assert gx.dtype == torch.float32
    logits = layer.stats.router_logits
    torch.testing.assert_close(logits, x.detach() @ layer.gate.weight_ED.t(), rtol=1e-6, atol=1e-6)

    # The previous order as the reference: the fp32 tokens through dispatch, cast by each expert GEMM.
    x_ref = x.detach().clone().requires_grad_()
    monkeypatch.setattr(ops, "dispatch", lambda x_TD, *a, **k: dispatch(x_ref, *a, **k))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref = layer(x_ref)
    assert torch.equal(y, y_ref)
    (gx_ref,) = torch.autograd.grad(y_ref.float().sum(), [x_ref])
    torch.testing.assert_close(gx, gx_ref, rtol=2e-2, atol=2e-3)
