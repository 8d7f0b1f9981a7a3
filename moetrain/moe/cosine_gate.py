"""Cosine-similarity gate with a learnable temperature (as used by SwinV2-MoE).

Tokens are projected to a small space and compared with one learned direction per expert by
cosine similarity; the similarities are scaled by a learnable inverse temperature (clamped so the
scale never exceeds 100) and go through the same softmax top-k as the `top` gate. Bounded logits
make routing less sensitive to the token norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.moe.gates import Gate, GateOutput, register_gate, router_float, softmax_topk

_MAX_SCALE = 100.0


@dataclass
class CosineGateSettings:
    proj_dim: int = 256  # width of the space tokens and expert directions are compared in
    init_temperature: float = 0.5  # the learned temperature's starting value
    normalize: bool = False  # renormalise the k chosen probabilities to sum to one

    def __post_init__(self):
        if self.proj_dim <= 0 or self.init_temperature <= 0:
            raise ValueError(f"proj_dim and init_temperature must be > 0, got {self.proj_dim} and "
                             f"{self.init_temperature}")


@register_gate("cosine", CosineGateSettings)
class CosineGate(Gate):
    def __init__(self, model_dim: int, num_experts: int, **settings):
        super().__init__(model_dim, num_experts)
        settings = CosineGateSettings(**settings)
        proj_dim, init_temperature = settings.proj_dim, settings.init_temperature
        self.normalize = settings.normalize
        self.proj = nn.Linear(model_dim, proj_dim)
        self.expert_dirs_EP = nn.Parameter(torch.empty(num_experts, proj_dim))
        nn.init.normal_(self.expert_dirs_EP, std=0.02)
        # Learn log(1 / temperature) so the scale stays positive.
        self.log_scale = nn.Parameter(torch.tensor(math.log(1.0 / init_temperature)))

    def forward(self, x_TD: torch.Tensor, top_k: int) -> GateOutput:
        x_TD = router_float(x_TD)
        proj_TP = F.linear(x_TD, self.proj.weight.to(x_TD.dtype), self.proj.bias.to(x_TD.dtype))
        cos_TE = F.normalize(proj_TP, dim=-1) @ F.normalize(self.expert_dirs_EP.to(x_TD.dtype), dim=-1).t()
        scale = self.log_scale.clamp(max=math.log(_MAX_SCALE)).exp()
        return softmax_topk(cos_TE * scale, top_k, self.normalize)
