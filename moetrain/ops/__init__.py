"""Routing, dispatch and combine operators, with a kernel path (csrc/) and a pure-torch path.

`impl="kernel"` runs moetrain._C (C++ on CPU tensors, CUDA on GPU tensors); `impl="torch"` runs
moetrain.ops.reference. Both compute the same function; dispatch and combine are differentiable.
"""

from __future__ import annotations

import torch

from moetrain.ops import reference
from moetrain.ops.extension import ExtensionUnavailable, has_cuda_kernels, load

IMPLS = ("kernel", "torch")

__all__ = [
    "IMPLS", "ExtensionUnavailable", "bias_act", "check_impl", "combine", "dispatch", "has_cuda_kernels", "load", "route",
    "router_logits",
]


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def _kernels(device: torch.device):
    load()
    if device.type == "cuda" and not has_cuda_kernels():
        raise ExtensionUnavailable(
            "moetrain._C was built without CUDA kernels, so it cannot run on CUDA tensors: rebuild on a "
            "machine with nvcc (MOETRAIN_CUDA=1 pip install --no-build-isolation -e .) or pass impl='torch'"
        )
    return torch.ops.moetrain


def route(expert_idx_N: torch.Tensor, num_experts: int, capacity: int, packed: bool, impl: str = "kernel"):
    """Routing entries in priority order -> (dest_N, load_E, kept_E). capacity < 0: unlimited."""
    if check_impl(impl) == "torch":
        return reference.route(expert_idx_N, num_experts, capacity, packed)
    return _kernels(expert_idx_N.device).route(expert_idx_N.contiguous(), num_experts, capacity, packed)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, dest_TK, num_rows):
        ctx.save_for_backward(dest_TK)
        return torch.ops.moetrain.dispatch(x_TD, dest_TK, num_rows)

    @staticmethod
    def backward(ctx, grad_RD):
        (dest_TK,) = ctx.saved_tensors
        return sum_copies(grad_RD, dest_TK), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf_RD, dest_TK, weight_TK):
        ctx.save_for_backward(buf_RD, dest_TK, weight_TK)
        return torch.ops.moetrain.combine(buf_RD, dest_TK, weight_TK)

    @staticmethod
    def backward(ctx, grad_TD):
        buf_RD, dest_TK, weight_TK = ctx.saved_tensors
        grad_buf, grad_weight = torch.ops.moetrain.combine_backward(
            grad_TD.contiguous(), buf_RD, dest_TK, weight_TK, buf_RD.size(0), ctx.needs_input_grad[2]
        )
        return grad_buf, None, (grad_weight if ctx.needs_input_grad[2] else None)


def dispatch(x_TD: torch.Tensor, dest_TK: torch.Tensor, num_rows: int, impl: str = "kernel") -> torch.Tensor:
    """Gather tokens into the expert-major buffer [num_rows, D] (see csrc/bindings.cpp)."""
    if check_impl(impl) == "torch":
        return reference.dispatch(x_TD, dest_TK, num_rows)
    _kernels(x_TD.device)
    return _Dispatch.apply(x_TD.contiguous(), dest_TK.contiguous(), num_rows)


def sum_copies(grad_RD: torch.Tensor, dest_TK: torch.Tensor, impl: str = "kernel") -> torch.Tensor:
    """Dispatch's backward: each token's gradient is the sum of its copies' rows -> [T, D] (a combine
    without weights; not differentiable)."""
    if check_impl(impl) == "torch":
        return reference.combine(grad_RD, dest_TK, None)
    _kernels(grad_RD.device)
    return torch.ops.moetrain.combine(grad_RD.contiguous(), dest_TK.contiguous(), None)


def combine(buf_RD: torch.Tensor, dest_TK: torch.Tensor, weight_TK: torch.Tensor, impl: str = "kernel") -> torch.Tensor:
    """Gate-weighted sum of each token's expert outputs back in token order -> [T, D]."""
    if check_impl(impl) == "torch":
        return reference.combine(buf_RD, dest_TK, weight_TK)
    _kernels(buf_RD.device)
    return _Combine.apply(buf_RD.contiguous(), dest_TK.contiguous(), weight_TK.to(reference.opmath_dtype(buf_RD.dtype)).contiguous())


class _BiasAct(torch.autograd.Function):
    """In place on y (the expert GEMM's output, which that GEMM's backward does not need)."""

    @staticmethod
    def forward(ctx, y_RO, b_EO, rows_per_expert, relu):
        ctx.mark_dirty(y_RO)
        torch.ops.moetrain.bias_act_(y_RO, b_EO, rows_per_expert, relu)
        ctx.relu, ctx.rows_per_expert = relu, rows_per_expert
        ctx.save_for_backward(y_RO if relu else None)
        return y_RO  # the input itself (torch.compile requires it of an in-place Function)

    @staticmethod
    def backward(ctx, grad_RO):
        (out_RO,) = ctx.saved_tensors
        bias_grad = ctx.needs_input_grad[1]
        if grad_RO.is_cuda and bias_grad:
            # One pass: the ReLU mask and the bias gradient summed from the values it writes (two
            # ATen passes read the gradient twice, the second at under half the bandwidth).
            grad_in, grad_b = torch.ops.moetrain.bias_act_backward(
                grad_RO.contiguous(), out_RO if ctx.relu else None, ctx.rows_per_expert, True)
            return (grad_in if ctx.relu else grad_RO), grad_b, None, None
        # On the CPU ATen's vectorised threshold_backward and sum are the faster pair.
        if ctx.relu:  # relu(z) > 0 exactly where z > 0, so the output is the mask
            grad_RO = torch.ops.aten.threshold_backward(grad_RO, out_RO, 0)
        grad_b = None
        if bias_grad:
            grad_b = grad_RO.reshape(-1, ctx.rows_per_expert, grad_RO.size(-1)).sum(1)
        return grad_RO, grad_b, None, None


def bias_act(y_RO: torch.Tensor, b_EO: torch.Tensor, rows_per_expert: int, relu: bool, impl: str = "kernel") -> torch.Tensor:
    """act(y[r] + b[r // rows_per_expert]), act = relu or identity: the expert epilogue of the padded
    layout (E blocks of rows_per_expert rows). The kernel path works in place on y, so y must not
    be needed elsewhere (a GEMM's fresh output)."""
    if check_impl(impl) == "torch":
        return reference.bias_act(y_RO, b_EO, rows_per_expert, relu)
    # Checked here, before autograd marks y as modified in place.
    if b_EO.dim() != 2 or b_EO.size(1) != y_RO.size(-1) or b_EO.dtype != y_RO.dtype:
        raise ValueError(f"bias_act: bias must be [experts, {y_RO.size(-1)}] of dtype {y_RO.dtype}, "
                         f"got {tuple(b_EO.shape)} {b_EO.dtype}")
    if rows_per_expert < 1 or y_RO.numel() != b_EO.size(0) * rows_per_expert * y_RO.size(-1):
        raise ValueError(f"bias_act: y has {y_RO.numel() // max(1, y_RO.size(-1))} rows; expected experts * "
                         f"rows_per_expert = {b_EO.size(0)} * {rows_per_expert}")
    _kernels(y_RO.device)
    return _BiasAct.apply(y_RO.contiguous(), b_EO.contiguous(), rows_per_expert, relu)


class _RouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w_ED):
        ctx.save_for_backward(x_TD, w_ED)
        return torch.ops.moetrain.router_logits(x_TD, w_ED)

    @staticmethod
    def backward(ctx, grad_TE):
        x_TD, w_ED = ctx.saved_tensors
        grad_x, grad_w = torch.ops.moetrain.router_logits_backward(
            grad_TE, x_TD, w_ED, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return (grad_x if ctx.needs_input_grad[0] else None), (grad_w if ctx.needs_input_grad[1] else None)


# Up to this many experts the router kernels beat torch's cast + fp32 GEMMs (H200: 8 and 16 experts
# gain 0.3-0.5 ms a step; at 64, with a token per warp re-reading the weights, they lost ~1 ms).
ROUTER_KERNEL_MAX_EXPERTS = 16


def _router_kernel_fits(x_TD: torch.Tensor, w_ED: torch.Tensor) -> bool:
    return (x_TD.is_cuda and x_TD.dim() == 2 and x_TD.dtype in (torch.bfloat16, torch.float16)
            and w_ED.dtype == torch.float32 and w_ED.size(0) <= ROUTER_KERNEL_MAX_EXPERTS and x_TD.size(1) % 8 == 0)


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor, impl: str = "kernel") -> torch.Tensor:
    """float(x) @ w.T in fp32 -> [T, E]: a router's logits. On CUDA, for 16-bit x, fp32 w,
    E <= ROUTER_KERNEL_MAX_EXPERTS and D % 8 == 0, the kernel path reads x once in its own dtype (no
    fp32 copy of x, no thin fp32 GEMMs); everything else, and impl="torch", computes
    reference.router_logits. (The op itself takes up to 64 experts; past 16 torch is faster.)"""
    if check_impl(impl) == "torch" or not _router_kernel_fits(x_TD, w_ED):
        return reference.router_logits(x_TD, w_ED)
    _kernels(x_TD.device)
    return _RouterLogits.apply(x_TD, w_ED)
