"""Anatomy of one language-model training step: where its time goes, part by part.

    python -m moetrain.models.throughput --preset moe_1b5 --batch-size 16 --seq-len 2048 --anatomy

One forward pass of the model records the inputs of the first module of each kind. Each part is then
timed alone, forward + backward (gradients of its inputs and parameters, none accumulated), on those
inputs, and multiplied by how many such modules the model has:

  attention        the attention module of a block (projections, rotary, SDPA)
  norms            one RMSNorm (2 per block + the final one)
  dense FFN        the FFN of a dense block
  router           an MoE layer's gate (router logits, softmax/sigmoid, top-k)
  expert GEMMs     an MoE layer's routed experts on their dispatched rows (GEMMs and activation)
  shared experts   an MoE layer's shared experts
  routing          the rest of an MoE layer: routing plan, dispatch, combine, balance loss
  head             the output projection (lm_head) on the final hidden states
  loss             cross-entropy on the logits (float32, as the trainer computes it)
  optimizer        one AdamW step over every parameter
  other            the whole step minus all of the above: embedding, residual adds, the host's
                   launch gaps, and what running the parts together saves or costs
Parts are timed eagerly; with --compile the step itself is compiled, so "other" also holds what
compilation saves. Times are medians of CUDA-event timings (host clock on a CPU).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.models.layers import Attention, LatentAttention
from moetrain.models.lm import MoETransformerLM
from moetrain.moe import DenseFeedForward, MoELayer

PARTS = ("attention", "norms", "dense FFN", "router", "expert GEMMs", "shared experts", "routing", "head", "loss",
         "optimizer", "other")


def _detached(value, differentiable: bool = True):
    """A copy of a module's argument; top-level float tensors require grad (rotary tables inside a
    tuple do not)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().clone()
        return value.requires_grad_() if differentiable and value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_detached(v, False) for v in value)
    return value


def _grad_targets(args: tuple, module: nn.Module) -> list[torch.Tensor]:
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return inputs + [p for p in module.parameters() if p.requires_grad]


def _forward_backward(module: nn.Module, args: tuple) -> Callable[[], None]:
    """Forward, then backward from a fixed random gradient of the output (made once, outside the
    timed step, so the step does exactly the module's own work)."""
    targets = _grad_targets(args, module)

    def output(out):
        return out.logits_TE if hasattr(out, "logits_TE") else out  # a gate: its logits carry the gradient

    with torch.no_grad():
        upstream = torch.randn_like(output(module(*args)))

    def step():
        torch.autograd.grad(output(module(*args)), targets, upstream, allow_unused=True)

    return step


def _first_inputs(model: nn.Module, kinds: dict[str, Callable[[nn.Module], bool]], run: Callable[[], None]) -> dict:
    """{kind: (module, args)} for the first module of each kind that runs during run()."""
    captured: dict[str, tuple[nn.Module, tuple]] = {}
    handles = []
    for module in model.modules():
        for kind, matches in kinds.items():
            if matches(module):
                def hook(mod, args, kind=kind):
                    if kind not in captured:
                        captured[kind] = (mod, tuple(_detached(a) for a in args))
                handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return captured


def step_anatomy(model: MoETransformerLM, tokens_BT: torch.Tensor, optimizer: torch.optim.Optimizer,
                 full_step_ms: float, time_ms: Callable[[Callable[[], None]], float]) -> dict[str, dict]:
    """{part: {"ms": time per step, "count": modules of that kind}} for one training step of
    `model` on tokens_BT (inputs [B, T+1]); full_step_ms is the measured whole step, time_ms times a
    callable (median milliseconds)."""
    moe = [m for m in model.modules() if isinstance(m, MoELayer)]
    dense = [b.ffn for b in model.blocks if isinstance(b.ffn, DenseFeedForward)]
    kinds = {
        "attention": lambda m: isinstance(m, (Attention, LatentAttention)),
        "norms": lambda m: isinstance(m, (nn.RMSNorm, nn.LayerNorm)),
        "dense FFN": lambda m: any(m is d for d in dense),
        "moe": lambda m: isinstance(m, MoELayer),
        "router": lambda m: any(m is layer.gate for layer in moe),
        "expert GEMMs": lambda m: any(m is layer.experts for layer in moe),
        "shared experts": lambda m: any(m is layer.shared for layer in moe if layer.shared is not None),
        "head": lambda m: m is model.lm_head,
    }
    captured = _first_inputs(model, kinds, lambda: model(tokens_BT[:, :-1]))
    counts = {
        "attention": len(model.blocks), "norms": 2 * len(model.blocks) + 1, "dense FFN": len(dense),
        "moe": len(moe), "router": len(moe), "expert GEMMs": len(moe),
        "shared experts": sum(layer.shared is not None for layer in moe), "head": 1,
    }
    single = {kind: time_ms(_forward_backward(*captured[kind])) for kind in captured}

    with torch.no_grad():
        logits_BTV = model(tokens_BT[:, :-1]).detach()
    logits_BTV.requires_grad_()
    targets = tokens_BT[:, 1:].flatten()

    def loss_step():
        loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets)
        torch.autograd.grad(loss, [logits_BTV])

    single["loss"] = time_ms(loss_step)
    counts["loss"] = 1
    for param in model.parameters():  # the optimizer steps on gradients of the right shapes
        if param.requires_grad and param.grad is None:
            param.grad = torch.randn_like(param) * 1e-3
    state = {id(p): p.detach().clone() for p in model.parameters()}
    single["optimizer"] = time_ms(optimizer.step)
    counts["optimizer"] = 1
    with torch.no_grad():  # the timed steps moved the weights: put them back
        for param in model.parameters():
            param.copy_(state[id(param)])
    optimizer.zero_grad(set_to_none=True)

    parts = {kind: {"ms": single.get(kind, 0.0) * counts.get(kind, 0), "count": counts.get(kind, 0)}
             for kind in PARTS if kind != "other"}
    if "moe" in single:
        inner = sum(single.get(kind, 0.0) for kind in ("router", "expert GEMMs", "shared experts"))
        parts["routing"] = {"ms": max(single["moe"] - inner, 0.0) * counts["moe"], "count": counts["moe"]}
    parts["other"] = {"ms": full_step_ms - sum(p["ms"] for p in parts.values()), "count": 1}
    return parts


def anatomy_table(parts: dict[str, dict], full_step_ms: float) -> str:
    lines = [f"{'part':<16} {'count':>5} {'ms/step':>9} {'share':>7}", "-" * 40]
    for kind, part in parts.items():
        lines.append(f"{kind:<16} {part['count']:5d} {part['ms']:9.2f} {part['ms'] / full_step_ms:7.1%}")
    lines.append(f"{'step':<16} {'':>5} {full_step_ms:9.2f} {1:7.1%}")
    return "\n".join(lines)
