"""FP8 training of dense linear layers: row-wise scaled E4M3 GEMMs for the forward and the input
gradient, bf16 for the weight gradient (trainer.precision=fp8 puts the attention projections and
the blocks' dense FFNs here; the expert GEMMs are moetrain.precision.fp8_matmul's).

The same row-wise recipe as the experts' "fp8" (M rows, K input features, N output features):

  GEMM     product              first operand scaled per        second operand scaled per
  forward  y_MN  = x_MK w_NK^T  row of x (token), over K        row n of w, over K
  dgrad    dx_MK = dy_MN w_NK   row of dy (token), over N       column k of w, over N
  wgrad    dw_NK = dy_MN^T x_MK in bf16 (a scale per row cannot be taken out of a sum over rows)

The rows are quantized by the experts' row quantizer (moetrain.precision.fp8_quantize.quantize_rows:
one Triton pass on CUDA, moetrain.precision.formats' E4M3 arithmetic bit for bit); the GEMMs are
torch._scaled_mm on CUDA (fp32 accumulation, fp32 scales in the epilogue, bf16 out). On the CPU
the GEMMs are emulated: the same E4M3 operands, dequantized and multiplied in fp32, rounded to
bf16. Only x (in the compute dtype) and w are kept for backward, as for a bf16 linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.precision.fp8_quantize import quantize_rows

ALIGN = 16  # torch._scaled_mm's operands: K and N multiples of 16 (M is padded here)


def _fp8_matmul(a_MK: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    """a b^T -> bf16 [M, N] with a and b quantized per row (over K), fp32 accumulation."""
    rows = a_MK.size(0)
    if a_MK.is_cuda:
        padded = -(-rows // ALIGN) * ALIGN  # _scaled_mm wants every dimension a multiple of 16
        aq_MK, a_scale_M = quantize_rows(F.pad(a_MK, (0, 0, 0, padded - rows)) if padded != rows else a_MK)
        bq_NK, b_scale_N = quantize_rows(b_NK.contiguous())
        y_MN = torch._scaled_mm(aq_MK, bq_NK.t(), scale_a=a_scale_M.unsqueeze(1), scale_b=b_scale_N.unsqueeze(0),
                                out_dtype=torch.bfloat16)
        return y_MN[:rows] if padded != rows else y_MN
    (aq_MK, a_scale_M), (bq_NK, b_scale_N) = quantize_rows(a_MK), quantize_rows(b_NK.contiguous())
    return ((aq_MK.float() * a_scale_M.unsqueeze(1)) @ (bq_NK.float() * b_scale_N.unsqueeze(1)).t()).to(torch.bfloat16)


# The two FP8 GEMMs are custom operators, their gradient registered with the forward's: torch.compile
# keeps each one whole in the graph. Written as an autograd.Function of plain torch quantizers and
# torch._scaled_mm and traced by torch.compile (torch 2.11, H100), the input gradient came out zero.
@torch.library.custom_op("moetrain::fp8_linear", mutates_args=())
def _linear_op(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    return _fp8_matmul(x_MK, w_NK).to(x_MK.dtype).contiguous()


@_linear_op.register_fake
def _(x_MK, w_NK):
    return x_MK.new_empty((x_MK.size(0), w_NK.size(0)))


@torch.library.custom_op("moetrain::fp8_linear_grad_input", mutates_args=())
def _linear_grad_input_op(dy_MN: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    # the second operand is w^T [K, N], quantized per row k over N
    return _fp8_matmul(dy_MN, w_NK.t()).contiguous()


@_linear_grad_input_op.register_fake
def _(dy_MN, w_NK):
    return dy_MN.new_empty((dy_MN.size(0), w_NK.size(1)), dtype=torch.bfloat16)


def _linear_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _linear_backward(ctx, dy_MN: torch.Tensor):
    x_MK, w_NK = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = _linear_grad_input_op(dy_MN.contiguous(), w_NK).to(x_MK.dtype)
    if ctx.needs_input_grad[1]:
        grad_w = (dy_MN.to(x_MK.dtype).t() @ x_MK).to(w_NK.dtype)
    return grad_x, grad_w


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with its forward and input-gradient GEMMs in row-wise FP8 (module
    docstring). Under autocast the operands are cast to its dtype first, as F.linear's are; the
    output has the compute dtype."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    with torch.autocast(device, enabled=False):
        x_MK = x.reshape(-1, x.size(-1)).to(dtype)
        y_MN = _linear_op(x_MK.contiguous(), weight.to(dtype))
        if bias is not None:
            y_MN = y_MN + bias.to(dtype)
    return y_MN.view(*x.shape[:-1], weight.size(0))


class FP8Linear(nn.Linear):
    """nn.Linear whose forward is fp8_linear. from_linear makes one that holds the same parameters
    (and so the same state_dict keys and optimizer entries)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP8Linear:
        fp8 = cls.__new__(cls)
        nn.Module.__init__(fp8)
        fp8.in_features, fp8.out_features = linear.in_features, linear.out_features
        fp8.weight, fp8.bias = linear.weight, linear.bias
        return fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias)


def fits_fp8(linear: nn.Linear) -> bool:
    """Whether the FP8 GEMMs take this layer's shape: K and N multiples of 16."""
    return linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0


def use_fp8_linears(module: nn.Module) -> list[str]:
    """Replace every nn.Linear below module whose shape fits_fp8 by an FP8Linear holding the same
    parameters; returns the replaced modules' names (relative to module)."""
    replaced = []
    for name, child in list(module.named_modules()):
        for attribute, linear in list(child.named_children()):
            if type(linear) is nn.Linear and fits_fp8(linear):
                setattr(child, attribute, FP8Linear.from_linear(linear))
                replaced.append(f"{name}.{attribute}" if name else attribute)
    return replaced
