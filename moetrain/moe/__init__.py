"""The MoE layer and its parts (gates, routing, experts, losses)."""

from __future__ import annotations

from torch import nn

from moetrain.moe.experts import EXPERTS, DenseFeedForward, Experts, FFNExperts, SwiGLUExperts, is_expert_param
from moetrain.moe.gates import GATES, Gate, GateOutput, register_gate
from moetrain.moe.layer import MoELayer, RoutingStats, moe_layers, set_activation_checkpointing
from moetrain.moe.routing import RoutingPlan, make_plan
from moetrain.moe.cosine_gate import CosineGate
from moetrain.moe.sigmoid_gate import SigmoidGate
from moetrain.moe.top_gate import TopKGate

__all__ = [
    "EXPERTS", "GATES", "CosineGate", "DenseFeedForward", "Experts", "FFNExperts", "Gate", "GateOutput", "MoELayer", "RoutingPlan",
    "RoutingStats", "SigmoidGate", "SwiGLUExperts", "TopKGate", "is_expert_param", "make_plan",
    "moe_layers", "register_gate", "set_activation_checkpointing", "update_router_biases",
]


def update_router_biases(model: nn.Module) -> None:
    """Apply the aux-loss-free bias update of every gate that has one; call after optimizer.step()."""
    for layer in moe_layers(model):
        layer.gate.update_bias()
