"""Quantized routed experts: drop-in inference replacements for FFNExperts and SwiGLUExperts.

Each expert keeps its weights in its own format (see moetrain.precision.formats), so a policy can give
hot experts FP8 and cold ones FP4. Experts that share a format are stacked, so a format's GEMM can
cover all of them in one launch. Every weight w_EIO of the float experts (x @ w[e]) is stored
transposed, as w_NK = w[e].T: K (= I) is the reduction dimension along which the formats place
their scaling blocks, and N-major storage is the column-major operand torch._scaled_mm wants.
Biases stay in their float dtype. Inference only: the stored tensors are buffers, not parameters.

On CUDA the rows of each expert stay on the device (no host sync) and every format's GEMM takes
the path moetrain.quant.matmul.cuda_path picks from the rows per expert; the layer computes in
bf16 there. On CPU every format is emulated exactly, per expert.

Shape letters as in moetrain/moe: E experts, D model dim, H hidden size, R buffer rows; G experts
of one format, N output and K input features of one weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.moe.experts import Experts, FFNExperts, SwiGLUExperts
from moetrain.precision import kernels
from moetrain.precision.formats import WeightFormat, get_format
from moetrain.quant.matmul import ACTIVATION_GROUP, ExpertInput, ExpertRows, cuda_matmul, cuda_path, grouped_matmul

# The weights each built-in expert type multiplies with, in the order of its forward.
WEIGHT_NAMES = {FFNExperts: ("w1", "w2"), SwiGLUExperts: ("w_gate", "w_up", "w_down")}


class FormatStack(nn.Module):
    """One weight of the G experts that use one format: the format's tensors stacked on dim 0."""

    def __init__(self, fmt: WeightFormat, experts: list[int], n: int, k: int, device=None):
        super().__init__()
        self.format = fmt
        self.experts = list(experts)
        self.n, self.k = n, k
        # Allocate from one zero matrix's quantized layout; quantize() or load_state_dict() fills it.
        layout = fmt.quantize(torch.zeros(n, k, device=device))
        for name, tensor in layout.items():
            self.register_buffer(name, tensor.new_empty((len(experts),) + tuple(tensor.shape), device=device))

    @torch.no_grad()
    def quantize(self, w_GNK: torch.Tensor) -> None:
        # One expert at a time bounds the fp32 temporaries to one matrix.
        for g, w_NK in enumerate(w_GNK):
            for name, tensor in self.format.quantize(w_NK).items():
                getattr(self, name)[g].copy_(tensor)

    def stored(self) -> dict[str, torch.Tensor]:
        return {name: buffer for name, buffer in self.named_buffers(recurse=False)}

    def extra_repr(self) -> str:
        return f"format={self.format.name}, experts={self.experts}, n={self.n}, k={self.k}"


class QuantizedWeight(nn.Module):
    """The same weight (w1, w_up, ...) of every expert, each expert in the format it was given."""

    def __init__(self, formats: list[str], n: int, k: int, device=None):
        super().__init__()
        self.n, self.k = n, k
        by_format: dict[str, list[int]] = {}
        for expert, name in enumerate(formats):
            by_format.setdefault(get_format(name).name, []).append(expert)
        self.stacks = nn.ModuleDict(
            {name: FormatStack(get_format(name), experts, n, k, device) for name, experts in by_format.items()}
        )

    def quantize(self, w_EKN: torch.Tensor) -> None:
        """w_EKN: the float experts' weight as they multiply it (x @ w[e])."""
        for stack in self.stacks.values():
            stack.quantize(w_EKN[stack.experts].transpose(1, 2))

    def forward(self, x_RK: torch.Tensor, starts: list[int], counts: list[int]) -> torch.Tensor:
        """Expert-major rows in, expert-major rows out: y[rows of e] = x[rows of e] @ w_e (torch path)."""
        y_RN = x_RK.new_zeros(x_RK.size(0), self.n)
        for stack in self.stacks.values():
            grouped_matmul(x_RK, stack.format, stack.stored(), self.n, self.k,
                           [starts[e] for e in stack.experts], [counts[e] for e in stack.experts], y_RN)
        return y_RN

    def cuda_forward(self, inputs: ExpertInput, starts_E: torch.Tensor, counts_E: torch.Tensor, num_rows: int,
                     packed: bool) -> torch.Tensor:
        """The same on CUDA from device tensors (int32 starts and counts of every expert): bf16 [R, N].
        A layer in one format gets its GEMM's output directly: rows no expert owns are then left
        unwritten (the packed layout has none: its last expert owns the padding rows)."""
        rows_per_expert = num_rows / len(counts_E)
        if len(self.stacks) == 1:
            stack = next(iter(self.stacks.values()))
            rows = ExpertRows(starts_E, counts_E, rows_per_expert, packed)
            y_RN = None if packed else torch.zeros(num_rows, self.n, dtype=torch.bfloat16, device=starts_E.device)
            return cuda_matmul(inputs, stack.format, stack.stored(), self.n, self.k, rows, y_RN)
        y_RN = torch.zeros(num_rows, self.n, dtype=torch.bfloat16, device=starts_E.device)
        for stack in self.stacks.values():
            experts_G = torch.tensor(stack.experts, device=starts_E.device)
            rows = ExpertRows(starts_E[experts_G], counts_E[experts_G], rows_per_expert, packed=False)
            cuda_matmul(inputs, stack.format, stack.stored(), self.n, self.k, rows, y_RN)
        return y_RN

    def cuda_paths(self, num_rows: int, num_experts: int, packed: bool) -> set[str]:
        """The CUDA path each format of this weight takes for a buffer of num_rows rows."""
        paths = set()
        for stack in self.stacks.values():
            packed_stack = packed and len(self.stacks) == 1
            paths.add(cuda_path(stack.format, self.n, self.k, num_rows / num_experts, packed_stack))
        return paths

    def single_format(self) -> WeightFormat | None:
        return next(iter(self.stacks.values())).format if len(self.stacks) == 1 else None


class QuantizedExperts(Experts):
    """Inference replacement for FFNExperts / SwiGLUExperts with one format per expert.

        quantized = QuantizedExperts.from_experts(layer.experts, ["fp8"] * 4 + ["mxfp4"] * 4)
    """

    def __init__(self, kind: type[Experts], num_experts: int, model_dim: int, hidden_size: int,
                 formats: list[str], act, bias_dtype: torch.dtype = torch.float32, device=None):
        super().__init__(num_experts, model_dim, hidden_size)
        if len(formats) != num_experts:
            raise ValueError(f"formats must name one format per expert ({num_experts}), got {len(formats)}")
        if kind not in WEIGHT_NAMES:
            raise ValueError(f"experts to quantize must be one of {[k.__name__ for k in WEIGHT_NAMES]}, got {kind.__name__}")
        self.kind = kind
        self.formats = list(formats)
        self.act = act
        d, h = model_dim, hidden_size
        shapes = {"w1": (h, d), "w2": (d, h), "w_gate": (h, d), "w_up": (h, d), "w_down": (d, h)}  # (N, K)
        self.weights = nn.ModuleDict({name: QuantizedWeight(formats, *shapes[name], device) for name in WEIGHT_NAMES[kind]})
        if kind is FFNExperts:
            self.register_buffer("b1", torch.zeros(num_experts, h, dtype=bias_dtype, device=device))
            self.register_buffer("b2", torch.zeros(num_experts, d, dtype=bias_dtype, device=device))

    @classmethod
    @torch.no_grad()
    def from_experts(cls, experts: Experts, formats: list[str]) -> "QuantizedExperts":
        kind = type(experts)
        if kind not in WEIGHT_NAMES:
            raise ValueError(
                f"experts to quantize must be one of {[k.__name__ for k in WEIGHT_NAMES]}, got {kind.__name__}"
            )
        first = getattr(experts, WEIGHT_NAMES[kind][0])
        quantized = cls(kind, experts.num_experts, experts.model_dim, experts.hidden_size, formats, experts.act,
                        bias_dtype=first.dtype, device=first.device)
        for name, weight in quantized.weights.items():
            weight.quantize(getattr(experts, name).detach())
        if kind is FFNExperts:
            quantized.b1.copy_(experts.b1)
            quantized.b2.copy_(experts.b2)
        return quantized

    def forward(self, x_RD: torch.Tensor, counts_E: torch.Tensor, capacity: int | None) -> torch.Tensor:
        if capacity is None:
            starts_E = torch.cumsum(counts_E, 0) - counts_E
        else:
            starts_E = torch.arange(self.num_experts, device=counts_E.device) * capacity
        if x_RD.is_cuda:
            return self._cuda_forward(x_RD, starts_E, counts_E, capacity is None)
        starts, counts = starts_E.tolist(), counts_E.tolist()

        def linear(name: str, x_RK: torch.Tensor) -> torch.Tensor:
            return self.weights[name](x_RK, starts, counts)

        if self.kind is FFNExperts:
            expert_R = self._row_expert(starts_E, counts_E, x_RD.size(0))
            h_RH = self.act(linear("w1", x_RD) + self._row_bias(self.b1, expert_R, x_RD.dtype))
            return linear("w2", h_RH) + self._row_bias(self.b2, expert_R, x_RD.dtype)
        h_RH = self.act(linear("w_gate", x_RD)) * linear("w_up", x_RD)
        return linear("w_down", h_RH)

    def _cuda_forward(self, x_RD: torch.Tensor, starts_E: torch.Tensor, counts_E: torch.Tensor,
                      packed: bool) -> torch.Tensor:
        """The CUDA forward in bf16; the result comes back in x's dtype."""
        num_rows = x_RD.size(0)
        starts32_E, counts32_E = starts_E.to(torch.int32), counts_E.to(torch.int32, copy=True)  # changed below
        if packed:  # the last expert absorbs the padding rows (if any), so every output row is written
            counts32_E[-1] = num_rows - starts32_E[-1]

        def linear(name: str, inputs: ExpertInput) -> torch.Tensor:
            return self.weights[name].cuda_forward(inputs, starts32_E, counts32_E, num_rows, packed)

        x = ExpertInput(x_RD.to(torch.bfloat16).contiguous())
        if self.kind is FFNExperts:
            expert_R = self._row_expert(starts_E, counts_E, num_rows)
            h_RH = self.act(linear("w1", x) + self._row_bias(self.b1, expert_R, torch.bfloat16))
            return (linear("w2", ExpertInput(h_RH)) + self._row_bias(self.b2, expert_R, torch.bfloat16)).to(x_RD.dtype)
        gate_RH, up_RH = linear("w_gate", x), linear("w_up", x)
        down = self.weights["w_down"].single_format()
        if down is not None and down.name in ACTIVATION_GROUP and self.act is F.silu and kernels.available():
            # The down projection's FP8 input straight from gate and up: h is never written in bf16.
            group = ACTIVATION_GROUP[down.name] or self.hidden_size
            h = ExpertInput(None, {group: kernels.quantize_fp8(gate_RH, group, up_RH)})
        else:
            h = ExpertInput(self.act(gate_RH) * up_RH)
        return linear("w_down", h).to(x_RD.dtype)

    def cuda_paths(self, num_rows: int, capacity: int | None = None) -> str:
        """The CUDA paths this layer's GEMMs take for a buffer of num_rows rows, e.g. "triton"."""
        paths = set()
        for weight in self.weights.values():
            paths |= weight.cuda_paths(num_rows, self.num_experts, capacity is None)
        return "+".join(sorted(paths))

    def _row_expert(self, starts_E: torch.Tensor, counts_E: torch.Tensor, num_rows: int) -> torch.Tensor:
        """The expert of each buffer row, or num_experts for padding rows."""
        row_R = torch.arange(num_rows, device=starts_E.device)
        # Starts never decrease, so the last expert starting at or before r is the only one that can own r.
        expert_R = torch.searchsorted(starts_E, row_R, right=True) - 1
        owned_R = row_R - starts_E[expert_R] < counts_E[expert_R]
        return torch.where(owned_R, expert_R, self.num_experts)

    @staticmethod
    def _row_bias(b_EO: torch.Tensor, expert_R: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Each row's expert bias; padding rows get zero, so their output stays exactly zero."""
        return torch.cat([b_EO, b_EO.new_zeros(1, b_EO.size(1))])[expert_R].to(dtype)

    def extra_repr(self) -> str:
        return f"kind={self.kind.__name__}, formats={self.formats}"
