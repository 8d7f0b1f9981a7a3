"""FP8 training of the expert GEMMs: MoELayer(precision="fp8"), trainer.precision=fp8.

Every expert GEMM of the step, forward and both backward GEMMs, multiplies E4M3 operands with fp32
scales and fp32 accumulation; the master weights keep their dtype (fp32 under autocast) and are
quantized afresh at every step. Scales run along the reduction dimension of each GEMM, so a scale
can be taken out of the sum:

  GEMM     product              first operand scaled per         second operand scaled per
  forward  y_RN  = x_RK w_KN    row of x (token), over K          column n of w, over K
  dgrad    dx_RK = dy_RN w_KN^T row of dy (token), over N         row k of w, over N
  wgrad    dw_KN = x_RK^T dy_RN column k of x, over its expert's  column n of dy, over its expert's
                                rows                              rows

Gradients are E4M3 too, not E5M2: with a scale per row (or per column and expert) the range of a
scaled group is at most 448 / smallest normal, and E4M3's third mantissa bit halves the rounding
error E5M2 would add (DeepSeek-V3 trains with E4M3 gradients under fine-grained scales for the
same reason). Outputs round to bfloat16, as the tensor cores write them; dx and dw then take the
dtype of x and w.

On CUDA (sm90+) the GEMMs are torch._scaled_grouped_mm: per-row scales, one launch for all experts;
the weight gradient's operands are transposed and quantized per expert column by one Triton
kernel that also pads each expert's rows to a multiple of 16 (the FP8 kernel's alignment). On the
CPU every GEMM is emulated: the operands are quantized with the same arithmetic
(moetrain.quant.formats, bit for bit), dequantized to fp32 and multiplied in fp32, then rounded
to bfloat16; only the order of the fp32 accumulation differs from the GPU.

Shape letters: R rows (expert-major, packed or padded), K input features, N output features,
E experts, P rows padded per expert to multiples of ALIGN.
"""

from __future__ import annotations

import torch

from moetrain.quant.formats import E4M3_MAX, e4m3_encode, finite_amax, fp8_scale, quantize_fp8_groups

try:
    import triton
    import triton.language as tl
except ImportError:  # the CUDA path needs Triton (fp8_supported says so)
    triton = None

ALIGN = 16  # rows of each expert in the weight-gradient GEMM: a multiple of 16 bytes of E4M3


def fp8_supported(device: torch.device) -> tuple[bool, str]:
    """Whether the FP8 expert GEMMs run on this device, and why not when they do not."""
    if device.type == "cpu":
        return True, "CPU: emulated in fp32"
    if device.type != "cuda":
        return False, f"{device.type} tensors (FP8 training runs on CUDA or emulated on the CPU)"
    if not hasattr(torch, "_scaled_grouped_mm") or triton is None:
        return False, f"torch {torch.__version__} without torch._scaled_grouped_mm or without Triton"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return False, "GPU older than sm90 (Hopper): no FP8 grouped GEMM"
    return True, "CUDA sm90+"


# ---------------------------------------------------------------- quantization


def quantize_weight(w_EKN: torch.Tensor, over: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 copy of w with one fp32 scale per column (over=1: scales [E, N], values stored [E, N, K]
    contiguous) or per row (over=2: scales [E, K], values [E, K, N]): both are the layouts the
    grouped GEMM reads its second operand in (K-major for the forward, N-major for dgrad)."""
    w = w_EKN.float()
    amax, finite = finite_amax(w, over)
    scale = fp8_scale(amax, finite)
    q = e4m3_encode(w / scale.unsqueeze(over))
    return (q.transpose(1, 2).contiguous() if over == 1 else q), scale


def quantize_rows(x_RK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values [R, K] and one fp32 scale per row [R]."""
    if x_RK.is_cuda:
        from moetrain.quant import kernels  # noqa: PLC0415 - the Triton kernels load with CUDA use

        q_RK, scale_R1 = kernels.quantize_fp8(x_RK.contiguous(), x_RK.size(1))
    else:
        q_RK, scale_R1 = quantize_fp8_groups(x_RK, max(1, x_RK.size(1)))
    return q_RK, scale_R1.view(-1)


def padded_ends(counts_E: torch.Tensor) -> torch.Tensor:
    """int32 end of each expert's rows once every expert's row count is rounded up to ALIGN."""
    return torch.cumsum((counts_E + ALIGN - 1) // ALIGN * ALIGN, 0, dtype=torch.int32)


def quantize_columns(x_RC: torch.Tensor, counts_E: torch.Tensor, padded_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x transposed and quantized per expert and column: values [C, P] (expert e's rows at columns
    padded_ends[e-1] ..., zero up to padded_ends[e]) and fp32 scales [E, C], each over that expert's
    rows. counts_E must sum to R (the last expert owns any padding rows). padded_rows: P, the last
    of padded_ends (given so that the CUDA path does not wait for the GPU)."""
    num_experts, cols = counts_E.numel(), x_RC.size(1)
    if x_RC.is_cuda:
        return _quantize_columns_cuda(x_RC.contiguous(), counts_E.to(torch.int32), padded_rows)
    q_CP = torch.zeros(cols, padded_rows, dtype=torch.float8_e4m3fn)
    scale_EC = torch.empty(num_experts, cols, dtype=torch.float32)
    start = padded_start = 0
    for e, count in enumerate(counts_E.tolist()):
        if not count:
            scale_EC[e] = 1.0
            continue
        x_cR = x_RC[start:start + count].float().t()
        amax, finite = finite_amax(x_cR, 1)
        scale_EC[e] = fp8_scale(amax, finite)
        q_CP[:, padded_start:padded_start + count] = e4m3_encode(x_cR / scale_EC[e].unsqueeze(1))
        start += count
        padded_start += -(-count // ALIGN) * ALIGN
    return q_CP, scale_EC


if triton is not None:

    @triton.jit
    def _quantize_columns_kernel(x_ptr, ends_ptr, padded_ends_ptr, q_ptr, scale_ptr, C, P,
                                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """One program: one expert, BLOCK_C columns. Pass 1 finds each column's largest finite
        magnitude over the expert's rows, pass 2 writes the scaled E4M3 values transposed, with
        zeros in the expert's padding columns. The arithmetic is formats.fp8_scale's and
        e4m3_encode's: IEEE division, saturation, round to nearest even."""
        e = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_ok = cols < C
        start = tl.where(e > 0, tl.load(ends_ptr + e - 1, mask=e > 0, other=0), 0)
        end = tl.load(ends_ptr + e)
        padded_start = tl.where(e > 0, tl.load(padded_ends_ptr + e - 1, mask=e > 0, other=0), 0)
        padded_end = tl.load(padded_ends_ptr + e)
        amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
        finite_all = tl.full((BLOCK_C,), 1, dtype=tl.int32)
        for r0 in range(start, end, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            mask = (rows < end)[:, None] & col_ok[None, :]
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            finite = tl.abs(x) < float("inf")
            amax = tl.maximum(amax, tl.max(tl.where(finite & mask, tl.abs(x), 0.0), axis=0))
            finite_all = tl.minimum(finite_all, tl.min(tl.where(mask, finite, True).to(tl.int32), axis=0))
        scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
        scale = tl.where(finite_all == 1, scale, float("nan"))
        tl.store(scale_ptr + e * C + cols, scale, mask=col_ok)
        for p0 in range(padded_start, padded_end, BLOCK_R):
            local = p0 - padded_start + tl.arange(0, BLOCK_R)
            rows = start + local
            mask = (rows < end)[:, None] & col_ok[None, :]
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            scaled = tl.math.div_rn(x, tl.broadcast_to(scale[None, :], x.shape))
            scaled = tl.clamp(scaled, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
            q = tl.where(mask, scaled, 0.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            out_mask = ((p0 + tl.arange(0, BLOCK_R)) < padded_end)[:, None] & col_ok[None, :]
            tl.store(q_ptr + cols.to(tl.int64)[None, :] * P + (p0 + tl.arange(0, BLOCK_R))[:, None], q, mask=out_mask)


@torch.library.custom_op("moetrain::fp8_quantize_columns", mutates_args=(), device_types="cuda")
def _quantize_columns_cuda(x_RC: torch.Tensor, counts_E: torch.Tensor, padded_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    cols, num_experts = x_RC.size(1), counts_E.numel()
    q_CP = torch.empty(cols, padded_rows, dtype=torch.uint8, device=x_RC.device)
    scale_EC = torch.empty(num_experts, cols, dtype=torch.float32, device=x_RC.device)
    if num_experts and cols and padded_rows:
        ends = torch.cumsum(counts_E, 0, dtype=torch.int32)
        with torch.cuda.device(x_RC.device):
            _quantize_columns_kernel[(num_experts, triton.cdiv(cols, 64))](
                x_RC, ends, padded_ends(counts_E), q_CP, scale_EC, cols, padded_rows, BLOCK_R=64, BLOCK_C=64,
                num_warps=4)
    elif num_experts and cols:
        scale_EC.fill_(1.0)
    return q_CP.view(torch.float8_e4m3fn), scale_EC


@_quantize_columns_cuda.register_fake
def _(x_RC, counts_E, padded_rows):
    cols = x_RC.size(1)
    return (x_RC.new_empty(cols, padded_rows, dtype=torch.float8_e4m3fn),
            x_RC.new_empty(counts_E.numel(), cols, dtype=torch.float32))


# ---------------------------------------------------------------- GEMMs


def _ends(counts_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    ends = torch.cumsum(counts_E, 0, dtype=torch.int32)
    ends[-1] = num_rows
    return ends


def rows_matmul(xq_RK, x_scale_R, wq_ENK, w_scale_EN, counts_E) -> torch.Tensor:
    """y[r] = (xq[r] * x_scale[r]) @ (wq[e] * w_scale[e, :, None]).T for each row's expert e -> bf16 [R, N]."""
    if xq_RK.size(0) == 0:
        return torch.zeros(0, wq_ENK.size(1), dtype=torch.bfloat16, device=xq_RK.device)
    if xq_RK.is_cuda:
        return torch._scaled_grouped_mm(xq_RK, wq_ENK.transpose(1, 2), x_scale_R, w_scale_EN,
                                        offs=_ends(counts_E, xq_RK.size(0)), out_dtype=torch.bfloat16)
    x_RK = xq_RK.float() * x_scale_R.unsqueeze(1)
    w_ENK = wq_ENK.float() * w_scale_EN.unsqueeze(2)
    counts = counts_E.tolist()
    counts[-1] += xq_RK.size(0) - sum(counts)
    y_RN = torch.cat([x @ w.t() for x, w in zip(torch.split(x_RK, counts), w_ENK)])
    return y_RN.to(torch.bfloat16)


def columns_matmul(aq_KP, a_scale_EK, bq_NP, b_scale_EN, counts_E) -> torch.Tensor:
    """dw[e] = A_e @ B_e.T over expert e's (padded) columns, with A_e = aq[:, cols_e] * a_scale[e, :, None]
    and B_e likewise -> bf16 [E, K, N]."""
    if aq_KP.size(1) == 0:
        return torch.zeros(counts_E.numel(), aq_KP.size(0), bq_NP.size(0), dtype=torch.bfloat16, device=aq_KP.device)
    if aq_KP.is_cuda:
        return torch._scaled_grouped_mm(aq_KP, bq_NP.t(), a_scale_EK.reshape(-1), b_scale_EN.reshape(-1),
                                        offs=padded_ends(counts_E), out_dtype=torch.bfloat16)
    ends = padded_ends(counts_E).tolist()
    starts = [0] + ends[:-1]
    a_KP, b_NP = aq_KP.float(), bq_NP.float()
    dw = [(a_KP[:, s:t] * a_scale_EK[e].unsqueeze(1)) @ (b_NP[:, s:t] * b_scale_EN[e].unsqueeze(1)).t()
          for e, (s, t) in enumerate(zip(starts, ends))]
    return torch.stack(dw).to(torch.bfloat16)


class _FP8ExpertMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RK, w_EKN, counts_E):
        xq_RK, x_scale_R = quantize_rows(x_RK)
        wq_ENK, w_scale_EN = quantize_weight(w_EKN, over=1)
        ctx.save_for_backward(x_RK, w_EKN, counts_E)
        return rows_matmul(xq_RK, x_scale_R, wq_ENK, w_scale_EN, counts_E).to(x_RK.dtype)

    @staticmethod
    def backward(ctx, dy_RN):
        x_RK, w_EKN, counts_E = ctx.saved_tensors
        dy_RN = dy_RN.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            dyq_RN, dy_scale_R = quantize_rows(dy_RN)
            wq_EKN, w_scale_EK = quantize_weight(w_EKN, over=2)
            grad_x = rows_matmul(dyq_RN, dy_scale_R, wq_EKN, w_scale_EK, counts_E).to(x_RK.dtype)
        if ctx.needs_input_grad[1]:
            # padded rows: known on the host only from the counts; the CPU path needs them anyway and
            # on CUDA the worst case (every expert one row past a multiple) bounds it without a sync.
            padded = _padded_rows(counts_E, x_RK.size(0))
            xq_KP, x_scale_EK = quantize_columns(x_RK, counts_E, padded)
            dyq_NP, dy_scale_EN = quantize_columns(dy_RN, counts_E, padded)
            grad_w = columns_matmul(xq_KP, x_scale_EK, dyq_NP, dy_scale_EN, counts_E).to(w_EKN.dtype)
        return grad_x, grad_w, None


def _padded_rows(counts_E: torch.Tensor, num_rows: int) -> int:
    """P: a bound on the padded row count that needs no host sync on CUDA (each expert adds at most
    ALIGN - 1 rows); on the CPU the exact count."""
    if num_rows == 0:
        return 0
    if counts_E.is_cuda:
        return -(-num_rows // ALIGN) * ALIGN + counts_E.numel() * ALIGN
    return int(padded_ends(counts_E)[-1]) if counts_E.numel() else 0


def fp8_expert_matmul(x_RK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor | list[int],
                      capacity: int | None) -> torch.Tensor:
    """y[r] = x[r] @ w[expert_of(r)] with every GEMM of forward and backward in FP8 (module docstring);
    the same layouts and arguments as moetrain.ops.grouped.expert_matmul."""
    num_experts, rows = w_EKN.size(0), x_RK.size(0)
    ok, why = fp8_supported(x_RK.device)
    if not ok:
        raise ValueError(f"precision='fp8' cannot run on {why}; use precision='bf16'")
    if capacity is not None:
        counts_E = [capacity] * num_experts
    counts_E = torch.as_tensor(counts_E, device=x_RK.device).to(torch.int64)
    counts_E = counts_E.clone()
    counts_E[-1] += rows - counts_E.sum()  # the last expert owns the padding rows (zeros in, unread out)
    if torch.is_autocast_enabled(x_RK.device.type):
        x_RK = x_RK.to(torch.get_autocast_dtype(x_RK.device.type))
    with torch.autocast(x_RK.device.type, enabled=False):
        return _FP8ExpertMatmul.apply(x_RK, w_EKN, counts_E)
