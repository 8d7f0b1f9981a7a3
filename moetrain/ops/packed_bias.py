"""Expert bias (+ ReLU) on the packed layout's GEMM output in one pass: out[r] = act(y[r] + b[e(r)]).

In the packed (dropless) layout expert e owns the rows between the cumulative counts, so each row's
bias must be found before it is added. torch adds it as one_hot_RE @ b_EO in a GEMM epilogue
(addmm) and applies ReLU in a second pass; on an H200 that GEMM moves the output at about a third of
the memory bandwidth. Here a Triton kernel reads each row's expert from expert_R (one int32 per row,
made once per layer call by moetrain.ops.grouped.expert_of_rows) and the bias row from L2, and
writes act(y + b) in one read and one write. The backward is ReLU's mask (torch's threshold_backward, one pass) and the bias
gradient as one_hot_RE.T @ grad, a GEMM whose sum per expert is deterministic.

CUDA only (kernel_runs()); moetrain.ops.grouped.add_expert_bias is the torch path for everything
else. Shape letters: R rows, O output features, E experts.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

from moetrain.ops.launch import on_device_of

_BLOCK_ROWS, _BLOCK_COLS = 16, 256


if triton is not None:

    @triton.jit
    def _bias_act_kernel(y_ptr, b_ptr, expert_ptr, out_ptr, R, O, RELU: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        row_ok = rows < R
        mask = row_ok[:, None] & (cols < O)[None, :]
        expert = tl.load(expert_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        offsets = rows.to(tl.int64)[:, None] * O + cols[None, :]
        y = tl.load(y_ptr + offsets, mask=mask).to(tl.float32)
        b = tl.load(b_ptr + expert[:, None] * O + cols[None, :], mask=mask).to(tl.float32)
        out = y + b
        if RELU:
            out = tl.maximum(out, 0.0)
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@torch.library.custom_op("moetrain::packed_bias_act", mutates_args=(), device_types="cuda")
def _packed_bias_act(y_RO: torch.Tensor, b_EO: torch.Tensor, expert_R: torch.Tensor, relu: bool) -> torch.Tensor:
    out_RO = torch.empty_like(y_RO)
    rows, cols = y_RO.shape
    if rows and cols:
        grid = (triton.cdiv(rows, _BLOCK_ROWS), triton.cdiv(cols, _BLOCK_COLS))
        with on_device_of(y_RO):
            _bias_act_kernel[grid](y_RO, b_EO, expert_R, out_RO, rows, cols, RELU=relu,
                                   BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLS=_BLOCK_COLS)
    return out_RO


@_packed_bias_act.register_fake
def _(y_RO, b_EO, expert_R, relu):
    return torch.empty_like(y_RO)


def _setup_context(ctx, inputs, output):
    _, b_EO, expert_R, relu = inputs
    ctx.relu, ctx.num_experts = relu, b_EO.size(0)
    ctx.save_for_backward(expert_R, output if relu else None)


def _backward(ctx, grad_RO):
    expert_R, out_RO = ctx.saved_tensors
    if ctx.relu:  # relu(z) > 0 exactly where z > 0: the output is the mask
        grad_RO = torch.ops.aten.threshold_backward(grad_RO, out_RO, 0)
    grad_b = None
    if ctx.needs_input_grad[1]:
        one_hot_RE = torch.nn.functional.one_hot(expert_R.long(), ctx.num_experts).to(grad_RO.dtype)
        grad_b = one_hot_RE.t() @ grad_RO
    return grad_RO, grad_b, None, None


_packed_bias_act.register_autograd(_backward, setup_context=_setup_context)


def kernel_runs(y_RO: torch.Tensor, b_EO: torch.Tensor) -> bool:
    """Whether packed_bias_act runs the Triton kernel for these tensors."""
    return (triton is not None and y_RO.is_cuda and y_RO.dim() == 2 and y_RO.is_contiguous()
            and b_EO.dtype == y_RO.dtype and y_RO.dtype in (torch.bfloat16, torch.float16, torch.float32))


def packed_bias_act(y_RO: torch.Tensor, b_EO: torch.Tensor, expert_R: torch.Tensor, relu: bool) -> torch.Tensor:
    """act(y[r] + b[expert_R[r]]), act = ReLU or identity, as a new tensor; differentiable in y and b.
    The caller checks kernel_runs() first."""
    if b_EO.dim() != 2 or b_EO.size(1) != y_RO.size(1) or expert_R.shape != (y_RO.size(0),):
        raise ValueError(f"packed_bias_act: y [R, O], b [E, O] and expert_R [R] expected, got {tuple(y_RO.shape)}, "
                         f"{tuple(b_EO.shape)}, {tuple(expert_R.shape)}")
    return _packed_bias_act(y_RO, b_EO.contiguous(), expert_R.contiguous(), bool(relu))
