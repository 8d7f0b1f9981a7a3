"""FP8 training of dense linear layers: row-wise scaled E4M3 GEMMs for the forward and the input
gradient, bf16 for the weight gradient (trainer.precision=fp8 puts the attention projections and
the blocks' dense FFNs here; the expert GEMMs are moetrain.precision.fp8_matmul's).

The same row-wise recipe as the experts' "fp8" (M rows, K input features, N output features):

  GEMM     product              first operand scaled per        second operand scaled per
  forward  y_MN  = x_MK w_NK^T  row of x (token), over K        row n of w, over K
  dgrad    dx_MK = dy_MN w_NK   row of dy (token), over N       column k of w, over N
  wgrad    dw_NK = dy_MN^T x_MK in bf16 (a scale per row cannot be taken out of a sum over rows)

The activations' quantization (x in the forward, dy in the backward) is plain torch
(moetrain.precision.formats.quantize_fp8_groups), outside the GEMM operators: under torch.compile it
fuses into the kernel that produces x or dy (the norm before a projection: its row is in registers
there), and one x feeding several projections (q, k, v) is quantized once. The GEMMs are custom
operators with their gradient registered, kept whole in the compiled graph; they quantize the
weight themselves (moetrain.precision.fp8_quantize.quantize_rows) and multiply on torch._scaled_mm
on CUDA (fp32 accumulation, bf16 out). On the CPU the GEMMs are emulated: the same E4M3 operands,
dequantized and multiplied in fp32, rounded to bf16. Only x (in the compute dtype) and w are kept
for backward, as for a bf16 linear.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.precision.formats import quantize_fp8_groups
from moetrain.precision.fp8_quantize import quantize_rows

ALIGN = 16  # torch._scaled_mm's operands: every dimension a multiple of 16 (M is padded here)


def quantize_activation_rows(a_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values [M, K] and one fp32 scale per row [M], in plain torch (fusable by the compiler)."""
    q_MK, scale_M1 = quantize_fp8_groups(a_MK, max(1, a_MK.size(1)))
    return q_MK, scale_M1.view(-1)


def _scaled_matmul(aq_MK: torch.Tensor, a_scale_M: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    """(aq * a_scale) @ (b quantized per row over K)^T -> bf16 [M, N], fp32 accumulation."""
    bq_NK, b_scale_N = quantize_rows(b_NK.contiguous())
    rows = aq_MK.size(0)
    if aq_MK.is_cuda:
        padded = -(-rows // ALIGN) * ALIGN
        if padded != rows:  # zero rows (E4M3 +0 is the byte 0), scale 1
            aq_MK = torch.cat([aq_MK.view(torch.uint8), aq_MK.new_zeros(padded - rows, aq_MK.size(1), dtype=torch.uint8)]
                              ).view(torch.float8_e4m3fn)
            a_scale_M = torch.cat([a_scale_M, a_scale_M.new_ones(padded - rows)])
        y_MN = torch._scaled_mm(aq_MK, bq_NK.t(), scale_a=a_scale_M.unsqueeze(1), scale_b=b_scale_N.unsqueeze(0),
                                out_dtype=torch.bfloat16)
        return y_MN[:rows]
    a = aq_MK.float() * a_scale_M.unsqueeze(1)
    return (a @ (bq_NK.float() * b_scale_N.unsqueeze(1)).t()).to(torch.bfloat16)


@torch.library.custom_op("moetrain::fp8_linear", mutates_args=())
def _linear_op(x_MK: torch.Tensor, xq_MK: torch.Tensor, x_scale_M: torch.Tensor, w_NK: torch.Tensor,
               fp8_dgrad: bool) -> torch.Tensor:
    """y = x w^T on x's E4M3 rows (xq, x_scale, quantized by the caller); x itself is kept for the
    weight gradient. fp8_dgrad: the input gradient's GEMM in FP8 too, else bf16 (dy w, dy not quantized)."""
    return _scaled_matmul(xq_MK, x_scale_M, w_NK).to(x_MK.dtype).contiguous()


@_linear_op.register_fake
def _(x_MK, xq_MK, x_scale_M, w_NK, fp8_dgrad):
    return x_MK.new_empty((x_MK.size(0), w_NK.size(0)))


@torch.library.custom_op("moetrain::fp8_linear_grad_input", mutates_args=())
def _linear_grad_input_op(dyq_MN: torch.Tensor, dy_scale_M: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    # the second operand is w^T [K, N], quantized per row k over N
    return _scaled_matmul(dyq_MN, dy_scale_M, w_NK.t()).contiguous()


@_linear_grad_input_op.register_fake
def _(dyq_MN, dy_scale_M, w_NK):
    return dyq_MN.new_empty((dyq_MN.size(0), w_NK.size(1)), dtype=torch.bfloat16)


def _linear_setup(ctx, inputs, output) -> None:
    x_MK, _, _, w_NK, ctx.fp8_dgrad = inputs
    ctx.save_for_backward(x_MK, w_NK)


def _linear_backward(ctx, dy_MN: torch.Tensor):
    x_MK, w_NK = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        if ctx.fp8_dgrad:
            dyq_MN, dy_scale_M = quantize_activation_rows(dy_MN)  # plain torch: fuses into dy's producer
            grad_x = _linear_grad_input_op(dyq_MN, dy_scale_M, w_NK).to(x_MK.dtype)
        else:
            grad_x = dy_MN.to(x_MK.dtype) @ w_NK.to(x_MK.dtype)
    if ctx.needs_input_grad[3]:
        grad_w = (dy_MN.to(x_MK.dtype).t() @ x_MK).to(w_NK.dtype)
    return grad_x, None, None, grad_w, None


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               fp8_dgrad: bool = True) -> torch.Tensor:
    """F.linear(x, weight, bias) with its forward and input-gradient GEMMs in row-wise FP8 (module
    docstring); fp8_dgrad=False: the input gradient in bf16 (for a dy whose row-wise quantization
    cannot fuse into the kernel that makes it). Under autocast the operands are cast to its dtype
    first, as F.linear's are; the output has the compute dtype."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    with torch.autocast(device, enabled=False):
        x_MK = x.reshape(-1, x.size(-1)).to(dtype)
        xq_MK, x_scale_M = quantize_activation_rows(x_MK)
        y_MN = _linear_op(x_MK, xq_MK, x_scale_M, weight.to(dtype), fp8_dgrad)
        if bias is not None:
            y_MN = y_MN + bias.to(dtype)
    return y_MN.view(*x.shape[:-1], weight.size(0))


class FP8Linear(nn.Linear):
    """nn.Linear whose forward is fp8_linear. from_linear makes one that holds the same parameters
    (and so the same state_dict keys and optimizer entries)."""

    fp8_dgrad = True

    @classmethod
    def from_linear(cls, linear: nn.Linear, fp8_dgrad: bool = True) -> FP8Linear:
        fp8 = cls.__new__(cls)
        nn.Module.__init__(fp8)
        fp8.in_features, fp8.out_features = linear.in_features, linear.out_features
        fp8.weight, fp8.bias = linear.weight, linear.bias
        fp8.fp8_dgrad = fp8_dgrad
        return fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.fp8_dgrad)


def fits_fp8(linear: nn.Linear) -> bool:
    """Whether the FP8 GEMMs take this layer's shape: K and N multiples of 16."""
    return linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0


def use_fp8_linears(module: nn.Module, bf16_dgrad: tuple[str, ...] = ()) -> list[str]:
    """Replace every nn.Linear below module whose shape fits_fp8 by an FP8Linear holding the same
    parameters, its input gradient in bf16 where its attribute name is in bf16_dgrad; returns the
    replaced modules' names (relative to module)."""
    replaced = []
    for name, child in list(module.named_modules()):
        for attribute, linear in list(child.named_children()):
            if type(linear) is nn.Linear and fits_fp8(linear):
                setattr(child, attribute, FP8Linear.from_linear(linear, fp8_dgrad=attribute not in bf16_dgrad))
                replaced.append(f"{name}.{attribute}" if name else attribute)
    return replaced
