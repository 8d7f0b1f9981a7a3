"""Grouped-GEMM layouts and two what-ifs for the MoE layer (GPU only): python benchmarks/diagnose.py [shape ...]

1. torch._grouped_mm, forward + backward of the two expert GEMMs (no bias, no activation), with
   the weights stored [E, in, out] (row-major B, moetrain's layout) or [E, out, in] passed
   transposed (column-major B, torchtitan's layout), against torch.bmm on the padded layout.
2. What-if for the MoE layer: the same layer with (a) the balance loss counting experts without
   a host sync and (b) the expert biases broadcast over each expert's block instead of being
   materialised per row: the gains those two changes would bring, measured in one run.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import layer as bench  # benchmarks/layer.py (this script's folder): python -m moetrain.bench
from moetrain import timing
from moetrain.moe import experts as experts_module
from moetrain.moe import losses
from moetrain.ops.grouped import add_expert_bias, expert_matmul


def gemm_layouts(shape: bench.Shape, device: torch.device) -> dict:
    torch.manual_seed(0)
    rows = shape.tokens * shape.top_k
    capacity = rows // shape.num_experts
    e, d, h = shape.num_experts, shape.model_dim, shape.hidden_size
    x = torch.randn(rows, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(e, d, h, device=device, dtype=torch.bfloat16) * d**-0.5).requires_grad_()
    w2 = (torch.randn(e, h, d, device=device, dtype=torch.bfloat16) * h**-0.5).requires_grad_()
    w1t = w1.detach().transpose(1, 2).contiguous().requires_grad_()
    w2t = w2.detach().transpose(1, 2).contiguous().requires_grad_()
    # Uneven groups, as routing gives: counts drawn around the mean, summing to rows.
    counts = torch.distributions.Dirichlet(torch.full((e,), 20.0)).sample() * rows
    counts = counts.floor().long()
    counts[-1] += rows - counts.sum()
    offs = torch.cumsum(counts, 0).to(device=device, dtype=torch.int32)

    def grouped_row_major(x):
        return torch._grouped_mm(F.relu(torch._grouped_mm(x, w1, offs=offs)), w2, offs=offs)

    def grouped_col_major(x):
        return torch._grouped_mm(F.relu(torch._grouped_mm(x, w1t.transpose(1, 2), offs=offs)), w2t.transpose(1, 2),
                                 offs=offs)

    def padded_bmm(x):
        x_ECD = x.view(e, capacity, d)
        return torch.bmm(F.relu(torch.bmm(x_ECD, w1)), w2).view(rows, d)

    flops = shape.useful_flops()
    out = {}
    for name, fn, params in (("grouped_mm row-major B", grouped_row_major, [w1, w2]),
                             ("grouped_mm col-major B", grouped_col_major, [w1t, w2t]),
                             ("bmm padded", padded_bmm, [w1, w2])):
        ms = timing.median_ms(bench._forward_backward(fn, x, params), device, 3, 10)
        out[name] = flops / (ms * 1e-3) / 1e12
    return out


def balance_loss_without_sync(probs_TE: torch.Tensor, topk_idx_TK: torch.Tensor) -> torch.Tensor:
    num_experts = probs_TE.size(-1)
    idx_N = topk_idx_TK.reshape(-1)
    counts_E = torch.zeros(num_experts, dtype=probs_TE.dtype, device=probs_TE.device)
    counts_E.index_add_(0, idx_N, torch.ones_like(idx_N, dtype=probs_TE.dtype))
    return num_experts * torch.sum(counts_E / idx_N.numel() * probs_TE.mean(0))


def ffn_forward_broadcast_bias(self, x_RD, counts_E, capacity):
    h_RH = expert_matmul(x_RD, self.w1, counts_E, capacity)
    h_RH = self.act(add_expert_bias(h_RH, self.b1, counts_E, capacity))
    return add_expert_bias(expert_matmul(h_RH, self.w2, counts_E, capacity), self.b2, counts_E, capacity)


def layer_what_if(shape: bench.Shape, device: torch.device) -> dict:
    torch.manual_seed(1)
    x = torch.randn(shape.tokens, shape.model_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    layer = bench.build_layer(shape, device, torch.bfloat16, 1.0, impl="kernel")
    params = list(layer.parameters())
    original = (losses.balance_loss, experts_module.FFNExperts.forward)
    out = {}
    for variant in ("as is", "no sync", "no sync + broadcast bias"):
        if variant != "as is":
            losses.balance_loss = balance_loss_without_sync
        if variant == "no sync + broadcast bias":
            experts_module.FFNExperts.forward = ffn_forward_broadcast_bias
        for cf in (1.0, 0.0):
            ms = timing.median_ms(bench._forward_backward(lambda x: layer(x, capacity_factor=cf), x, params), device,
                                   5, 20)
            out[f"{variant}, cf={cf:g}"] = shape.useful_flops() / (ms * 1e-3) / 1e12
    losses.balance_loss, experts_module.FFNExperts.forward = original
    return out


def main() -> None:
    device = torch.device("cuda")
    names = sys.argv[1:] or list(bench.GPU_SHAPES)
    for name in names:
        shape = bench.GPU_SHAPES[name]
        for title, numbers in (("expert GEMMs only", gemm_layouts(shape, device)),
                               ("MoE layer", layer_what_if(shape, device))):
            print(f"{name} {title}: " + ", ".join(f"{k} {v:.0f}" for k, v in numbers.items()) + " TFLOP/s",
                  flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
