"""Expert-weight memory report and quantized checkpoints.

A quantized checkpoint is one torch.save file: the model's state_dict (quantized experts as their
stored tensors: FP8 bytes, packed FP4 bytes, scales) and the plan (each layer's expert formats).
Load it into a model built the same way as the one that was quantized:

    save_quantized(model, plan, "model.fp4.pt")
    model = build_model(...)            # float weights, any values
    load_quantized(model, "model.fp4.pt")
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moetrain.moe import moe_layers
from moetrain.quant.experts import QuantizedExperts
from moetrain.quant.policy import apply_plan

CHECKPOINT_VERSION = 1


@dataclass
class FormatMemory:
    format: str
    matrices: int  # expert weight matrices stored in this format
    elements: int  # weight values they hold
    bytes: int  # bytes actually stored: values (with block padding) + scales

    @property
    def bf16_bytes(self) -> int:
        return 2 * self.elements

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.bytes / self.elements if self.elements else 0.0


def expert_memory(model: nn.Module) -> dict[str, FormatMemory]:
    """Memory of the routed-expert weight matrices (biases excluded), by format, over all MoE layers.
    Layers that are not quantized count as their parameters' dtype under the name "unquantized"."""
    report: dict[str, FormatMemory] = {}
    for layer in moe_layers(model):
        experts = layer.experts
        if isinstance(experts, QuantizedExperts):
            for weight in experts.weights.values():
                for name, stack in weight.stacks.items():
                    row = report.setdefault(name, FormatMemory(name, 0, 0, 0))
                    row.matrices += len(stack.experts)
                    row.elements += len(stack.experts) * stack.n * stack.k
                    row.bytes += sum(t.numel() * t.element_size() for t in stack.stored().values())
        else:
            row = report.setdefault("unquantized", FormatMemory("unquantized", 0, 0, 0))
            for param in experts.parameters():
                if param.dim() == 3:  # [E, in, out] weight matrices; [E, out] biases are left out
                    row.matrices += param.size(0)
                    row.elements += param.numel()
                    row.bytes += param.numel() * param.element_size()
    return report


def format_memory(report: dict[str, FormatMemory]) -> str:
    """The report as a small table, with a total line against bf16."""
    lines = [f"{'format':<12} {'matrices':>8} {'weights':>12} {'MiB':>10} {'bits/weight':>11} {'vs bf16':>8}"]
    total = FormatMemory("total", 0, 0, 0)
    for row in list(report.values()):
        total.matrices += row.matrices
        total.elements += row.elements
        total.bytes += row.bytes
    for row in list(report.values()) + [total]:
        ratio = row.bytes / row.bf16_bytes if row.elements else 0.0
        lines.append(f"{row.format:<12} {row.matrices:>8} {row.elements:>12} {row.bytes / 2**20:>10.3f} "
                     f"{row.bits_per_weight:>11.3f} {ratio:>8.3f}")
    return "\n".join(lines)


def save_quantized(model: nn.Module, plan: list[list[str]], path: str) -> None:
    torch.save({"version": CHECKPOINT_VERSION, "plan": plan, "state_dict": model.state_dict()}, path)


def load_quantized(model: nn.Module, path: str) -> list[list[str]]:
    """Lay the model's MoE layers out as the checkpoint's plan and load every tensor (strict).
    Returns the plan."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if checkpoint.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path} is not a moetrain quantized checkpoint of version {CHECKPOINT_VERSION}")
    apply_plan(model, checkpoint["plan"])
    model.load_state_dict(checkpoint["state_dict"], strict=True)
    return checkpoint["plan"]
