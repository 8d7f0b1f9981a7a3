"""Softmax top-k gate (Switch k=1, GShard k=2).

Qwen3-MoE routing is this gate with normalize=True (softmax over all experts, top-k, renormalise
the k weights to sum to one); Mixtral's is the same. The router weight is kept and applied in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moetrain import ops
from moetrain.moe.gates import Gate, GateOutput, register_gate, router_float, softmax_topk


@dataclass
class TopGateSettings:
    normalize: bool = False  # renormalise the k chosen probabilities to sum to one (GShard, Mixtral, Qwen3)
    jitter_eps: float = 0.0  # Switch's multiplicative noise on the router input while training

    def __post_init__(self):
        if self.jitter_eps < 0:
            raise ValueError(f"jitter_eps must be >= 0, got {self.jitter_eps}")


@register_gate("top", TopGateSettings)
class TopKGate(Gate):
    def __init__(self, model_dim: int, num_experts: int, **settings):
        super().__init__(model_dim, num_experts)
        settings = TopGateSettings(**settings)
        self.normalize = settings.normalize
        self.jitter_eps = settings.jitter_eps
        self.weight_ED = nn.Parameter(torch.empty(num_experts, model_dim))
        nn.init.normal_(self.weight_ED, std=model_dim**-0.5)

    def forward(self, x_TD: torch.Tensor, top_k: int) -> GateOutput:
        if self.training and self.jitter_eps > 0:
            # Switch Transformer's jitter: multiplicative uniform noise on the router input.
            x_TD = router_float(x_TD)
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1 - self.jitter_eps, 1 + self.jitter_eps)
        logits_TE = ops.router_logits(x_TD, self.weight_ED, self.impl)  # in fp32
        return softmax_topk(logits_TE, top_k, self.normalize)
