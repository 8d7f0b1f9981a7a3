"""Where the balance loss counts its tokens (MoELayer's balance_loss), against the formulas written
out by hand with loops: micro_batch (the call's tokens), sequence (DeepSeek-V3's sequence-wise
loss: each sequence's own f_e and P_e, averaged over sequences) and global_batch (f_e from the
token counts of every rank, summed before the loss; P_e this rank's), the last on two Gloo
processes with different numbers of tokens. Values and router gradients are compared."""

from __future__ import annotations

import os

import pytest
import torch

from moetrain import MoELayer
from moetrain.parallel import spawn

E, D, K = 4, 6, 2


def reference_loss(probs_TE: torch.Tensor, chosen: list[list[int]], counted: list[list[int]] | None = None):
    """E * sum_e f_e * P_e with f_e over the choices `counted` (default: `chosen`, the same tokens)
    and P_e the mean of probs_TE over its tokens; a loop over tokens and experts."""
    counted = chosen if counted is None else counted
    choices = sum(len(token) for token in counted)
    total = 0.0
    for e in range(E):
        f_e = sum(token.count(e) for token in counted) / choices
        p_e = sum(probs_TE[t, e] for t in range(probs_TE.size(0))) / probs_TE.size(0)
        total = total + f_e * p_e
    return E * total


def softmax_topk(layer: MoELayer, x_TD: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
    """The top gate's probabilities (with the graph to its weight) and its choices, recomputed."""
    probs_TE = torch.softmax(x_TD @ layer.gate.weight_ED.t(), dim=-1)
    chosen = [sorted(probs_TE[t].topk(K).indices.tolist()) for t in range(x_TD.size(0))]
    return probs_TE, chosen


def router_grad(loss: torch.Tensor, layer: MoELayer) -> torch.Tensor:
    return torch.autograd.grad(loss, layer.gate.weight_ED)[0]


def test_sequence_loss_is_the_mean_of_each_sequences_own_loss():
    torch.manual_seed(0)
    layer = MoELayer(D, E, 8, top_k=K, gate="top", balance_loss="sequence", capacity_factor=0.0, impl="torch")
    x_BSD = torch.randn(3, 5, D)
    layer(x_BSD)
    reference = 0.0
    for b in range(3):
        probs_TE, chosen = softmax_topk(layer, x_BSD[b])
        reference = reference + reference_loss(probs_TE, chosen) / 3
    assert layer.stats.balance_loss.item() == pytest.approx(reference.item(), rel=1e-6)
    torch.testing.assert_close(router_grad(layer.aux_loss, layer), router_grad(reference, layer), rtol=1e-5, atol=1e-7)
    # Not the batch's loss: the sequences route differently.
    batch_probs, batch_chosen = softmax_topk(layer, x_BSD.reshape(-1, D))
    assert abs(reference_loss(batch_probs, batch_chosen).item() - reference.item()) > 1e-4


def test_micro_batch_loss_and_sequence_need_sequences():
    torch.manual_seed(1)
    layer = MoELayer(D, E, 8, top_k=K, gate="top", capacity_factor=1.0, impl="torch")
    x_TD = torch.randn(7, D)
    layer(x_TD)
    probs_TE, chosen = softmax_topk(layer, x_TD)
    assert layer.stats.balance_loss.item() == pytest.approx(reference_loss(probs_TE, chosen).item(), rel=1e-6)
    sequence = MoELayer(D, E, 8, top_k=K, balance_loss="sequence", impl="torch")
    with pytest.raises(ValueError, match=r"balance_loss='sequence' needs x shaped \[..., sequence, model_dim\]"):
        sequence(x_TD)
    with pytest.raises(ValueError, match="balance_loss must be one of"):
        MoELayer(D, E, 8, balance_loss="global")


def test_global_batch_on_one_process_counts_its_own_tokens():
    torch.manual_seed(2)
    layer = MoELayer(D, E, 8, top_k=K, balance_loss="global_batch", impl="torch")
    x_TD = torch.randn(9, D)
    layer(x_TD)
    probs_TE, chosen = softmax_topk(layer, x_TD)
    assert layer.stats.balance_loss.item() == pytest.approx(reference_loss(probs_TE, chosen).item(), rel=1e-6)


TOKENS = (6, 11)  # per rank: the global f_e must weigh the ranks' choices by their number


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(TOKENS[rank], D, generator=torch.Generator().manual_seed(10 + rank))


def global_worker(rank: int, world_size: int, out_dir: str) -> None:
    torch.manual_seed(3)  # the same router on both ranks
    layer = MoELayer(D, E, 8, top_k=K, gate="top", balance_loss="global_batch", capacity_factor=0.0, impl="torch")
    layer(_inputs(rank))
    grad = router_grad(layer.aux_loss, layer)
    torch.save({"loss": layer.stats.balance_loss, "grad": grad, "weight": layer.gate.weight_ED.detach()},
               os.path.join(out_dir, f"rank{rank}.pt"))


def test_global_batch_sums_the_counts_of_every_rank(tmp_path):
    spawn(global_worker, 2, args=(str(tmp_path),), backend="gloo")
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    layer = MoELayer(D, E, 8, top_k=K, gate="top", impl="torch")
    with torch.no_grad():
        layer.gate.weight_ED.copy_(results[0]["weight"])
    routed = [softmax_topk(layer, _inputs(rank)) for rank in range(2)]
    everyone = routed[0][1] + routed[1][1]
    for rank in range(2):
        reference = reference_loss(routed[rank][0], routed[rank][1], counted=everyone)
        local = reference_loss(routed[rank][0], routed[rank][1])
        assert results[rank]["loss"].item() == pytest.approx(reference.item(), rel=1e-6)
        assert abs(results[rank]["loss"].item() - local.item()) > 1e-4  # differs from the rank's own count
        torch.testing.assert_close(results[rank]["grad"], router_grad(reference, layer), rtol=1e-5, atol=1e-7)
