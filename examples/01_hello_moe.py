"""Hello world: one MoE layer on random tokens, forward and backward, and where the tokens went.

    python examples/01_hello_moe.py

MoELayer maps x [..., model_dim] to the same shape: a gate picks top_k of num_experts experts
for every token, the chosen experts run, and their outputs are summed with the gate's weights.
"""

import torch

from moetrain import MoELayer


def main(batch=4, seq=128, model_dim=64, num_experts=8, hidden_size=128, top_k=2):
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    layer = MoELayer(model_dim=model_dim, num_experts=num_experts, hidden_size=hidden_size, top_k=top_k,
                     capacity_factor=1.0).to(device)
    x = torch.randn(batch, seq, model_dim, device=device, requires_grad=True)
    y = layer(x)  # same shape as x

    # The auxiliary (load-balancing) loss of this call is added to whatever loss you train on.
    loss = y.square().mean() + 0.01 * layer.aux_loss
    loss.backward()

    stats = layer.stats
    print(f"device {device}: x {tuple(x.shape)} -> y {tuple(y.shape)}")
    print(f"tokens per expert {stats.tokens_per_expert.tolist()} (capacity {stats.capacity} rows each)")
    print(f"dropped {stats.dropped_fraction:.1%} of the routing choices; balance loss {float(stats.balance_loss):.3f}")

    # The same layer on the pure-torch reference path (impl="torch") computes the same function.
    reference = MoELayer(model_dim=model_dim, num_experts=num_experts, hidden_size=hidden_size, top_k=top_k,
                         capacity_factor=1.0, impl="torch").to(device)
    reference.load_state_dict(layer.state_dict())
    max_diff = (reference(x) - y).abs().max().item()
    print(f"kernel vs pure-torch path: max |difference| {max_diff:.2e}")

    return {
        "output_shape": list(y.shape),
        "input_shape": list(x.shape),
        "routed_choices": int(stats.tokens_per_expert.sum()),
        "tokens": batch * seq,
        "dropped_fraction": stats.dropped_fraction,
        "max_diff_vs_torch_path": max_diff,
        "grads_finite": bool(torch.isfinite(x.grad).all()) and all(
            bool(torch.isfinite(p.grad).all()) for p in layer.parameters() if p.grad is not None),
    }


if __name__ == "__main__":
    main()
