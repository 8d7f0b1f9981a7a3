"""An MoE layer inside your own nn.Module, trained with a plain PyTorch loop.

    python examples/05_train_own_module.py

The task has structure that experts can split: every input belongs to one of a few clusters and
each cluster has its own target map. The model is a residual block whose FFN is an MoELayer; the
training loss is the task loss plus the layer's load-balancing loss (layer.aux_loss).
"""

import torch
import torch.nn.functional as F
from torch import nn

from moetrain import MoELayer
from moetrain.moe import moe_layers


class TinyMoENet(nn.Module):
    def __init__(self, in_dim: int, model_dim: int, out_dim: int, num_experts: int):
        super().__init__()
        self.embed = nn.Linear(in_dim, model_dim)
        self.norm = nn.LayerNorm(model_dim)
        self.moe = MoELayer(model_dim=model_dim, num_experts=num_experts, hidden_size=2 * model_dim, top_k=2,
                            capacity_factor=1.25, activation="gelu", balance_loss_weight=0.01)
        self.head = nn.Linear(model_dim, out_dim)

    def forward(self, x_BI: torch.Tensor) -> torch.Tensor:
        h_BD = self.embed(x_BI)
        h_BD = h_BD + self.moe(self.norm(h_BD))  # pre-norm residual, as in a transformer block
        return self.head(h_BD)


def make_task(num_clusters: int, in_dim: int, out_dim: int, generator: torch.Generator):
    centers_CI = 3 * torch.randn(num_clusters, in_dim, generator=generator)
    maps_CIO = torch.randn(num_clusters, in_dim, out_dim, generator=generator)

    def batch(size: int):
        cluster_B = torch.randint(num_clusters, (size,), generator=generator)
        x_BI = centers_CI[cluster_B] + torch.randn(size, in_dim, generator=generator)
        y_BO = torch.tanh(torch.einsum("bi,bio->bo", x_BI, maps_CIO[cluster_B]))
        return x_BI, y_BO

    return batch


def main(steps=100, batch_size=128, in_dim=8, model_dim=32, out_dim=4, num_experts=4, lr=3e-3):
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = make_task(num_clusters=num_experts, in_dim=in_dim, out_dim=out_dim,
                      generator=torch.Generator().manual_seed(1))
    model = TinyMoENet(in_dim, model_dim, out_dim, num_experts).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    x_eval, y_eval = (t.to(device) for t in batch(512))

    def eval_loss() -> float:
        model.eval()
        with torch.no_grad():
            loss = F.mse_loss(model(x_eval), y_eval).item()
        model.train()
        return loss

    first_eval = eval_loss()
    task_losses = []
    for step in range(steps):
        x_BI, y_BO = (t.to(device) for t in batch(batch_size))
        task_loss = F.mse_loss(model(x_BI), y_BO)
        # Sum the aux losses of every MoE layer of the model (one here).
        aux_loss = sum(layer.aux_loss for layer in moe_layers(model))
        optimizer.zero_grad(set_to_none=True)
        (task_loss + aux_loss).backward()
        optimizer.step()
        task_losses.append(task_loss.item())
        if step % 50 == 0 or step == steps - 1:
            stats = model.moe.stats
            print(f"step {step:4d}  task loss {task_loss.item():.4f}  aux {aux_loss.item():.4f}  "
                  f"tokens per expert {stats.tokens_per_expert.tolist()}  dropped {stats.dropped_fraction:.1%}")

    last_eval = eval_loss()
    print(f"held-out loss {first_eval:.4f} -> {last_eval:.4f}")
    return {"first_eval_loss": first_eval, "last_eval_loss": last_eval,
            "first_train_loss": task_losses[0], "last_train_loss": sum(task_losses[-10:]) / 10}


if __name__ == "__main__":
    main()
