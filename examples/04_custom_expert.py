"""Experts of your own: subclass Experts, implement forward on the expert-major buffer.

    python examples/04_custom_expert.py

The interface (docs/extending.md): an Experts subclass is built as
Cls(num_experts, model_dim, hidden_size, activation=...) and forward(x_RD, counts_E, capacity)
maps the dispatched rows to outputs of the same shape. Expert e's rows are one contiguous block:
  capacity is an int  (padded layout)  rows [e * capacity, e * capacity + counts_E[e])
  capacity is None    (packed layout)  rows [sum(counts_E[:e]), sum(counts_E[:e + 1]))
Rows outside those blocks are padding; their outputs are never read.
moetrain.ops.grouped.expert_matmul multiplies each block by its expert's matrix in one call.
"""

import torch
import torch.nn.functional as F
from torch import nn

from moetrain import MoELayer
from moetrain.moe import Experts, is_expert_param
from moetrain.ops.grouped import expert_matmul


class LowRankExperts(Experts):
    """Bottleneck adapter experts: y = act(x @ down[e]) @ up[e] * scale[e], with hidden_size as the
    (small) rank. A mixture of such adapters is cheap to add next to a frozen dense FFN."""

    def __init__(self, num_experts: int, model_dim: int, hidden_size: int, activation: str = "gelu"):
        super().__init__(num_experts, model_dim, hidden_size)
        self.act = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}[activation]
        self.down_EDH = nn.Parameter(torch.randn(num_experts, model_dim, hidden_size) * model_dim**-0.5)
        self.up_EHD = nn.Parameter(torch.randn(num_experts, hidden_size, model_dim) * hidden_size**-0.5)
        self.scale_E = nn.Parameter(torch.ones(num_experts))
        # Tag every routed-expert parameter: the distributed optimizer reduces these only across the
        # ranks holding the same expert, and expert parallelism shards them.
        for param in self.parameters():
            param.moe_expert = True

    def forward(self, x_RD: torch.Tensor, counts_E: torch.Tensor, capacity: int | None) -> torch.Tensor:
        h_RH = self.act(expert_matmul(x_RD, self.down_EDH, counts_E, capacity))
        y_RD = expert_matmul(h_RH, self.up_EHD, counts_E, capacity)
        # Each row's expert, to apply the per-expert scale (padding rows go to the last expert).
        if capacity is not None:
            expert_R = torch.arange(self.num_experts, device=x_RD.device).repeat_interleave(capacity)
        else:
            ends_E = torch.cumsum(counts_E, 0)
            rows_R = torch.arange(x_RD.size(0), device=x_RD.device)
            expert_R = torch.searchsorted(ends_E, rows_R, right=True).clamp(max=self.num_experts - 1)
        return y_RD * self.scale_E[expert_R].unsqueeze(-1).to(y_RD.dtype)


def naive_moe(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert (the reference when nothing is dropped)."""
    routed = layer.gate(x_TD, layer.top_k)
    ex = layer.experts
    y_TD = torch.zeros_like(x_TD)
    for t in range(x_TD.size(0)):
        for k in range(layer.top_k):
            e = int(routed.topk_idx_TK[t, k])
            y_TD[t] += routed.topk_weight_TK[t, k] * ex.act(x_TD[t] @ ex.down_EDH[e]) @ ex.up_EHD[e] * ex.scale_E[e]
    return y_TD


def main(tokens=64, model_dim=16, num_experts=4, rank=4, top_k=2):
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x_TD = torch.randn(tokens, model_dim, device=device)

    # Pass the class (built with the layer's sizes) or an instance you configured yourself.
    layer = MoELayer(model_dim=model_dim, num_experts=num_experts, hidden_size=rank, top_k=top_k,
                     expert=LowRankExperts, activation="gelu").to(device)
    with torch.no_grad():
        layer.experts.scale_E.uniform_(0.5, 2.0)  # make the scales differ, so a wrong row -> expert map shows

    results = {"expert_params_tagged": all(is_expert_param(p) for p in layer.experts.parameters()),
               "gate_params_untagged": not any(is_expert_param(p) for p in layer.gate.parameters())}
    # Both buffer layouts: padded (a capacity; 4.0 is large enough that nothing is dropped) and packed.
    for capacity_factor in (4.0, 0.0):
        y_TD = layer(x_TD, capacity_factor=capacity_factor)
        with torch.no_grad():
            max_diff = (y_TD - naive_moe(layer, x_TD)).abs().max().item()
        layout = "padded" if capacity_factor > 0 else "packed"
        print(f"{layout} layout: dropped {layer.stats.dropped_fraction:.0%}, max |y - naive loop| {max_diff:.2e}")
        results[layout] = {"max_diff": max_diff, "dropped_fraction": layer.stats.dropped_fraction}

    y_TD = layer(x_TD)
    y_TD.sum().backward()
    results["scale_grad_nonzero"] = bool((layer.experts.scale_E.grad != 0).any())
    print(f"experts: {type(layer.experts).__name__}, all expert parameters tagged: {results['expert_params_tagged']}")
    return results


if __name__ == "__main__":
    main()
