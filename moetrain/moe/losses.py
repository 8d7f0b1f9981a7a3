"""Auxiliary router losses.

balance_loss (Switch/GShard load balancing): E * sum_e f_e * P_e, with f_e the fraction of the
T*K routing choices that picked expert e and P_e the mean router probability of expert e. It is 1
when both are uniform and grows as routing collapses onto few experts; only P_e carries gradient.

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


def balance_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, num_choices: int) -> torch.Tensor:
    """counts_E: routing choices per expert (choice_counts, or a routing plan's load), of num_choices."""
    num_experts = probs_TE.size(-1)
    mean_probs_E = probs_TE.sum(0) / max(probs_TE.size(0), 1)
    # E * sum_e (counts_e / num_choices) * mean_t probs[t, e], with the constants folded into one scale.
    return torch.dot(counts_E.to(probs_TE.dtype), mean_probs_E) * (num_experts / max(num_choices, 1))


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits_TE, dim=-1).square().sum() / max(logits_TE.size(0), 1)
