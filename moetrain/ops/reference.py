"""Pure-torch reference implementations of the kernels in csrc/ (selected with impl="torch").

They define what the kernels compute; the tests compare the two on random inputs. Autograd comes
from torch itself here. Shape letters as in moetrain/moe/routing.py.
"""

from __future__ import annotations

import math

import torch


def opmath_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the kernels accumulate and take gate weights in: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def route(expert_idx_N: torch.Tensor, num_experts: int, capacity: int, packed: bool):
    """Slot of each routing entry (given in priority order) inside its expert; see csrc/bindings.cpp."""
    n = expert_idx_N.numel()
    load_E = torch.bincount(expert_idx_N, minlength=num_experts)
    # A stable sort keeps priority order inside each expert, so the rank within the expert is the slot.
    order_N = torch.sort(expert_idx_N, stable=True).indices
    start_E = torch.cumsum(load_E, 0) - load_E
    slot_N = torch.empty_like(expert_idx_N)
    slot_N[order_N] = torch.arange(n, device=expert_idx_N.device) - start_E[expert_idx_N[order_N]]
    cap = n if capacity < 0 else capacity
    kept_E = load_E.clamp(max=cap)
    base_E = torch.cumsum(kept_E, 0) - kept_E if packed else torch.arange(num_experts, device=expert_idx_N.device) * cap
    dest_N = torch.where(slot_N < cap, base_E[expert_idx_N] + slot_N, torch.full_like(slot_N, -1))
    return dest_N, load_E, kept_E


def dispatch(x_TD: torch.Tensor, dest_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """buf[dest[t, k]] = x[t]; rows nobody writes are zero."""
    k = dest_TK.size(1)
    flat_N = dest_TK.reshape(-1)
    valid_N = flat_N >= 0
    token_N = torch.arange(flat_N.numel(), device=flat_N.device) // k
    buf_RD = x_TD.new_zeros(num_rows, x_TD.size(1))
    return buf_RD.index_copy(0, flat_N[valid_N], x_TD[token_N[valid_N]])


def combine(buf_RD: torch.Tensor, dest_TK: torch.Tensor, weight_TK: torch.Tensor | None) -> torch.Tensor:
    """y[t] = sum_k weight[t, k] * buf[dest[t, k]], skipping dropped entries (dest == -1)."""
    valid_TK = dest_TK >= 0
    scale_TK = valid_TK.to(opmath_dtype(buf_RD.dtype))
    if weight_TK is not None:
        scale_TK = scale_TK * weight_TK
    gathered_TKD = buf_RD[dest_TK.clamp(min=0)]
    y_TD = (gathered_TKD.to(scale_TK.dtype) * scale_TK.unsqueeze(-1)).sum(1)
    return y_TD.to(buf_RD.dtype)


def bias_act(y_RO: torch.Tensor, b_EO: torch.Tensor, rows_per_expert: int, relu: bool) -> torch.Tensor:
    """act(y[r] + b[r // rows_per_expert]) for the padded layout (act = relu or identity)."""
    num_experts, out_dim = b_EO.shape
    out = (y_RO.view(num_experts, rows_per_expert, out_dim) + b_EO.unsqueeze(1)).view_as(y_RO)
    return torch.relu(out) if relu else out


def bias_act_backward(grad_RO: torch.Tensor, out_RO: torch.Tensor | None, rows_per_expert: int, bias_grad: bool):
    """(grad_in, grad_bias) of bias_act from the forward's output (out=None: identity). grad_bias [E, O]
    sums each expert's rows of grad_in in fp32 (fp64 for fp64) and rounds once; empty without bias_grad."""
    grad_in_RO = grad_RO if out_RO is None else torch.ops.aten.threshold_backward(grad_RO, out_RO, 0)
    if not bias_grad:
        return grad_in_RO, grad_RO.new_empty(0)
    out_dim = grad_RO.size(-1)
    rows = math.prod(grad_RO.shape[:-1])
    grad_in_ECO = grad_in_RO.reshape(rows // rows_per_expert, rows_per_expert, out_dim)
    return grad_in_RO, grad_in_ECO.sum(1, dtype=opmath_dtype(grad_RO.dtype)).to(grad_RO.dtype)


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """Router logits computed in fp32 (fp64 stays fp64) whatever x's dtype."""
    dtype = torch.promote_types(x_TD.dtype, torch.float32)
    return x_TD.to(dtype) @ w_ED.to(dtype).t()
