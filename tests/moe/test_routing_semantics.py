"""Capacity and batch-prioritized routing against Tutel's rules, re-implemented here in plain Python.

Tutel's definitions (tutel/impls/fast_dispatch.py, extract_critical), for T tokens, E experts, k
choices per token and probabilities p = softmax(router logits):
  - capacity: k * int(cf * ceil(T / E)) for cf > 0; for cf < 0 the padded size is
    min(largest slot used + 1, k * int(|cf| * ceil(T / E))); a slot at or past it is dropped;
  - slots: the j-th choices are placed after every choice of ranks < j for that expert; inside a
    rank, tokens take slots in token order, or (batch_prioritized_routing) by decreasing
    importance, the token's largest probability p.max();
  - with normalize the k weights are renormalised, which changes the combine, not the order.
moetrain differs in one documented place: where Tutel's capacity would be 0, it takes k.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from moetrain import MoELayer
from moetrain.moe.routing import capacity_limit, make_plan


def tutel_capacity(cf: float, tokens: int, experts: int, top_k: int) -> int:
    """Tutel's limit on slots per expert (before moetrain's minimum of k)."""
    per_expert = -(-tokens // experts)  # ceil(T / E) on integers
    return top_k * int(abs(cf) * per_expert)


def tutel_slots(probs: list[list[float]], top_k: int, batch_prioritized: bool):
    """(chosen experts [T][k], slot of each choice inside its expert [T][k]) by Tutel's rules."""
    tokens = len(probs)
    chosen = [sorted(range(len(row)), key=lambda e: -row[e])[:top_k] for row in probs]
    order = list(range(tokens))
    if batch_prioritized:
        order.sort(key=lambda t: -max(probs[t]))
    used: dict[int, int] = {}
    slots = [[0] * top_k for _ in range(tokens)]
    for j in range(top_k):  # every first choice before any second choice
        for t in order:
            e = chosen[t][j]
            slots[t][j] = used.get(e, 0)
            used[e] = used.get(e, 0) + 1
    return chosen, slots


def routed(layer: MoELayer, x_TD: torch.Tensor):
    with torch.no_grad():
        return layer.gate(x_TD, layer.top_k)


# ---------------------------------------------------------------------- capacity


def test_capacity_of_the_issue_example():
    # T=203, E=6, k=1, cf=0.3: ceil(203 / 6) = 34, int(0.3 * 34) = int(10.2) = 10 rows (not ceil(10.15) = 11).
    assert capacity_limit(0.3, 203, 6, 1) == 10
    assert capacity_limit(-0.3, 203, 6, 1) == 10


def test_capacity_matches_tutel_on_random_shapes():
    rng = random.Random(3)
    for _ in range(2000):
        tokens, experts = rng.randint(0, 5000), rng.randint(1, 300)
        top_k = rng.randint(1, min(experts, 8))
        cf = rng.choice([1, -1]) * rng.choice([rng.uniform(0.01, 4.0), rng.randint(1, 4), 0.3, 1.25])
        tutel = tutel_capacity(cf, tokens, experts, top_k)
        # Where Tutel's capacity is 0 (it then fails), moetrain keeps one slot per choice rank.
        assert capacity_limit(cf, tokens, experts, top_k) == (tutel if tutel > 0 else top_k)


def test_capacity_where_tutel_gives_zero():
    # 5 tokens over 6 experts at cf 0.1: Tutel's int(0.1 * 1) = 0; moetrain keeps k rows per expert.
    assert tutel_capacity(0.1, 5, 6, 2) == 0
    assert capacity_limit(0.1, 5, 6, 2) == capacity_limit(-0.1, 5, 6, 2) == 2
    layer = MoELayer(8, 6, 16, top_k=2, capacity_factor=0.1, impl="torch")
    layer(torch.randn(5, 8))
    assert layer.stats.capacity == 2 and int(layer.stats.kept_per_expert.max()) <= 2


# ---------------------------------------------------------------------- slots, kept choices, outputs

CASES = [  # (T, E, k, cf, normalize, batch_prioritized): the issue's two examples, then mixed ones
    (203, 6, 1, 0.3, False, False),
    (203, 6, 2, 1.0, True, True),
    (203, 6, 2, -0.7, True, True),
    (97, 5, 3, 0.8, True, False),
    (150, 8, 2, 1.5, False, True),
    (61, 4, 2, -1.3, False, False),
    (33, 7, 1, 2.0, True, True),
]


@pytest.mark.parametrize("impl", ["kernel", "torch"])
@pytest.mark.parametrize("tokens, experts, top_k, cf, normalize, batch_prioritized", CASES)
def test_plan_places_every_choice_where_tutel_does(impl, tokens, experts, top_k, cf, normalize, batch_prioritized):
    torch.manual_seed(tokens * 31 + experts)
    layer = MoELayer(16, experts, 8, top_k=top_k, capacity_factor=cf, batch_prioritized=batch_prioritized, impl=impl,
                     gate_kwargs={"normalize": normalize})
    # Tokens sharing a direction, so a few experts overflow.
    x_TD = torch.randn(tokens, 16) + 1.5 * torch.randn(16)
    out = routed(layer, x_TD)
    probs = out.probs_TE.double().tolist()
    chosen, slots = tutel_slots(probs, top_k, batch_prioritized)
    assert out.topk_idx_TK.tolist() == chosen

    plan = make_plan(out.topk_idx_TK, out.priority(), experts, cf, batch_prioritized, impl)
    limit = tutel_capacity(cf, tokens, experts, top_k)
    assert limit > 0
    dest = plan.dest_TK.tolist()
    kept_E = [0] * experts
    for t in range(tokens):
        for j in range(top_k):
            e, slot = chosen[t][j], slots[t][j]
            if slot >= limit:
                assert dest[t][j] == -1, (t, j)
                continue
            kept_E[e] += 1
            if cf > 0:  # padded: expert e's block starts at e * capacity, the slot is the row inside it
                assert plan.capacity == limit and dest[t][j] == e * limit + slot, (t, j)
            else:
                assert dest[t][j] >= 0
    assert plan.counts_E.tolist() == kept_E
    if cf < 0:  # packed: each expert's kept rows are its own contiguous block, slots in order
        start = [sum(kept_E[:e]) for e in range(experts)]
        for t in range(tokens):
            for j in range(top_k):
                if slots[t][j] < limit:
                    assert dest[t][j] == start[chosen[t][j]] + slots[t][j]


def test_batch_priority_is_the_raw_top_probability_not_the_renormalised_weight():
    # The issue's case: T=203, E=6, top-2, cf=1, normalize=True. Tutel orders by p.max(); ordering
    # by the renormalised top weight p1 / (p1 + p2) keeps other choices here, so this test tells them apart.
    torch.manual_seed(203)
    tokens, experts, top_k = 203, 6, 2
    layer = MoELayer(16, experts, 8, top_k=top_k, capacity_factor=1.0, batch_prioritized=True, impl="torch",
                     gate_kwargs={"normalize": True})
    x_TD = torch.randn(tokens, 16) + 1.5 * torch.randn(16)
    out = routed(layer, x_TD)
    probs = out.probs_TE.double().tolist()
    limit = tutel_capacity(1.0, tokens, experts, top_k)
    chosen, slots = tutel_slots(probs, top_k, batch_prioritized=True)
    tutel_kept = {(t, j) for t in range(tokens) for j in range(top_k) if slots[t][j] < limit}

    renormalised = [[p / sum(sorted(row)[-top_k:]) for p in row] for row in probs]
    _, other_slots = tutel_slots(renormalised, top_k, batch_prioritized=True)
    other_kept = {(t, j) for t in range(tokens) for j in range(top_k) if other_slots[t][j] < limit}
    assert tutel_kept != other_kept  # the case can tell the two orders apart

    plan = make_plan(out.topk_idx_TK, out.priority(), experts, 1.0, True, "torch")
    ours = {(t, j) for t in range(tokens) for j in range(top_k) if plan.dest_TK[t, j] >= 0}
    assert ours == tutel_kept


def expert_output(layer: MoELayer, e: int, x_D: torch.Tensor) -> torch.Tensor:
    ex = layer.experts
    return F.relu(x_D @ ex.w1[e] + ex.b1[e]) @ ex.w2[e] + ex.b2[e]


@pytest.mark.parametrize("impl", ["kernel", "torch"])
@pytest.mark.parametrize("cf", [0.3, -0.3, 1.0])
def test_layer_output_keeps_exactly_tutels_choices(impl, cf):
    """The whole layer, T=203, E=6, top-2, normalized and batch-prioritized, against a token loop
    that keeps the choices Tutel keeps and weights them by the renormalised probabilities."""
    torch.manual_seed(7)
    tokens, experts, top_k = 203, 6, 2
    layer = MoELayer(12, experts, 10, top_k=top_k, capacity_factor=cf, batch_prioritized=True, impl=impl,
                     gate_kwargs={"normalize": True}).double()
    with torch.no_grad():
        layer.experts.b1.normal_()
        layer.experts.b2.normal_()
    x_TD = torch.randn(tokens, 12, dtype=torch.float64) + 1.5 * torch.randn(12, dtype=torch.float64)
    y_TD = layer(x_TD)
    probs = torch.softmax(x_TD @ layer.gate.weight_ED.detach().t(), dim=-1).tolist()  # the router, by hand
    chosen, slots = tutel_slots(probs, top_k, batch_prioritized=True)
    limit = tutel_capacity(cf, tokens, experts, top_k)
    expected = torch.zeros_like(y_TD)
    kept = 0
    with torch.no_grad():
        for t in range(tokens):
            total = sum(probs[t][e] for e in chosen[t])
            for j, e in enumerate(chosen[t]):
                if slots[t][j] < limit:
                    kept += 1
                    expected[t] += probs[t][e] / total * expert_output(layer, e, x_TD[t])
    assert 0 < kept < tokens * top_k  # some choices dropped: the capacity mattered
    assert int(layer.stats.kept_per_expert.sum()) == kept
    torch.testing.assert_close(y_TD, expected, rtol=1e-10, atol=1e-10)
    if cf > 0:
        assert layer.stats.capacity == limit


def test_batch_prioritized_rejects_a_missing_or_misshapen_priority():
    idx_TK = torch.zeros(4, 2, dtype=torch.long)
    idx_TK[:, 1] = 1
    with pytest.raises(ValueError, match=r"one priority score per token, shape \(4,\); got None"):
        make_plan(idx_TK, None, 3, 1.0, batch_prioritized=True, impl="torch")
    with pytest.raises(ValueError, match=r"shape \(4,\); got \(4, 2\)"):
        make_plan(idx_TK, torch.rand(4, 2), 3, 1.0, batch_prioritized=True, impl="torch")


def test_sigmoid_gate_priority_is_its_raw_top_affinity():
    """DeepSeek-style gate (no Tutel counterpart): the largest un-normalised, unscaled sigmoid
    affinity among the token's choices, by hand from the router weights and bias."""
    torch.manual_seed(4)
    layer = MoELayer(8, 6, 8, top_k=2, gate="sigmoid", batch_prioritized=True, impl="torch",
                     gate_kwargs={"routed_scaling_factor": 2.5})
    with torch.no_grad():
        layer.gate.expert_bias.normal_(std=0.3)
    x_TD = torch.randn(40, 8)
    out = routed(layer, x_TD)
    scores = torch.sigmoid(x_TD.double() @ layer.gate.weight_ED.detach().double().t())
    for t in range(40):
        biased = (scores[t] + layer.gate.expert_bias.double()).tolist()
        pick = sorted(range(6), key=lambda e: -biased[e])[:2]
        assert math.isclose(out.priority()[t].item(), max(scores[t, e].item() for e in pick), rel_tol=1e-6)
