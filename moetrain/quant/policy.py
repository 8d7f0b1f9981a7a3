"""Which format each expert gets, and turning a model's MoE layers into quantized ones.

    policy = QuantPolicy(format="mxfp4", hot_format="fp8", hot_fraction=0.25)
    counts = calibrate(model, calibration_batches)       # tokens routed to each expert, per layer
    plan = quantize_model(model, policy, counts)          # in place; plan[i] = layer i's formats

Routing frequency decides precision: the experts that see the most tokens on calibration data
carry most of the output, so they keep the more precise format; the rest take the smaller one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from moetrain.moe import moe_layers
from moetrain.quant.experts import QuantizedExperts
from moetrain.precision.formats import get_format


@dataclass(frozen=True)
class QuantPolicy:
    """format: every expert's format, unless hot_format is set; then the hot_fraction of experts
    (per layer) with the most calibration tokens get hot_format instead."""

    format: str = "fp8"
    hot_format: str | None = None
    hot_fraction: float = 0.25

    def __post_init__(self):
        get_format(self.format)
        if self.hot_format is not None:
            get_format(self.hot_format)
        if isinstance(self.hot_fraction, bool) or not 0.0 <= self.hot_fraction <= 1.0:
            raise ValueError(f"hot_fraction must be a number in [0, 1], got {self.hot_fraction!r}")

    @property
    def needs_calibration(self) -> bool:
        return self.hot_format is not None and self.hot_format != self.format

    def expert_formats(self, num_experts: int, tokens_per_expert: torch.Tensor | None = None) -> list[str]:
        """One format name per expert of a layer."""
        if not self.needs_calibration:
            return [self.format] * num_experts
        if tokens_per_expert is None or tokens_per_expert.numel() != num_experts:
            raise ValueError(
                f"QuantPolicy(hot_format={self.hot_format!r}) needs calibration counts: pass the per-layer "
                f"tokens_per_expert from calibrate(model, batches) (a tensor of {num_experts} counts per layer)"
            )
        num_hot = round(self.hot_fraction * num_experts)
        # Stable ordering: among equally used experts the lower index wins, so plans are reproducible.
        hot = set(torch.argsort(tokens_per_expert.cpu(), descending=True, stable=True)[:num_hot].tolist())
        return [self.hot_format if e in hot else self.format for e in range(num_experts)]


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable,
              run: Callable[[nn.Module, object], object] | None = None) -> list[torch.Tensor]:
    """Tokens routed to each expert of every MoE layer over the batches (model order, int64 [E]).

    run(model, batch) runs one forward pass; by default model(batch)."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("calibrate: the model has no MoELayer")
    totals = [torch.zeros(layer.num_experts, dtype=torch.long) for layer in layers]
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            run(model, batch) if run is not None else model(batch)
            for total, layer in zip(totals, layers):
                total += layer.stats.tokens_per_expert.cpu()
    finally:
        model.train(was_training)
    return totals


def quantize_model(model: nn.Module, policy: QuantPolicy, calibration: list[torch.Tensor] | None = None) -> list[list[str]]:
    """Replace the routed experts of every MoE layer with QuantizedExperts, in place.

    calibration: calibrate()'s per-layer counts (needed when the policy has a hot_format).
    Returns the plan: for each MoE layer in model order, its experts' format names."""
    layers = moe_layers(model)
    if calibration is not None and len(calibration) != len(layers):
        raise ValueError(f"calibration has counts for {len(calibration)} MoE layers, the model has {len(layers)}")
    plan = []
    for i, layer in enumerate(layers):
        formats = policy.expert_formats(layer.num_experts, calibration[i] if calibration is not None else None)
        layer.experts = QuantizedExperts.from_experts(layer.experts, formats)
        plan.append(formats)
    return plan


def apply_plan(model: nn.Module, plan: list[list[str]]) -> None:
    """Give every MoE layer empty QuantizedExperts laid out as in plan (load_state_dict fills them)."""
    layers = moe_layers(model)
    if len(plan) != len(layers):
        raise ValueError(f"the quantization plan covers {len(plan)} MoE layers, the model has {len(layers)}")
    for layer, formats in zip(layers, plan):
        experts = layer.experts
        weight = next(experts.parameters())
        layer.experts = QuantizedExperts(type(experts), experts.num_experts, experts.model_dim, experts.hidden_size,
                                         formats, experts.act, bias_dtype=weight.dtype, device=weight.device)
