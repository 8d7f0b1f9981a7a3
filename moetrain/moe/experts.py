"""Routed experts and shared experts.

Routed experts see the expert-major buffer: forward(x_RD, counts_E, capacity) where expert e's
rows are [e*capacity, e*capacity + counts_E[e]) in the padded layout (capacity is an int; the
rest of the block is zero padding) or [sum(counts_E[:e]), ... + counts_E[e]) in the packed layout
(capacity is None; rows past sum(counts_E) are padding). A custom expert subclasses Experts and
implements that forward; only the real rows' outputs are read.

Every routed-expert parameter is tagged `moe_expert = True` (see is_expert_param), which is how
the distributed optimizer knows to reduce it only across the ranks holding the same expert.
Shared experts (DeepSeekMoE) are a DenseFeedForward that sees every token; their parameters are shared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moetrain import ops
from moetrain.ops import packed_bias, swiglu
from moetrain.ops.grouped import add_expert_bias, expert_matmul, expert_of_rows, padded_matmul, padded_uses_bmm


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


def mark_expert(param: nn.Parameter) -> nn.Parameter:
    param.moe_expert = True
    return param


def is_expert_param(param: torch.Tensor) -> bool:
    """True for parameters of routed experts (each rank may hold different experts)."""
    return bool(getattr(param, "moe_expert", False))


def _uniform(shape, fan_in: int) -> nn.Parameter:
    bound = 1.0 / math.sqrt(fan_in)
    return mark_expert(nn.Parameter(torch.empty(shape).uniform_(-bound, bound)))


@dataclass
class TokenRows:
    """The expert-major rows as copies of tokens, not yet gathered: row r is token t's where
    dest_TK[t, k] == r, and zero where no token's, as moetrain.ops.dispatch would make them. In FP8
    precision MoELayer hands it to the built-in experts, whose first GEMM (Experts.matmul) then
    quantizes each token once and gathers its FP8 rows (moetrain.precision.fp8_matmul.fp8_token_matmul);
    in bf16 it is gathered first. Under expert parallelism the rows live on other ranks
    (moetrain.parallel.expert.ExchangedTokenRows: the FP8 rows travel)."""

    x_TD: torch.Tensor
    dest_TK: torch.Tensor
    num_rows: int
    impl: str = "kernel"

    def gather(self) -> torch.Tensor:
        """The rows themselves, [num_rows, D] (differentiable in x_TD)."""
        return ops.dispatch(self.x_TD, self.dest_TK, self.num_rows, impl=self.impl)

    def fp8_matmul(self, w_EIO: torch.Tensor, counts_E, capacity: int | None, precision: str,
                   wgrad: str) -> torch.Tensor:
        """Experts.matmul in FP8 `precision` (weight gradient in `wgrad`) on these rows, each token
        quantized once."""
        # Imported here: the FP8 GEMMs load Triton, which a bf16 layer never needs.
        from moetrain.precision.fp8_matmul import fp8_token_matmul  # noqa: PLC0415

        return fp8_token_matmul(self.x_TD, self.dest_TK, self.num_rows, w_EIO, counts_E, capacity, precision,
                                self.impl, wgrad)


class Experts(nn.Module):
    """Base class for routed experts: num_experts independent networks model_dim -> model_dim.

    impl ("kernel" or "torch", set by MoELayer to its own) says whether compiled kernels may be
    used inside the experts (FFNExperts' fused epilogue); "torch" keeps them pure torch.
    precision ("bf16", "fp8" or "fp8_block", set by MoELayer to its own) is how the expert GEMMs
    multiply: "bf16" in the operands' dtype, "fp8" the forward and input-gradient GEMMs in FP8 with
    row-wise scales, "fp8_block" the same with DeepSeek-V3's 1x128 / 128x128 block scales
    (moetrain.precision.fp8_matmul); fp8_wgrad ("bf16" or "fp8", also set by MoELayer) is the weight
    gradient's GEMM under either FP8 recipe. Custom experts call self.matmul to follow both."""

    impl: str = "torch"
    precision: str = "bf16"
    fp8_wgrad: str = "bf16"

    def __init__(self, num_experts: int, model_dim: int, hidden_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.model_dim = model_dim
        self.hidden_size = hidden_size

    def forward(self, x_RD: torch.Tensor, counts_E: torch.Tensor, capacity: int | None,
                part: str = "all") -> torch.Tensor:
        """The experts on the expert-major rows x_RD -> [R, model_dim]: project(hidden(x)).

        Subclasses implement hidden (the first GEMM and the activation -> [R, H]) and project (the
        output GEMM), or override forward as a whole. part ("hidden" or "project") runs one of the
        two: selective activation checkpointing recomputes the hidden part alone and keeps the
        output GEMM's input, so that GEMM runs once (moetrain.moe.recompute.checkpoint_experts)."""
        if part == "hidden":
            return self.hidden(x_RD, counts_E, capacity)
        if part == "project":
            return self.project(x_RD, counts_E, capacity)
        y_RD = self.fused(x_RD, counts_E, capacity)
        return self.project(self.hidden(x_RD, counts_E, capacity), counts_E, capacity) if y_RD is None else y_RD

    def fused(self, x_RD: torch.Tensor | TokenRows, counts_E: torch.Tensor, capacity: int | None) -> torch.Tensor | None:
        """Both parts at once where a subclass has a faster way for these rows, or None (then hidden,
        then project). Selective checkpointing runs the parts apart and never calls it."""
        return None

    def hidden(self, x_RD: torch.Tensor, counts_E: torch.Tensor, capacity: int | None) -> torch.Tensor:
        raise NotImplementedError  # pragma: no cover - interface

    def project(self, h_RH: torch.Tensor, counts_E: torch.Tensor, capacity: int | None) -> torch.Tensor:
        raise NotImplementedError  # pragma: no cover - interface

    def matmul(self, x_RI: torch.Tensor | TokenRows, w_EIO: torch.Tensor, counts_E, capacity: int | None) -> torch.Tensor:
        """expert_matmul in this experts' precision; x_RI: the rows, or TokenRows to gather them from."""
        if self.precision != "bf16":
            if isinstance(x_RI, TokenRows):
                return x_RI.fp8_matmul(w_EIO, counts_E, capacity, self.precision, self.fp8_wgrad)
            # Imported here: the FP8 GEMMs load Triton, which a bf16 layer never needs.
            from moetrain.precision.fp8_matmul import fp8_expert_matmul  # noqa: PLC0415

            return fp8_expert_matmul(x_RI, w_EIO, counts_E, capacity, self.precision, self.fp8_wgrad)
        if isinstance(x_RI, TokenRows):
            x_RI = x_RI.gather()
        return expert_matmul(x_RI, w_EIO, counts_E, capacity)


class FFNExperts(Experts):
    """Two-matrix FFN per expert: act(x @ w1 + b1) @ w2 + b2."""

    def __init__(self, num_experts: int, model_dim: int, hidden_size: int, activation: str = "relu"):
        super().__init__(num_experts, model_dim, hidden_size)
        self.activation = activation
        self.act = activation_fn(activation)
        self.w1 = _uniform((num_experts, model_dim, hidden_size), model_dim)
        self.b1 = mark_expert(nn.Parameter(torch.zeros(num_experts, hidden_size)))
        self.w2 = _uniform((num_experts, hidden_size, model_dim), hidden_size)
        self.b2 = mark_expert(nn.Parameter(torch.zeros(num_experts, model_dim)))

    def _padded_fused(self, capacity: int | None) -> bool:
        """The padded layout's fused epilogue: each GEMM's bias (and the ReLU) added in place in one
        pass over its output (moetrain.ops.bias_act) instead of a broadcasting add and an activation."""
        return capacity is not None and self.impl == "kernel" and padded_uses_bmm() and self.precision == "bf16"

    def _packed_fused(self, y_RO: torch.Tensor, b_EO: torch.Tensor, capacity: int | None) -> bool:
        """The packed layout's fused epilogue on CUDA: a GEMM's bias (and the ReLU) in one pass over
        its output (moetrain.ops.packed_bias) instead of a one-hot GEMM epilogue and an activation."""
        return capacity is None and self.impl == "kernel" and packed_bias.kernel_runs(y_RO, b_EO.to(y_RO.dtype))

    def hidden(self, x_RD, counts_E, capacity):
        relu = self.activation == "relu"
        if self._padded_fused(capacity):
            h_ECH = padded_matmul(x_RD, self.w1, capacity)
            h_RH = ops.bias_act(h_ECH, self.b1.to(h_ECH.dtype), capacity, relu).view(-1, self.hidden_size)
        else:
            h_RH = self.matmul(x_RD, self.w1, counts_E, capacity)
            if not self._packed_fused(h_RH, self.b1, capacity):
                return self.act(add_expert_bias(h_RH, self.b1, counts_E, capacity))
            expert_R = expert_of_rows(counts_E, h_RH.size(0))
            h_RH = packed_bias.packed_bias_act(h_RH, self.b1.to(h_RH.dtype), expert_R, relu)
        return h_RH if relu else self.act(h_RH)

    def project(self, h_RH, counts_E, capacity):
        if self._padded_fused(capacity):
            y_ECD = padded_matmul(h_RH, self.w2, capacity)
            return ops.bias_act(y_ECD, self.b2.to(y_ECD.dtype), capacity, False).view(-1, self.model_dim)
        y_RD = self.matmul(h_RH, self.w2, counts_E, capacity)
        if not self._packed_fused(y_RD, self.b2, capacity):
            return add_expert_bias(y_RD, self.b2, counts_E, capacity)
        return packed_bias.packed_bias_act(y_RD, self.b2.to(y_RD.dtype), expert_of_rows(counts_E, y_RD.size(0)), False)


class SwiGLUExperts(Experts):
    """SwiGLU per expert (Llama, Qwen3, DeepSeek): (silu(x @ w_gate) * (x @ w_up)) @ w_down.

    The gate and up projections are one parameter, w_gate_up [E, D, 2H], whose columns alternate
    gate and up (column 2j is gate unit j, 2j+1 up unit j): one grouped GEMM computes both (one
    read of the tokens, one larger GEMM), the activation reads each unit's pair side by side
    (moetrain.ops.swiglu), and a slice j0:j1 of the hidden units is columns 2*j0:2*j1 (what
    adaptive_r > 1 cuts). w_gate and w_up read as views of it; state dicts with separate w_gate and
    w_up entries (moetrain before the fused layout) still load."""

    def __init__(self, num_experts: int, model_dim: int, hidden_size: int, activation: str = "silu"):
        super().__init__(num_experts, model_dim, hidden_size)
        self.act = activation_fn(activation)
        self.activation = activation
        # Drawn in the order of the separate parameters (gate, up, down): same seed, same values.
        w_gate = _uniform((num_experts, model_dim, hidden_size), model_dim)
        w_up = _uniform((num_experts, model_dim, hidden_size), model_dim)
        self.w_gate_up = mark_expert(nn.Parameter(swiglu.interleave_gate_up(w_gate.data, w_up.data)))
        self.w_down = _uniform((num_experts, hidden_size, model_dim), hidden_size)
        self.register_load_state_dict_pre_hook(_fuse_gate_up_entries)

    @property
    def w_gate(self) -> torch.Tensor:
        """[E, D, H] view of the gate projection's columns of w_gate_up."""
        return swiglu.split_gate_up(self.w_gate_up)[0]

    @property
    def w_up(self) -> torch.Tensor:
        """[E, D, H] view of the up projection's columns of w_gate_up."""
        return swiglu.split_gate_up(self.w_gate_up)[1]

    def fused(self, x_RD, counts_E, capacity):
        """In row-wise FP8 on TokenRows, the two GEMMs and SwiGLU as the fused operators of
        moetrain.precision.fp8_matmul.fp8_token_swiglu_experts (the same numbers); else None."""
        if self.precision != "fp8" or type(x_RD) is not TokenRows or self.activation != "silu" or self.impl != "kernel":
            return None
        # Imported here: the FP8 GEMMs load Triton, which a bf16 layer never needs.
        from moetrain.precision.fp8_matmul import fp8_token_swiglu_experts  # noqa: PLC0415

        return fp8_token_swiglu_experts(x_RD.x_TD, x_RD.dest_TK, x_RD.num_rows, self.w_gate_up, self.w_down,
                                        counts_E, capacity, x_RD.impl, self.fp8_wgrad)

    def hidden(self, x_RD, counts_E, capacity):
        gate_up_RH2 = self.matmul(x_RD, self.w_gate_up, counts_E, capacity)
        return swiglu.gated_activation(gate_up_RH2, self.activation, self.impl)

    def project(self, h_RH, counts_E, capacity):
        return self.matmul(h_RH, self.w_down, counts_E, capacity)


def _fuse_gate_up_entries(module, state_dict, prefix, *args) -> None:
    """load_state_dict pre-hook: separate w_gate and w_up entries become the fused w_gate_up."""
    gate, up = prefix + "w_gate", prefix + "w_up"
    if gate in state_dict and up in state_dict and prefix + "w_gate_up" not in state_dict:
        state_dict[prefix + "w_gate_up"] = swiglu.interleave_gate_up(state_dict.pop(gate), state_dict.pop(up))


def splits_hidden(experts: Experts) -> bool:
    """Whether the experts run as hidden then project (Experts.forward), so that the hidden part
    can be recomputed alone; experts that override forward as a whole are recomputed whole."""
    return type(experts).forward is Experts.forward


EXPERTS: dict[str, type[Experts]] = {"ffn": FFNExperts, "swiglu": SwiGLUExperts}


def build_experts(expert, num_experts: int, model_dim: int, hidden_size: int, activation: str) -> Experts:
    """expert: "ffn" | "swiglu", an Experts subclass (built like the built-ins), or an instance."""
    if isinstance(expert, Experts):
        if expert.num_experts != num_experts or expert.model_dim != model_dim:
            raise ValueError(
                f"the experts instance has num_experts={expert.num_experts}, model_dim={expert.model_dim}; "
                f"the layer needs {num_experts} and {model_dim}"
            )
        return expert
    if isinstance(expert, type) and issubclass(expert, Experts):
        return expert(num_experts, model_dim, hidden_size, activation=activation)
    if isinstance(expert, str) and expert in EXPERTS:
        if expert == "swiglu" and activation == "relu":
            activation = "silu"  # SwiGLU is defined with SiLU; relu is only the FFN default
        return EXPERTS[expert](num_experts, model_dim, hidden_size, activation=activation)
    raise ValueError(f"expert must be one of {sorted(EXPERTS)} or an Experts subclass/instance, got {expert!r}")


DENSE_FFNS = ("ffn", "swiglu")


class DenseFeedForward(nn.Module):
    """A dense MLP that sees every token: the FFN of non-MoE blocks, and the MoE layer's shared
    experts (DeepSeekMoE's, fused into one MLP). "ffn" is Linear-act-Linear with biases (ViT,
    Switch); "swiglu" is down(act(gate(x)) * up(x)) without biases (DeepSeek, Qwen, Mixtral)."""

    def __init__(self, dim: int, hidden_size: int, kind: str = "ffn", activation: str = "gelu"):
        super().__init__()
        if kind not in DENSE_FFNS:
            raise ValueError(f"dense ffn must be one of {DENSE_FFNS}, got {kind!r}")
        self.kind = kind
        self.activation = activation_fn(activation)
        if kind == "ffn":
            self.fc1 = nn.Linear(dim, hidden_size)
            self.fc2 = nn.Linear(hidden_size, dim)
        else:
            self.gate_proj = nn.Linear(dim, hidden_size, bias=False)
            self.up_proj = nn.Linear(dim, hidden_size, bias=False)
            self.down_proj = nn.Linear(hidden_size, dim, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.kind == "ffn":
            return self.fc2(self.activation(self.fc1(x_TD)))
        return self.down_proj(self.activation(self.gate_proj(x_TD)) * self.up_proj(x_TD))
