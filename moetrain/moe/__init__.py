"""The MoE layer and its parts (gates, routing, experts, losses)."""

from __future__ import annotations

import torch
from torch import nn

from moetrain.moe.experts import EXPERTS, DenseFeedForward, Experts, FFNExperts, SwiGLUExperts, is_expert_param
from moetrain.moe.gates import GATES, Gate, GateOutput, register_gate
from moetrain.moe.layer import MoELayer, RoutingStats, moe_layers, set_activation_checkpointing
from moetrain.moe.recompute import CheckpointedBlock
from moetrain.moe.routing import RoutingPlan, make_plan
from moetrain.moe.cosine_gate import CosineGate
from moetrain.moe.sigmoid_gate import SigmoidGate
from moetrain.moe.top_gate import TopKGate

__all__ = [
    "EXPERTS", "GATES", "CosineGate", "DenseFeedForward", "Experts", "FFNExperts", "Gate", "GateOutput", "MoELayer", "RoutingPlan",
    "RoutingStats", "SigmoidGate", "SwiGLUExperts", "TopKGate", "is_expert_param", "make_plan",
    "moe_layers", "register_gate", "set_activation_checkpointing", "set_parameter_dtype", "set_training_precision",
    "update_router_biases",
]


def set_parameter_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast every floating-point parameter of `model` to dtype in place, except the MoE routers', which
    stay fp32 (routing decisions are taken in fp32 in every preset). Buffers (rotary tables, router
    biases, statistics) keep their dtype; tied parameters stay tied."""
    routers = {id(p) for layer in moe_layers(model) for p in layer.gate.parameters()}
    for parameter in model.parameters():
        if parameter.is_floating_point() and id(parameter) not in routers:
            parameter.data = parameter.data.to(dtype)


# The projections whose output gradient comes out of per-head kernels (q/k norm, rotary, attention):
# a per-token amax over all heads cannot share their kernels, so with fp8_linears their input
# gradient stays a bf16 GEMM (o_proj's and the dense FFNs' are FP8).
BF16_DGRAD_LINEARS = ("q_proj", "k_proj", "v_proj")


def set_training_precision(model: nn.Module, precision: str, fp8_wgrad: str = "bf16",
                           fp8_linears: bool = False) -> list[str]:
    """How `model` trains its GEMMs: every MoE layer's experts in `precision` ("bf16", "fp8" or
    "fp8_block"; the weight gradient's GEMM in fp8_wgrad). fp8_linears (with "fp8" only): the dense
    linears of every transformer block too (attention projections, dense FFNs, shared experts:
    row-wise FP8, moetrain.precision.fp8_linear), where their features are multiples of 16; the
    names of those put in FP8 are returned (none is an error). Embeddings, routers and output heads
    keep the compute dtype."""
    if fp8_linears and precision != "fp8":
        raise ValueError(f"fp8_linears applies only with precision 'fp8' (row-wise scales), not {precision!r}")
    for layer in moe_layers(model):
        layer.precision = precision
        layer.fp8_wgrad = fp8_wgrad
    if not fp8_linears:
        return []
    # Imported here: the dense FP8 GEMMs are never loaded by a model that does not use them.
    from moetrain.precision.fp8_linear import use_fp8_linears  # noqa: PLC0415

    replaced = []
    for name, block in [(n, m) for n, m in model.named_modules() if isinstance(m, CheckpointedBlock)]:
        replaced += [f"{name}.{linear}" for linear in use_fp8_linears(block, bf16_dgrad=BF16_DGRAD_LINEARS)]
    if not replaced:
        raise ValueError("fp8_linears: the model's transformer blocks have no dense linear whose input and output "
                         "features are multiples of 16, which the FP8 GEMMs need; leave fp8_linears off")
    return replaced


def update_router_biases(model: nn.Module, skip: torch.Tensor | None = None) -> None:
    """Apply the aux-loss-free bias update of every gate that has one; call after optimizer.step().
    skip: a bool tensor; where true (a skipped step) no gate changes (Gate.update_bias)."""
    for layer in moe_layers(model):
        layer.gate.update_bias(skip)
