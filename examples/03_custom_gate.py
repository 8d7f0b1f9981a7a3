"""A gate (router) of your own: subclass Gate, implement forward, pass it to MoELayer.

    python examples/03_custom_gate.py

The interface (docs/extending.md): a Gate is built as Cls(model_dim, num_experts, **gate_kwargs),
and forward(x_TD, top_k) returns a GateOutput with fp32 logits_TE, probs_TE (the balance loss
reads them), int64 topk_idx_TK and fp32 topk_weight_TK (T tokens, E experts, K = top_k).
The same class works from the command line: gate._target_=your_module.YourGate (docs/extending.md).
"""

import torch
import torch.nn.functional as F
from torch import nn

from moetrain import MoELayer
from moetrain.moe import Gate, GateOutput, register_gate


class TemperatureGate(Gate):
    """Softmax top-k router with a per-expert bias and a fixed temperature; the k weights are
    renormalised to sum to one. A higher temperature spreads the probabilities."""

    def __init__(self, model_dim: int, num_experts: int, temperature: float = 1.0):
        super().__init__(model_dim, num_experts)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self.router = nn.Linear(model_dim, num_experts)

    def forward(self, x_TD: torch.Tensor, top_k: int) -> GateOutput:
        # Route in fp32 even under bf16 autocast: top-k on low-precision logits flips choices.
        x_TD = x_TD.float()
        logits_TE = F.linear(x_TD, self.router.weight.float(), self.router.bias.float()) / self.temperature
        probs_TE = torch.softmax(logits_TE, dim=-1)
        weight_TK, idx_TK = probs_TE.topk(top_k, dim=-1)
        return GateOutput(logits_TE, probs_TE, idx_TK, weight_TK / weight_TK.sum(-1, keepdim=True))


def naive_moe(layer: MoELayer, x_TD: torch.Tensor, top_k: int) -> torch.Tensor:
    """Token by token, expert by expert: the reference the layer must match when nothing is dropped."""
    routed = layer.gate(x_TD, top_k)
    experts = layer.experts
    y_TD = torch.zeros_like(x_TD)
    for t in range(x_TD.size(0)):
        for k in range(top_k):
            e = int(routed.topk_idx_TK[t, k])
            h_H = experts.act(x_TD[t] @ experts.w1[e] + experts.b1[e])
            y_TD[t] += routed.topk_weight_TK[t, k] * (h_H @ experts.w2[e] + experts.b2[e])
    return y_TD


def main(tokens=64, model_dim=16, num_experts=4, hidden_size=32, top_k=2):
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x_TD = torch.randn(tokens, model_dim, device=device)
    common = dict(model_dim=model_dim, num_experts=num_experts, hidden_size=hidden_size, top_k=top_k,
                  capacity_factor=0)  # dropless, so the naive loop is the exact reference

    # 1. Pass the class; gate_kwargs go to its constructor.
    by_class = MoELayer(gate=TemperatureGate, gate_kwargs={"temperature": 2.0}, **common).to(device)
    # 2. Pass a ready instance (e.g. shared between layers, or built with extra objects).
    by_instance = MoELayer(gate=TemperatureGate(model_dim, num_experts, temperature=0.5), **common).to(device)
    # 3. Register it under a name; then gate="temperature" works like the built-in "top".
    register_gate("temperature")(TemperatureGate)
    by_name = MoELayer(gate="temperature", gate_kwargs={"temperature": 1.0}, **common).to(device)

    results = {}
    for label, layer in (("class", by_class), ("instance", by_instance), ("name", by_name)):
        y_TD = layer(x_TD)
        with torch.no_grad():
            max_diff = (y_TD - naive_moe(layer, x_TD, top_k)).abs().max().item()
        gate_type = type(layer.gate).__name__
        print(f"gate by {label:8}: {gate_type}(temperature={layer.gate.temperature}), "
              f"tokens per expert {layer.stats.tokens_per_expert.tolist()}, max |y - naive loop| {max_diff:.2e}")
        results[label] = {"gate_type": gate_type, "temperature": layer.gate.temperature, "max_diff": max_diff}

    # The gate is an ordinary module: its parameters train with the rest (and get gradients).
    y_TD = by_class(x_TD)
    (y_TD.square().mean() + by_class.aux_loss).backward()
    router_grad = by_class.gate.router.weight.grad.abs().sum().item()
    print(f"sum of |router weight gradient|: {router_grad:.3e}")
    results["router_grad_abs_sum"] = router_grad
    return results


if __name__ == "__main__":
    main()
