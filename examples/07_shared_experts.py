"""DeepSeekMoE-style layer: fine-grained SwiGLU experts plus shared experts that see every token.

    python examples/07_shared_experts.py

num_shared_experts > 0 adds a dense MLP (the shared experts fused into one, width
num_shared_experts * shared_hidden_size) applied to every token and added to the routed output:
    y = sum_k weight_k * expert_{idx_k}(x) + shared(x)
Fine-grained routing uses many small experts and a larger top_k; here the sigmoid gate with
group-limited routing (experts in n_group groups, only the topk_group best groups eligible).
"""

import torch
import torch.nn.functional as F

from moetrain import MoELayer
from moetrain.moe import is_expert_param


def naive_routed(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """The routed part, token by token: SwiGLU experts (silu(x W_gate) * x W_up) W_down."""
    routed = layer.gate(x_TD, layer.top_k)
    ex = layer.experts
    y_TD = torch.zeros_like(x_TD)
    for t in range(x_TD.size(0)):
        for k in range(layer.top_k):
            e = int(routed.topk_idx_TK[t, k])
            h_H = F.silu(x_TD[t] @ ex.w_gate[e]) * (x_TD[t] @ ex.w_up[e])
            y_TD[t] += routed.topk_weight_TK[t, k] * (h_H @ ex.w_down[e])
    return y_TD


def main(tokens=64, model_dim=32, num_experts=16, expert_hidden=16, top_k=4, num_shared_experts=2):
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer = MoELayer(model_dim=model_dim, num_experts=num_experts, hidden_size=expert_hidden, top_k=top_k,
                     expert="swiglu", num_shared_experts=num_shared_experts, capacity_factor=0,
                     gate="sigmoid", gate_kwargs={"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}).to(device)
    x_TD = torch.randn(tokens, model_dim, device=device)
    y_TD = layer(x_TD)

    with torch.no_grad():
        reference_TD = naive_routed(layer, x_TD) + layer.shared(x_TD)
    max_diff = (y_TD - reference_TD).abs().max().item()

    # Which groups were used: with topk_group=2 of 4 groups, each token's experts lie in <= 2 groups.
    idx_TK = layer.gate(x_TD, top_k).topk_idx_TK
    group_size = num_experts // 4
    groups_per_token = max(len(set((idx_TK[t] // group_size).tolist())) for t in range(tokens))

    routed_params = sum(p.numel() for p in layer.parameters() if is_expert_param(p))
    shared_params = sum(p.numel() for p in layer.shared.parameters())
    active_params = routed_params * top_k // num_experts + shared_params
    print(f"routed experts: {num_experts} x SwiGLU(hidden {expert_hidden}), top_k={top_k}; "
          f"shared MLP width {layer.shared.up_proj.out_features}")
    print(f"parameters: routed {routed_params}, shared {shared_params}, active per token {active_params}")
    print(f"max groups used by a token: {groups_per_token} (topk_group=2)")
    print(f"max |y - (naive routed loop + shared MLP)| = {max_diff:.2e}")
    return {"max_diff": max_diff, "groups_per_token": groups_per_token,
            "shared_width": layer.shared.up_proj.out_features, "expected_shared_width": num_shared_experts * expert_hidden,
            "shared_params_untagged": not any(is_expert_param(p) for p in layer.shared.parameters())}


if __name__ == "__main__":
    main()
