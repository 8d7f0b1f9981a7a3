"""Auxiliary router losses.

balance_loss (Switch/GShard load balancing): E * sum_e f_e * P_e, with f_e the fraction of the
T*K routing choices that picked expert e and P_e the mean router probability of expert e. It is 1
when both are uniform and grows as routing collapses onto few experts; only P_e carries gradient.
Where f_e is counted is the layer's choice (MoELayer's balance_loss):
  micro_batch   over this process's tokens of the call;
  global_batch  over the tokens of every rank of the data-parallel (and expert-parallel) group:
                the counts are summed across ranks before the loss, P_e stays this rank's
                (Qwen3's global-batch balance loss, Megatron's global aux loss);
  sequence      per sequence, then averaged over the sequences (DeepSeek-V3's complementary
                sequence-wise balance loss): sequence_balance_loss.

z_loss (ST-MoE router z-loss): mean over tokens of logsumexp(logits)^2; it keeps router logits
small so the softmax stays numerically tame.

An empty batch (no tokens) has both losses 0, still attached to the router's graph (a mean over
no tokens would be 0/0).
"""

from __future__ import annotations

import torch


def choice_counts(topk_idx_TK: torch.Tensor, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Routing choices per expert. A scatter-add, unlike torch.bincount, never waits for the GPU."""
    idx_N = topk_idx_TK.reshape(-1)
    return torch.zeros(num_experts, dtype=dtype, device=idx_N.device).index_add_(
        0, idx_N, torch.ones(idx_N.numel(), dtype=dtype, device=idx_N.device)
    )


def balance_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, num_choices: int | torch.Tensor) -> torch.Tensor:
    """counts_E: routing choices per expert (choice_counts, or a routing plan's load), of num_choices
    (a tensor when summed over ranks on the device: it is not read back)."""
    num_experts = probs_TE.size(-1)
    mean_probs_E = probs_TE.sum(0) / max(probs_TE.size(0), 1)
    choices = num_choices.clamp(min=1).to(probs_TE.dtype) if isinstance(num_choices, torch.Tensor) \
        else max(num_choices, 1)
    # E * sum_e (counts_e / num_choices) * mean_t probs[t, e], with the constants folded into one scale.
    return torch.dot(counts_E.to(probs_TE.dtype), mean_probs_E) * (num_experts / choices)


def sequence_balance_loss(probs_BSE: torch.Tensor, topk_idx_BSK: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: for each of the B sequences of S tokens,
    E * sum_e f_e * P_e with f_e = (choices of expert e in the sequence) / (S*K) and P_e the mean
    probability of expert e over the sequence; the mean over sequences."""
    batch, length, num_experts = probs_BSE.shape
    counts_BE = torch.zeros(batch, num_experts, dtype=probs_BSE.dtype, device=probs_BSE.device).scatter_add_(
        1, topk_idx_BSK.reshape(batch, -1), torch.ones(topk_idx_BSK.reshape(batch, -1).shape, dtype=probs_BSE.dtype,
                                                         device=probs_BSE.device))
    mean_probs_BE = probs_BSE.sum(1) / max(length, 1)
    per_sequence_B = (counts_BE * mean_probs_BE).sum(-1) * (num_experts / max(length * topk_idx_BSK.size(-1), 1))
    return per_sequence_B.sum() / max(batch, 1)


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits_TE, dim=-1).square().sum() / max(logits_TE.size(0), 1)
