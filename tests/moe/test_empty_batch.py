"""An empty batch (T = 0) through MoELayer: an empty output and zero losses, forward and backward, on
every path (kernel and torch; padded, dropless and capped; every gate; FFN and SwiGLU experts;
shared experts), and under expert parallelism on 2 Gloo ranks where one rank has no tokens or its
experts receive none, against the same layer run whole in one process.

The reference is the definition: a mean over no tokens is taken as 0 (no loss, no gradient), an
output has one row per token, and a rank without tokens changes nothing for the others.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from moetrain import MoELayer
from moetrain.parallel import DistributedOptimizer, parallelize, spawn

GATES = {
    "top": dict(gate="top"),
    "top_normalized": dict(gate="top", gate_kwargs={"normalize": True}),
    "cosine": dict(gate="cosine", gate_kwargs={"proj_dim": 8}),
    "sigmoid_grouped": dict(gate="sigmoid", gate_kwargs={"n_group": 2, "topk_group": 1}),
}


def assert_all_zero_or_none(module: torch.nn.Module) -> None:
    for name, param in module.named_parameters():
        assert param.grad is None or (param.grad == 0).all(), name


@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("capacity_factor", [1.0, 0.0, -1.0], ids=["padded", "dropless", "capped"])
@pytest.mark.parametrize("expert", ["ffn", "swiglu"])
@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_empty_batch_gives_empty_output_and_zero_losses(impl, gate, expert, capacity_factor, shared):
    def build():
        torch.manual_seed(0)
        return MoELayer(24, 4, 40, top_k=2, capacity_factor=capacity_factor, expert=expert, impl=impl,
                        num_shared_experts=shared, z_loss_weight=0.1, batch_prioritized=True, **GATES[gate])

    layer, fresh = build(), build()
    x = torch.randn(3, 0, 24, requires_grad=True)  # leading dims kept, no tokens
    y = layer(x)
    assert y.shape == (3, 0, 24) and y.dtype == x.dtype
    assert layer.aux_loss.item() == 0 and layer.stats.balance_loss.item() == 0 and layer.stats.z_loss.item() == 0
    assert layer.stats.tokens_per_expert.tolist() == [0] * 4 and layer.stats.kept_per_expert.tolist() == [0] * 4
    assert layer.stats.dropped_fraction == 0
    (y.sum() + layer.aux_loss).backward()
    assert x.grad.shape == x.shape
    assert_all_zero_or_none(layer)
    layer.gate.update_bias()  # the sigmoid gate's balancing step after an empty batch: nothing moves
    if hasattr(layer.gate, "expert_bias"):
        assert (layer.gate.expert_bias == 0).all()

    # The layer still computes what a fresh one computes on a real batch: nothing was left behind.
    x_TD = torch.randn(10, 24)
    torch.testing.assert_close(layer(x_TD), fresh(x_TD), rtol=0, atol=0)


def test_empty_batch_per_call_settings():
    layer = MoELayer(8, 4, 16, top_k=2, capacity_factor=1.0)
    for top_k, capacity_factor in [(1, 0.5), (3, 0.0), (4, -2.0)]:
        y = layer(torch.zeros(0, 8), top_k=top_k, capacity_factor=capacity_factor)
        assert y.shape == (0, 8) and layer.aux_loss.item() == 0


# ---------------------------------------------------------------------- expert parallelism, 2 ranks

WORLD = 2
LIMIT = 1e-5
# (name, layer settings, call settings). Four experts, two per rank.
EP_LAYERS = [
    ("padded ffn", dict(capacity_factor=1.0), {}),
    ("padded ffn chunked", dict(capacity_factor=1.0), dict(a2a_ffn_overlap_degree=2)),
    ("padded ffn r=0", dict(capacity_factor=1.0), dict(adaptive_r=0)),
    ("dropless swiglu shared sigmoid", dict(capacity_factor=0.0, expert="swiglu", num_shared_experts=1,
                                            gate="sigmoid", gate_kwargs={"n_group": 2, "topk_group": 1}), {}),
    ("capped cosine", dict(capacity_factor=-1.0, gate="cosine", gate_kwargs={"proj_dim": 8}), {}),
]
# Tokens per rank: rank 1 has none; or both have tokens, all routed to rank 0's experts (0 and 1).
SCENARIOS = {"rank without tokens": (9, 0), "experts without tokens": (9, 6)}


def _steer_to_rank0_experts(layer: MoELayer) -> None:
    """Make every token choose experts 0 and 1 (rank 0's), for inputs with positive entries."""
    with torch.no_grad():
        if hasattr(layer.gate, "expert_bias"):
            layer.gate.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
        elif hasattr(layer.gate, "weight_ED"):
            layer.gate.weight_ED.copy_(torch.tensor([1.0, 0.5, -1.0, -2.0]).unsqueeze(1).expand(4, layer.model_dim))
        else:  # cosine: expert directions aligned with the projection of positive inputs, or against it
            layer.gate.proj.weight.copy_(torch.ones_like(layer.gate.proj.weight) / layer.model_dim)
            layer.gate.proj.bias.zero_()
            directions_EP = torch.tensor([1.0, 0.9, -1.0, -0.9]).unsqueeze(1)
            layer.gate.expert_dirs_EP.copy_(directions_EP.expand_as(layer.gate.expert_dirs_EP))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


def _compare(results: dict, tag: str, settings: dict, call: dict, tokens: tuple, steer: bool, rank: int) -> None:
    torch.manual_seed(0)
    layer = MoELayer(8, 4, 12, top_k=2, z_loss_weight=0.1, **settings)
    if steer:
        _steer_to_rank0_experts(layer)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(t, 8, generator=gen).abs() + 0.1 for t in tokens]
    gs = [torch.randn(t, 8, generator=gen) for t in tokens]

    # One process, each rank's tokens in turn: outputs, input and shared-parameter gradients, and
    # the expert gradients summed over both (each rank's experts see every rank's rows).
    reference = copy.deepcopy(layer)
    ref = []
    expert_grads = {name: torch.zeros_like(p) for name, p in reference.experts.named_parameters()}
    for x, g in zip(xs, gs):
        reference.zero_grad()
        leaf = x.clone().requires_grad_()
        y = reference(leaf)
        ((y * g).sum() + reference.aux_loss).backward()
        shared = {name: p.grad.clone() for name, p in reference.named_parameters()
                  if not name.startswith("experts.") and p.grad is not None}
        ref.append((y.detach(), leaf.grad, reference.aux_loss.detach(), shared))
        for name, p in reference.experts.named_parameters():
            expert_grads[name] += p.grad

    expert_parallel = parallelize(layer)[0]
    local = expert_parallel.layout.local_slice
    leaf = xs[rank].clone().requires_grad_()
    y = layer(leaf, **call)
    ((y * gs[rank]).sum() + layer.aux_loss).backward()
    y_ref, x_grad_ref, aux_ref, shared_ref = ref[rank]
    errors = [_max_diff(y, y_ref), _max_diff(leaf.grad, x_grad_ref), abs(layer.aux_loss.item() - aux_ref.item())]
    for name, p in layer.named_parameters():
        if name.startswith("experts."):
            errors.append(_max_diff(p.grad, expert_grads[name.removeprefix("experts.")][local] / WORLD))
        elif name in shared_ref:
            errors.append(_max_diff(p.grad, shared_ref[name]))
    results[f"{tag}: vs one process"] = max(errors)
    results[f"{tag}: output rows"] = y.shape[0]

    # The optimizer's reduction: shared parameters the mean of both ranks', experts already the mean.
    DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=0.1), layer).reduce_gradients()
    errors = []
    for name, p in layer.named_parameters():
        if name.startswith("experts."):
            errors.append(_max_diff(p.grad, expert_grads[name.removeprefix("experts.")][local] / WORLD))
        else:
            mean = sum(r[3].get(name, torch.zeros_like(p)) for r in ref) / WORLD
            errors.append(_max_diff(p.grad, mean))
    results[f"{tag}: reduced gradients"] = max(errors)
    # Rows the experts of each rank received (the second scenario must leave rank 1's at 0).
    results[f"{tag}: kept per expert"] = layer.stats.kept_per_expert.tolist()


def ep_worker(rank: int, world: int, out_dir: str) -> None:
    results = {}
    for scenario, tokens in SCENARIOS.items():
        for name, settings, call in EP_LAYERS:
            steer = scenario == "experts without tokens"
            _compare(results, f"{scenario} / {name}", settings, call, tokens, steer, rank)
    dist.barrier()
    torch.save(results, os.path.join(out_dir, f"results{rank}.pt"))


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("empty_ep"))
    spawn(ep_worker, WORLD, args=(out_dir,), backend="gloo")
    return [torch.load(os.path.join(out_dir, f"results{rank}.pt")) for rank in range(WORLD)]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name", [layer[0] for layer in EP_LAYERS])
def test_expert_parallel_rank_without_tokens_matches_one_process(ep_results, scenario, name):
    tag = f"{scenario} / {name}"
    for rank, results in enumerate(ep_results):
        assert results[f"{tag}: output rows"] == SCENARIOS[scenario][rank]
        assert results[f"{tag}: vs one process"] < LIMIT, (rank, results[f"{tag}: vs one process"])
        assert results[f"{tag}: reduced gradients"] < LIMIT, (rank, results[f"{tag}: reduced gradients"])
    if scenario == "rank without tokens":
        assert ep_results[1][f"{tag}: kept per expert"] == [0, 0, 0, 0]
    else:  # every choice went to rank 0's experts: rank 1's experts received no rows from anyone
        for results in ep_results:
            kept = results[f"{tag}: kept per expert"]
            assert kept[2:] == [0, 0] and sum(kept) > 0
