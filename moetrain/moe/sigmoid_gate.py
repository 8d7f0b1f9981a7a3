"""Sigmoid gate with aux-loss-free load balancing (DeepSeek-V3, Kimi-K2).

Each expert's affinity is sigmoid(logit). A per-expert bias is added to the affinities only to
*choose* experts; the weights come from the unbiased affinities. After each optimizer step the
bias moves by `bias_update_rate` toward balance: up for experts that got fewer tokens than the
mean, down for those that got more (the sign rule of the DeepSeek-V3 report).

Group-limited routing: the experts are split into n_group groups; each group is scored by the sum
of its two best biased affinities, only the topk_group best groups stay eligible. The chosen
weights are optionally renormalised to sum to one, then multiplied by routed_scaling_factor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moetrain.moe.losses import choice_counts
from moetrain import ops
from moetrain.moe.gates import Gate, GateOutput, register_gate


@dataclass
class SigmoidGateSettings:
    bias_update_rate: float = 1e-3  # how far each step moves the balancing bias (0: no bias)
    n_group: int = 1  # groups the experts are split into for group-limited routing
    topk_group: int = 1  # groups whose experts stay eligible for each token
    routed_scaling_factor: float = 1.0  # multiplies the chosen experts' weights
    normalize: bool = True  # renormalise the k chosen affinities to sum to one (before the scaling)

    def __post_init__(self):
        if self.n_group < 1:
            raise ValueError(f"n_group must be >= 1, got {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.bias_update_rate < 0:
            raise ValueError(f"bias_update_rate must be >= 0, got {self.bias_update_rate}")


@register_gate("sigmoid", SigmoidGateSettings)
class SigmoidGate(Gate):
    def __init__(self, model_dim: int, num_experts: int, **settings):
        super().__init__(model_dim, num_experts)
        settings = SigmoidGateSettings(**settings)
        if num_experts % settings.n_group:
            raise ValueError(f"n_group must divide num_experts={num_experts}, got {settings.n_group}")
        self.bias_update_rate = settings.bias_update_rate
        self.n_group = settings.n_group
        self.topk_group = settings.topk_group
        self.routed_scaling_factor = settings.routed_scaling_factor
        self.normalize = settings.normalize
        self.weight_ED = nn.Parameter(torch.empty(num_experts, model_dim))
        nn.init.normal_(self.weight_ED, std=model_dim**-0.5)
        # The bias is state, not a trained parameter: it is saved in checkpoints but gets no gradient.
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        # Routing choices per expert since the last update_bias() (a distributed optimizer sums it
        # over ranks before the update so every rank moves the bias the same way).
        self.register_buffer("pending_load", torch.zeros(num_experts), persistent=False)

    def forward(self, x_TD: torch.Tensor, top_k: int) -> GateOutput:
        logits_TE = ops.router_logits(x_TD, self.weight_ED, self.impl)  # in fp32
        scores_TE = torch.sigmoid(logits_TE)
        choice_TE = scores_TE + self.expert_bias
        if self.n_group > 1:
            if top_k > (self.num_experts // self.n_group) * self.topk_group:
                raise ValueError(f"top_k={top_k} exceeds the experts in the topk_group={self.topk_group} groups kept")
            grouped_TGX = choice_TE.view(choice_TE.size(0), self.n_group, self.num_experts // self.n_group)
            group_score_TG = grouped_TGX.topk(min(2, grouped_TGX.size(-1)), dim=-1).values.sum(-1)
            keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
            keep_TG.scatter_(1, group_score_TG.topk(self.topk_group, dim=-1).indices, True)
            choice_TE = grouped_TGX.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view_as(choice_TE)
        idx_TK = choice_TE.topk(top_k, dim=-1).indices
        weight_TK = scores_TE.gather(1, idx_TK)
        # Batch priority: the largest raw affinity among the choices (before renormalising and
        # scaling), as the softmax gates' is the raw top probability.
        priority_T = weight_TK.amax(dim=-1)
        if self.normalize:
            weight_TK = weight_TK / (weight_TK.sum(-1, keepdim=True) + 1e-20)
        weight_TK = weight_TK * self.routed_scaling_factor
        if self.training and self.bias_update_rate > 0:
            self.pending_load += choice_counts(idx_TK, self.num_experts, self.pending_load.dtype)
        # The balance loss sees the affinities normalised per token (DeepSeek-V3's sequence-wise loss).
        probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True)
        return GateOutput(logits_TE, probs_TE, idx_TK, weight_TK, priority_T)

    @torch.no_grad()
    def update_bias(self, skip: torch.Tensor | None = None) -> None:
        if self.bias_update_rate == 0:
            return
        # No load (all zeros) moves nothing: sign(0) = 0. Decided on the device, with no host sync.
        move_E = self.bias_update_rate * torch.sign(self.pending_load.mean() - self.pending_load)
        if skip is None:
            self.expert_bias += move_E
            self.pending_load.zero_()
        else:  # a skipped step moves nothing and keeps its load for the next update, as if never called
            self.expert_bias += torch.where(skip, 0.0, move_E)
            self.pending_load.copy_(torch.where(skip, self.pending_load, 0.0))
