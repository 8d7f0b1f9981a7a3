"""Expert matrix products on the expert-major buffer (grouped GEMMs).

Rows of expert e are contiguous. In the padded layout (capacity given) every expert owns exactly
`capacity` rows, so one batched matmul does all experts. In the packed layout expert e owns
counts[e] rows starting at the sum of earlier counts; rows past the last expert are padding (the
dispatch kernel leaves them zero) and their outputs are never read.

Backends for the packed layout, picked automatically and logged once per choice:
  "grouped_mm"  torch._grouped_mm: one launch for all experts, no host sync (CUDA sm90+, bf16,
                rows 16-byte aligned); the fastest packed backend where it runs.
  "triton"      moetrain.ops.triton_grouped's Triton grouped GEMMs (forward, dgrad and wgrad), one
                launch each, no host sync (CUDA, Triton); chosen only when asked for.
  "loop"        one matmul per expert: runs everywhere, needs the counts on the host.
The padded layout uses "bmm" (torch.bmm on [E, C, I] x [E, I, O]) unless told otherwise; on an
H200 it ran 5-24 % faster than torch._grouped_mm on the same rows (docs/performance.md).
`expert_matmul(..., backend=...)` or `set_default_backend(...)` overrides the automatic choice.

Expert biases (expert_bias, add_expert_bias) avoid a per-row gather on the GPU: its gradient is an
index_put in which every row of an expert accumulates into the same bias row.

Shape letters: R buffer rows, I input dim, O output dim, E experts, C capacity (rows per expert).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("moetrain")

BACKENDS = ("auto", "bmm", "grouped_mm", "triton", "loop")

_default_backend = "auto"
_logged: set[tuple[str, str]] = set()


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def set_default_backend(backend: str) -> None:
    """Backend used when expert_matmul is called with backend="auto" left as is."""
    global _default_backend
    _default_backend = _check_backend(backend)


def default_backend() -> str:
    """The backend expert_matmul uses when called with backend="auto" (set_default_backend)."""
    return _default_backend


def padded_uses_bmm() -> bool:
    """Whether the padded layout's expert GEMMs run as bmm (the automatic choice) unless overridden."""
    return _default_backend in ("auto", "bmm")


def grouped_mm_supported(x_RI: torch.Tensor, w_EIO: torch.Tensor) -> tuple[bool, str]:
    """Whether torch._grouped_mm runs these operands, and why not when it does not."""
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no _grouped_mm"
    if x_RI.device.type != "cuda":
        return False, f"{x_RI.device.type} tensors (torch._grouped_mm is used on CUDA only)"
    if torch.cuda.get_device_capability(x_RI.device) < (9, 0):
        return False, "GPU older than sm90"
    if x_RI.dtype != torch.bfloat16 or w_EIO.dtype != torch.bfloat16:
        return False, f"dtype {x_RI.dtype} (torch._grouped_mm needs bfloat16)"
    # Its kernels need 16-byte aligned rows in both operands.
    if x_RI.size(1) % 8 or w_EIO.size(2) % 8:
        return False, f"dims {x_RI.size(1)}x{w_EIO.size(2)} not multiples of 8"
    return True, "CUDA sm90+, bfloat16"


def _choose(backend: str, x_RI: torch.Tensor, w_EIO: torch.Tensor, padded: bool) -> str:
    if backend == "auto":
        backend = _default_backend
    if backend == "auto":
        if padded:
            backend, why = "bmm", "padded layout"
        else:
            ok, why = grouped_mm_supported(x_RI, w_EIO)
            backend = "grouped_mm" if ok else "loop"
        key = (backend, why)
        # Logging inside a torch.compile trace would split the graph; eager calls log the choice.
        if key not in _logged and not torch.compiler.is_compiling():
            _logged.add(key)
            log.info("moetrain: expert GEMMs use %s (%s)", backend, why)
    elif backend == "bmm" and not padded:
        raise ValueError("backend 'bmm' needs the padded layout (a capacity); use 'grouped_mm' or 'loop'")
    return backend


def group_ends(counts_E: torch.Tensor | list[int], num_rows: int, device: torch.device) -> torch.Tensor:
    """int32 end row of each expert; the last expert absorbs the padding rows (zeros in, unread out)
    so that every output row is written and no host sync is needed."""
    counts = torch.as_tensor(counts_E, device=device)
    ends_E = torch.cumsum(counts, 0, dtype=torch.int32)
    # A fill kernel: `ends_E[-1] = num_rows` copies the number from host memory and waits for the GPU
    # (two waits a layer step, which kept the host from queueing ahead).
    ends_E[-1:].fill_(num_rows)
    return ends_E


def _autocast(x_RI: torch.Tensor, w_EIO: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.is_autocast_enabled(x_RI.device.type):
        # Autocast does not reach torch._grouped_mm; cast as it would for a matmul, so fp32 master
        # weights under bf16 autocast still take the grouped GEMM (and bmm sees one dtype).
        dtype = torch.get_autocast_dtype(x_RI.device.type)
        x_RI, w_EIO = x_RI.to(dtype), w_EIO.to(dtype)
    return x_RI, w_EIO


def padded_matmul(x_RI: torch.Tensor, w_EIO: torch.Tensor, capacity: int) -> torch.Tensor:
    """The padded layout's expert GEMM as one bmm -> [E, capacity, O], a fresh tensor (not a view),
    so that an in-place epilogue (moetrain.ops.bias_act) can follow it without autograd copies."""
    x_RI, w_EIO = _autocast(x_RI, w_EIO)
    return torch.bmm(x_RI.view(w_EIO.size(0), capacity, w_EIO.size(1)), w_EIO)


def expert_matmul(
    x_RI: torch.Tensor,
    w_EIO: torch.Tensor,
    counts_E: torch.Tensor | list[int],
    capacity: int | None,
    backend: str = "auto",
) -> torch.Tensor:
    """y[r] = x[r] @ w[expert_of(r)] -> [R, O]; differentiable in x and w."""
    num_experts, in_dim, out_dim = w_EIO.shape
    rows = x_RI.size(0)
    x_RI, w_EIO = _autocast(x_RI, w_EIO)
    chosen = _choose(_check_backend(backend), x_RI, w_EIO, capacity is not None)
    if chosen == "bmm":
        return torch.bmm(x_RI.view(num_experts, capacity, in_dim), w_EIO).view(rows, out_dim)
    if capacity is not None:
        counts_E = [capacity] * num_experts  # every block is a group of `capacity` rows
    if chosen == "grouped_mm":
        return torch._grouped_mm(x_RI, w_EIO, offs=group_ends(counts_E, rows, x_RI.device))
    if chosen == "triton":
        if x_RI.device.type != "cuda":
            raise ValueError(f"backend 'triton' runs on CUDA tensors, got {x_RI.device.type}: use 'auto'")
        return _TritonExpertMatmul.apply(x_RI, w_EIO, group_ends(counts_E, rows, x_RI.device))
    counts = counts_E.tolist() if isinstance(counts_E, torch.Tensor) else list(counts_E)
    counts[-1] += rows - sum(counts)
    return torch.cat([x @ w for x, w in zip(torch.split(x_RI, counts), w_EIO)])


class _TritonExpertMatmul(torch.autograd.Function):
    """y = x @ w[e] per expert through moetrain.ops.triton_grouped: dgrad reads w transposed in
    place, wgrad reduces over each expert's rows in fp32 and rounds to w's dtype once."""

    @staticmethod
    def forward(ctx, x_RI, w_EIO, ends_E):
        from moetrain.ops import triton_grouped  # noqa: PLC0415 - Triton is imported on first use

        ctx.save_for_backward(x_RI, w_EIO, ends_E)
        return triton_grouped.grouped_mm(x_RI, w_EIO, ends_E, out_dtype=x_RI.dtype)

    @staticmethod
    def backward(ctx, dy_RO):
        from moetrain.ops import triton_grouped  # noqa: PLC0415

        x_RI, w_EIO, ends_E = ctx.saved_tensors
        dx_RI = dw_EIO = None
        if ctx.needs_input_grad[0]:
            dx_RI = triton_grouped.grouped_mm(dy_RO, w_EIO.transpose(1, 2), ends_E, out_dtype=x_RI.dtype)
        if ctx.needs_input_grad[1]:
            dw_EIO = triton_grouped.grouped_mm_wgrad(x_RI, dy_RO, ends_E, out_dtype=w_EIO.dtype)
        return dx_RI, dw_EIO, None


def expert_of_rows(counts_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int32 [R]: the expert that owns each row of the packed layout (rows past the last expert's go
    to the last expert; their outputs are never read)."""
    ends_E = torch.cumsum(counts_E, 0)
    rows_R = torch.arange(num_rows, device=counts_E.device)
    expert_R = torch.searchsorted(ends_E, rows_R, right=True, out_int32=True)
    return expert_R.clamp_(max=counts_E.numel() - 1)


def _expert_one_hot(num_experts: int, counts_E: torch.Tensor, capacity: int | None, num_rows: int,
                    dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[R, E] with a 1 at each row's expert; padding rows of the packed layout are all zero."""
    rows_R = torch.arange(num_rows, device=device)
    if capacity is not None:
        expert_R = rows_R // capacity
    else:
        expert_R = torch.searchsorted(torch.cumsum(counts_E.to(device), 0), rows_R, right=True)
    return (expert_R.unsqueeze(1) == torch.arange(num_experts, device=device)).to(dtype)


def _bias_by_matmul(dtype: torch.dtype) -> bool:
    # one_hot @ b copies b exactly only when the product cannot round it: 16-bit b with fp32
    # accumulation. An fp32 matmul may run in TF32 (torch.backends.cuda.matmul.allow_tf32).
    return dtype in (torch.bfloat16, torch.float16)


def expert_bias(b_EO: torch.Tensor, counts_E: torch.Tensor, capacity: int | None, num_rows: int) -> torch.Tensor:
    """The bias of each row's expert -> [R, O] (padding rows are never read).

    For 16-bit biases this is one_hot_RE @ b_EO: a GEMM writes the rows at full bandwidth and the
    bias gradient is a GEMM too, where a gather's gradient would be an index_put with every row of
    an expert accumulating into the same bias row."""
    num_experts = b_EO.size(0)
    if _bias_by_matmul(b_EO.dtype):
        return _expert_one_hot(num_experts, counts_E, capacity, num_rows, b_EO.dtype, b_EO.device) @ b_EO
    if capacity is not None:
        return b_EO.repeat_interleave(capacity, dim=0)
    row_expert_R = expert_of_rows(counts_E.to(b_EO.device), num_rows)
    if b_EO.device.type == "cpu":
        # index_select's gradient is index_add_, a plain loop on the CPU: 3-8x faster than the
        # index_put that indexing's gradient runs (on CUDA index_add_ would use atomics instead).
        return b_EO.index_select(0, row_expert_R)
    return b_EO[row_expert_R]


def add_expert_bias(y_RO: torch.Tensor, b_EO: torch.Tensor, counts_E: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """y + the bias of each row's expert, without writing an [R, O] bias tensor first: in the
    padded layout the bias broadcasts over each expert's block; in the packed layout (16-bit)
    addmm adds one_hot_RE @ b_EO to y in the GEMM's epilogue."""
    num_experts, out_dim = b_EO.shape
    b_EO = b_EO.to(y_RO.dtype)
    if capacity is not None:
        return (y_RO.view(num_experts, capacity, out_dim) + b_EO.unsqueeze(1)).view_as(y_RO)
    if _bias_by_matmul(y_RO.dtype):
        one_hot_RE = _expert_one_hot(num_experts, counts_E, None, y_RO.size(0), y_RO.dtype, y_RO.device)
        return torch.addmm(y_RO, one_hot_RE, b_EO)
    return y_RO + expert_bias(b_EO, counts_E, None, y_RO.size(0))
