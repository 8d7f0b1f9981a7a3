"""The gate (router) interface and the registry of built-in gates.

A gate maps tokens to a choice of k experts and the weights that combine their outputs.
Shape letters used across moetrain/moe: T tokens, D model dim, E experts, K choices per token
(top-k), H expert hidden size, R rows of the expert-major buffer, N = T*K routing entries.

To add a gate: subclass Gate in a new file, implement forward(), and either pass the class to
MoELayer(gate=MyGate) or register it by name with @register_gate("name", MySettings). A gate's own
settings are declared once, as the dataclass registered with it (the keyword arguments its
constructor takes); the command line offers each field as gate.FIELD and gate.type=name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass
class GateOutput:
    logits_TE: torch.Tensor  # raw router logits, fp32 (the z-loss reads them)
    probs_TE: torch.Tensor  # per-token distribution over experts, fp32 (the balance loss reads it)
    topk_idx_TK: torch.Tensor  # int64 chosen experts, best first
    topk_weight_TK: torch.Tensor  # fp32 weights that combine the chosen experts' outputs
    # Score that batch-prioritized routing orders tokens by, highest first; None: Tutel's, see priority().
    priority_T: torch.Tensor | None = None

    def priority(self) -> torch.Tensor:
        """[T] batch-prioritized routing's score: priority_T when the gate set one, else Tutel's, the
        token's largest router probability (for a softmax gate its raw top-1 probability, whatever
        renormalisation the k combine weights get)."""
        return self.priority_T if self.priority_T is not None else self.probs_TE.amax(dim=-1)


class Gate(nn.Module):
    """Base class. Subclasses are built as Cls(model_dim, num_experts, **gate_kwargs).

    impl ("kernel" or "torch", set by MoELayer to its own) says whether the router may use the
    compiled kernels (moetrain.ops.router_logits)."""

    impl: str = "torch"
    # The dataclass of the constructor's keyword arguments (register_gate sets it); None: none declared.
    Settings: type | None = None

    def __init__(self, model_dim: int, num_experts: int):
        super().__init__()
        self.model_dim = model_dim
        self.num_experts = num_experts

    def forward(self, x_TD: torch.Tensor, top_k: int) -> GateOutput:  # pragma: no cover - interface
        raise NotImplementedError

    def update_bias(self, skip: torch.Tensor | None = None) -> None:
        """Called after each optimizer step; gates without a load-balancing bias do nothing. skip: a
        bool tensor on the gate's device; where true, the step was skipped and the gate is left as it
        was (decided on the device, so the caller need not wait for it)."""


GATES: dict[str, type[Gate]] = {}


def register_gate(name: str, settings: type | None = None) -> Callable[[type[Gate]], type[Gate]]:
    """Make a Gate subclass known by `name` (MoELayer(gate=name), gate.type=name on the command line).
    settings: the dataclass of the keyword arguments its constructor takes, declared next to it
    (Gate.Settings); a gate registered without one takes no settings from the command line."""
    if settings is not None and not dataclasses.is_dataclass(settings):
        raise TypeError(f"settings of gate {name!r} must be a dataclass, got {settings!r}")

    def add(cls: type[Gate]) -> type[Gate]:
        if settings is not None:
            cls.Settings = settings
        GATES[name] = cls
        return cls

    return add


def build_gate(gate, model_dim: int, num_experts: int, gate_kwargs: dict | None) -> Gate:
    """gate: a registered name, a Gate subclass, or a ready Gate instance."""
    if isinstance(gate, Gate):
        if gate_kwargs:
            raise ValueError("gate_kwargs cannot be combined with a Gate instance; configure the instance instead")
        return gate
    if isinstance(gate, type) and issubclass(gate, Gate):
        cls = gate
    elif isinstance(gate, str) and gate in GATES:
        cls = GATES[gate]
    else:
        raise ValueError(f"gate must be one of {sorted(GATES)} or a Gate subclass/instance, got {gate!r}")
    try:
        return cls(model_dim, num_experts, **(gate_kwargs or {}))
    except TypeError as error:
        raise ValueError(f"gate_kwargs {sorted(gate_kwargs or {})} do not fit gate {cls.__name__}: {error}") from None


def router_float(x: torch.Tensor) -> torch.Tensor:
    """Routers compute in fp32 even for bf16/fp16 activations (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def softmax_topk(logits_TE: torch.Tensor, top_k: int, normalize: bool) -> GateOutput:
    """Softmax over experts in fp32, then the k largest probabilities (Switch k=1, GShard k=2),
    renormalised to sum to one with normalize. Batch priority stays the raw top probability."""
    probs_TE = torch.softmax(logits_TE, dim=-1)
    weight_TK, idx_TK = torch.topk(probs_TE, top_k, dim=-1)
    if normalize:
        weight_TK = weight_TK / weight_TK.sum(-1, keepdim=True)
    return GateOutput(logits_TE, probs_TE, idx_TK, weight_TK)
