"""Aux-loss-free load balancing (DeepSeek-V3): the sigmoid gate's per-expert bias.

    python examples/06_sigmoid_bias_balance.py

The sigmoid gate adds a bias per expert to the scores it uses to *choose* experts (the combine
weights stay unbiased). After each optimizer step, moetrain.moe.update_router_biases(model) moves
every bias by bias_update_rate towards balance: up for experts that got fewer tokens than the
mean, down for busier ones. No balance loss is needed (balance_loss_weight=0 here).

Two identical runs on inputs that the router initially sends to few experts: one with the bias
update (bias_update_rate > 0), one without. The imbalance is max load / mean load (1.0 = even).
"""

import torch
import torch.nn.functional as F

from moetrain import MoELayer
from moetrain.moe import update_router_biases


def imbalance(layer: MoELayer) -> float:
    load_E = layer.stats.tokens_per_expert.float()
    return (load_E.max() / load_E.mean()).item()


def train(bias_update_rate: float, steps: int, tokens: int, model_dim: int, num_experts: int, device: str):
    torch.manual_seed(0)
    layer = MoELayer(model_dim=model_dim, num_experts=num_experts, hidden_size=2 * model_dim, top_k=2,
                     gate="sigmoid", gate_kwargs={"bias_update_rate": bias_update_rate},
                     capacity_factor=0, balance_loss_weight=0.0).to(device)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-2)
    # A shared offset along two experts' router directions makes the router favour them.
    router_ED = layer.gate.weight_ED.detach()
    offset_D = 2.0 * (router_ED[0] + router_ED[1]) / router_ED[:2].norm()
    target_map_DD = torch.randn(model_dim, model_dim, device=device) / model_dim**0.5
    history = []
    for step in range(steps):
        x_TD = torch.randn(tokens, model_dim, device=device) + offset_D
        loss = F.mse_loss(layer(x_TD), torch.tanh(x_TD @ target_map_DD))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        update_router_biases(layer)  # no-op for gates without a bias, so it is safe to always call
        history.append(imbalance(layer))
    return layer, history


def main(steps=100, tokens=256, model_dim=16, num_experts=8, bias_update_rate=0.01):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {}
    for rate in (0.0, bias_update_rate):
        layer, history = train(rate, steps, tokens, model_dim, num_experts, device)
        first, last = history[0], sum(history[-10:]) / 10
        print(f"bias_update_rate={rate:<5}: imbalance {first:.2f} -> {last:.2f}; "
              f"expert bias {[round(b, 2) for b in layer.gate.expert_bias.tolist()]}")
        results[f"rate_{rate}"] = {"first_imbalance": first, "last_imbalance": last,
                                   "bias_abs_max": layer.gate.expert_bias.abs().max().item()}
    # The bias is a buffer, not a parameter: it is saved in the state dict and gets no gradient.
    results["bias_in_state_dict"] = "gate.expert_bias" in layer.state_dict()
    results["bias_is_parameter"] = any(name.endswith("expert_bias") for name, _ in layer.named_parameters())
    return results


if __name__ == "__main__":
    main()
