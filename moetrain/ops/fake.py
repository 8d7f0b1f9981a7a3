"""Shape-only ("fake") versions of the compiled operators, for torch.compile.

torch.compile traces a model with tensors that have shapes and dtypes but no data. An operator it
cannot run that way ends the traced graph (a graph break), so without these every MoE layer split a
compiled model into a dozen graphs with eager Python between them. Each function below returns
empty tensors of exactly the shapes, dtypes and devices the C++/CUDA kernel returns (csrc/).
Registered once, when moetrain.ops.load() loads the extension.
"""

from __future__ import annotations

import torch

_registered = False


def _route(expert_idx, num_experts, capacity, packed):
    n = expert_idx.numel()
    return expert_idx.new_empty(n), expert_idx.new_empty(num_experts), expert_idx.new_empty(num_experts)


def _dispatch(x, dest, num_rows):
    return x.new_empty(num_rows, x.size(1))


def _combine(buf, dest, weight):
    return buf.new_empty(dest.size(0), buf.size(1))


def _combine_backward(grad_y, buf, dest, weight, num_rows, weight_grad):
    return grad_y.new_empty(num_rows, grad_y.size(1)), weight.new_empty(dest.shape)


def _router_logits(x, w):
    return x.new_empty(x.size(0), w.size(0), dtype=torch.float32)


def _router_logits_backward(grad, x, w, x_grad, w_grad):
    return x.new_empty(x.shape if x_grad else (0,)), w.new_empty(w.shape if w_grad else (0,))


def _bias_act_(y, bias, rows_per_expert, relu):
    return None  # in place on y


def _bias_act_backward(grad, out, rows_per_expert, bias_grad):
    experts = grad.numel() // max(1, grad.size(-1)) // rows_per_expert
    return grad.new_empty(grad.shape), grad.new_empty((experts, grad.size(-1)) if bias_grad else (0,))


FAKES = {
    "route": _route,
    "dispatch": _dispatch,
    "combine": _combine,
    "combine_backward": _combine_backward,
    "router_logits": _router_logits,
    "router_logits_backward": _router_logits_backward,
    "bias_act_": _bias_act_,
    "bias_act_backward": _bias_act_backward,
}


def register() -> None:
    """Register every fake whose operator the loaded extension defines (once per process)."""
    global _registered
    if _registered:
        return
    _registered = True
    for name, fake in FAKES.items():
        if hasattr(torch.ops.moetrain, name):
            torch.library.register_fake(f"moetrain::{name}", fake)
