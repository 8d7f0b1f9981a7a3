"""The router losses by hand: the Switch/GShard balance loss E * sum_e f_e * P_e is exactly E when
routing collapses onto one expert and 1 when it is uniform, for every built-in gate; small cases
worked out on paper; its gradient (only P carries one) and the ST-MoE z-loss."""

import math

import pytest
import torch

from moetrain import MoELayer
from moetrain.moe.losses import balance_loss, choice_counts, z_loss

E = 4
D = 8


def force_router(layer: MoELayer, collapsed: bool) -> None:
    """Collapsed: every token's router puts all its probability on expert 0 (exactly, in fp32).
    Uniform: every expert gets the same probability for every token."""
    gate = layer.gate
    with torch.no_grad():
        if hasattr(gate, "weight_ED"):  # top (softmax) and sigmoid: logits +-100 * sum(x), x > 0
            gate.weight_ED.fill_(-100.0 if collapsed else 0.0)
            if collapsed:
                gate.weight_ED[0] = 100.0
        else:  # cosine: the projection points along u; expert 0 along u, the others against it
            u = torch.randn(gate.expert_dirs_EP.size(1))
            gate.proj.weight.copy_(u.unsqueeze(1).expand_as(gate.proj.weight))
            gate.proj.bias.zero_()
            gate.expert_dirs_EP.copy_(u.expand_as(gate.expert_dirs_EP) * (-1.0 if collapsed else 1.0))
            gate.expert_dirs_EP[0] = u
            gate.log_scale.fill_(math.log(100.0))  # logits +-100: softmax one-hot in fp32


@pytest.mark.parametrize("gate", ["top", "cosine", "sigmoid"])
@pytest.mark.parametrize("collapsed", [True, False], ids=["collapsed", "uniform"])
def test_balance_loss_is_E_when_collapsed_and_1_when_uniform(gate, collapsed):
    torch.manual_seed(0)
    kwargs = {"proj_dim": 6} if gate == "cosine" else {}
    layer = MoELayer(D, E, 8, top_k=1, gate=gate, gate_kwargs=kwargs, balance_loss_weight=0.25, capacity_factor=0.0)
    force_router(layer, collapsed)
    x = torch.rand(32, D) + 0.5
    layer(x)
    if collapsed:
        assert layer.stats.tokens_per_expert.tolist() == [32, 0, 0, 0]
    want = float(E) if collapsed else 1.0
    assert layer.stats.balance_loss.item() == pytest.approx(want, rel=1e-6)
    assert layer.aux_loss.item() == pytest.approx(0.25 * want, rel=1e-6)


def test_balance_loss_hand_examples():
    # Two tokens, two experts, top-1: both pick expert 0. f = [1, 0], P = [0.75, 0.25]: 2 * 0.75.
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4]])
    idx = torch.tensor([[0], [0]])
    assert balance_loss(probs, choice_counts(idx, 2, torch.float32), 2).item() == pytest.approx(1.5)
    # Three tokens, three experts, top-2 (6 choices): f = [3, 2, 1] / 6, P = column means.
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.4, 0.2], [0.1, 0.2, 0.7]])
    idx = torch.tensor([[0, 1], [0, 1], [2, 0]])
    counts = choice_counts(idx, 3, torch.float32)
    assert counts.tolist() == [3.0, 2.0, 1.0]
    p = [(0.5 + 0.4 + 0.1) / 3, (0.3 + 0.4 + 0.2) / 3, (0.2 + 0.2 + 0.7) / 3]
    want = 3 * (3 / 6 * p[0] + 2 / 6 * p[1] + 1 / 6 * p[2])
    assert balance_loss(probs, counts, 6).item() == pytest.approx(want, rel=1e-6)


def test_balance_loss_gradient_pushes_probability_off_the_loaded_experts():
    """d loss / d probs[t, e] = E * f_e / T: positive and largest for the most loaded expert, so a
    gradient step lowers its probability (a flipped sign would raise it)."""
    torch.manual_seed(1)
    logits = torch.randn(10, 5, requires_grad=True)
    probs = torch.softmax(logits, -1)
    probs.retain_grad()
    idx = probs.topk(2, -1).indices
    counts = choice_counts(idx, 5, torch.float32)
    loss = balance_loss(probs, counts, 20)
    loss.backward()
    want = (5 * counts / 20 / 10).expand(10, 5)
    torch.testing.assert_close(probs.grad, want)
    busiest = int(counts.argmax())
    stepped = torch.softmax(logits.detach() - 1.0 * logits.grad, -1)
    assert stepped[:, busiest].mean() < probs[:, busiest].mean()


def test_z_loss_hand_values():
    # Equal logits c over E experts: logsumexp = c + log E.
    logits = torch.full((6, E), 0.5)
    assert z_loss(logits).item() == pytest.approx((0.5 + math.log(E)) ** 2, rel=1e-6)
    torch.manual_seed(2)
    logits = torch.randn(7, 3)
    want = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 7
    assert z_loss(logits).item() == pytest.approx(want, rel=1e-6)
