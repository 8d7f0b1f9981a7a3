"""Sparsity and capacity switchable per forward call, without rebuilding the layer.

    python examples/02_per_call_settings.py

layer(x, top_k=..., capacity_factor=...) overrides the layer's settings for that call only, e.g.
train with top-2 and a tight capacity, evaluate top-1 or dropless. capacity_factor (Tutel's rule):
  > 0   each expert takes at most top_k * int(cf * ceil(tokens / experts)) choices; the rest are dropped
  == 0  dropless: every choice is kept
  < 0   dropless up to top_k * int(|cf| * ceil(tokens / experts)) choices per expert
"""

import math

import torch

from moetrain import MoELayer


def main(tokens=512, model_dim=32, num_experts=8, hidden_size=64):
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer = MoELayer(model_dim=model_dim, num_experts=num_experts, hidden_size=hidden_size, top_k=2,
                     capacity_factor=1.0).to(device)
    # Skew the inputs so that the router prefers some experts: then the capacity matters.
    x = torch.randn(tokens, model_dim, device=device) + 0.5 * layer.gate.weight_ED[0].detach()

    rows = []
    print(f"{'top_k':>5} {'capacity_factor':>15} {'capacity':>8} {'dropped':>8}")
    for top_k in (1, 2, 4):
        for capacity_factor in (0.5, 1.0, 2.0, 0.0, -1.0):
            layer(x, top_k=top_k, capacity_factor=capacity_factor)
            stats = layer.stats
            limit = top_k * int(abs(capacity_factor) * math.ceil(tokens / num_experts)) if capacity_factor else None
            rows.append({"top_k": top_k, "capacity_factor": capacity_factor, "capacity": stats.capacity,
                         "expected_limit": limit, "dropped_fraction": stats.dropped_fraction,
                         "max_load": int(stats.tokens_per_expert.max()),
                         "routed_choices": int(stats.tokens_per_expert.sum())})
            print(f"{top_k:>5} {capacity_factor:>15} {stats.capacity:>8} {stats.dropped_fraction:>8.1%}")

    # The overrides did not change the layer: a plain call uses its own top_k=2, capacity_factor=1.0.
    layer(x)
    print(f"plain call: top_k {layer.top_k}, capacity_factor {layer.capacity_factor}, capacity {layer.stats.capacity}")
    return {"tokens": tokens, "rows": rows, "default_capacity": layer.stats.capacity,
            "default_expected_capacity": 2 * math.ceil(tokens / num_experts)}


if __name__ == "__main__":
    main()
