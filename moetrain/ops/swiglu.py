"""Gated activations on the fused gate/up GEMM output: h = act(g) * u (SwiGLU when act is SiLU).

Gated experts (SwiGLUExperts) run one GEMM against weights whose output columns alternate gate and
up: column 2j is gate unit j, column 2j+1 is up unit j. The pair a hidden unit needs is then
adjacent in memory, so [R, 2H] read flat is R*H (gate, up) pairs and the activation is one
elementwise pass over them, whatever the row count or the layout of the rows.

On CUDA, SiLU runs as a Triton kernel, forward and backward each one read and one write, in fp32
registers with one rounding to the output dtype (torch's ops round silu(g) before the product and
write three tensors for the backward). Every other case, and impl="torch", is torch's ops on the
same pairs: the same function, rounded at each step. Both are differentiable in gate_up.

Shape letters: R rows, H hidden units (2H interleaved gate/up columns).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # without Triton, CUDA tensors take the torch path (see gated_activation)
    triton = None

from moetrain.ops.launch import on_device_of

log = logging.getLogger("moetrain")

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}
_PAIRS_PER_PROGRAM = 1024


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up columns of an interleaved [..., 2H] tensor, as strided views [..., H]."""
    return gate_up[..., 0::2], gate_up[..., 1::2]


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[..., H] gate and up -> [..., 2H] with their columns alternating (the inverse of split_gate_up)."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def reference(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(g) * u with torch's ops -> [..., H]."""
    gate, up = split_gate_up(gate_up)
    return ACTIVATIONS[activation](gate) * up


if triton is not None:

    @triton.jit
    def _swiglu_forward_kernel(gate_up_ptr, h_ptr, pairs, BLOCK: tl.constexpr):
        index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = index < pairs
        both = tl.arange(0, 2)
        gu = tl.load(gate_up_ptr + 2 * index[:, None] + both[None, :], mask=mask[:, None]).to(tl.float32)
        gate, up = tl.split(gu)
        h = gate * tl.sigmoid(gate) * up
        tl.store(h_ptr + index, h.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_backward_kernel(grad_h_ptr, gate_up_ptr, grad_gate_up_ptr, pairs, BLOCK: tl.constexpr):
        index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = index < pairs
        both = tl.arange(0, 2)
        pair_offsets = 2 * index[:, None] + both[None, :]
        gu = tl.load(gate_up_ptr + pair_offsets, mask=mask[:, None]).to(tl.float32)
        gate, up = tl.split(gu)
        grad_h = tl.load(grad_h_ptr + index, mask=mask).to(tl.float32)
        sig = tl.sigmoid(gate)
        grad_up = grad_h * gate * sig
        # d silu(g) / dg = sig(g) * (1 + g * (1 - sig(g)))
        grad_gate = grad_h * up * sig * (1.0 + gate * (1.0 - sig))
        grad = tl.join(grad_gate, grad_up).to(grad_gate_up_ptr.dtype.element_ty)
        tl.store(grad_gate_up_ptr + pair_offsets, grad, mask=mask[:, None])


def _grid(pairs: int):
    return (triton.cdiv(pairs, _PAIRS_PER_PROGRAM),)


def _check(gate_up: torch.Tensor) -> None:
    if gate_up.dim() != 2 or gate_up.size(1) % 2:
        raise ValueError(f"gate_up must be [rows, 2 * hidden] (gate and up columns interleaved), got {tuple(gate_up.shape)}")


@torch.library.custom_op("moetrain::swiglu", mutates_args=(), device_types="cuda")
def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    h = gate_up.new_empty(gate_up.size(0), gate_up.size(1) // 2)
    pairs = h.numel()
    if pairs:
        with on_device_of(gate_up):
            _swiglu_forward_kernel[_grid(pairs)](gate_up, h, pairs, BLOCK=_PAIRS_PER_PROGRAM)
    return h


@_swiglu.register_fake
def _(gate_up):
    return gate_up.new_empty(gate_up.size(0), gate_up.size(1) // 2)


@torch.library.custom_op("moetrain::swiglu_backward", mutates_args=(), device_types="cuda")
def _swiglu_backward(grad_h: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    grad_gate_up = torch.empty_like(gate_up)
    pairs = grad_h.numel()
    if pairs:
        with on_device_of(gate_up):
            _swiglu_backward_kernel[_grid(pairs)](grad_h, gate_up, grad_gate_up, pairs, BLOCK=_PAIRS_PER_PROGRAM)
    return grad_gate_up


@_swiglu_backward.register_fake
def _(grad_h, gate_up):
    return torch.empty_like(gate_up)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad_h):
    (gate_up,) = ctx.saved_tensors
    return _swiglu_backward(grad_h.contiguous(), gate_up)


_swiglu.register_autograd(_backward, setup_context=_setup_context)


_warned: list[bool] = []


def kernel_runs(gate_up: torch.Tensor, activation: str) -> bool:
    """Whether gated_activation(impl="kernel") runs the Triton kernel on this input."""
    return (activation == "silu" and gate_up.is_cuda and triton is not None and gate_up.dim() == 2
            and gate_up.dtype in (torch.bfloat16, torch.float16, torch.float32))


def gated_activation(gate_up: torch.Tensor, activation: str = "silu", impl: str = "kernel") -> torch.Tensor:
    """act(g) * u for [R, 2H] gate/up columns interleaved -> [R, H]; differentiable in gate_up.

    impl="kernel" runs the Triton kernel where kernel_runs() says so (CUDA, SiLU); everything else
    computes reference() with torch's ops."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    _check(gate_up)
    if impl == "kernel" and kernel_runs(gate_up, activation):
        return _swiglu(gate_up.contiguous())
    if impl == "kernel" and gate_up.is_cuda and triton is None and not _warned and not torch.compiler.is_compiling():
        _warned.append(True)
        log.warning("moetrain: the SwiGLU activation runs as torch ops on CUDA: Triton is not installed "
                    "(pip install triton for the fused kernel)")
    return reference(gate_up, activation)
