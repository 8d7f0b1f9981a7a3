"""Activation checkpointing (torch.utils.checkpoint, non-reentrant) that never re-routes.

Three modes, set on a model by `moetrain.moe.set_activation_checkpointing(model, mode)`:

  none       every activation is kept for the backward pass;
  selective  attention (with its input norm) and the routed experts' hidden activations are
             recomputed in the backward pass, but not the GEMMs that end them (attention's
             output projection, the experts' output GEMM), whose inputs are kept; the gate,
             the routing plan, dispatch and combine run once, so the recomputation starts from
             the same expert-major buffer and can never route differently;
  full       each transformer block is recomputed as a whole. The recomputed MoE layer reuses
             the routing plan (and the balance loss's token counts) recorded by the first
             forward instead of building a new one, and its gate leaves its state untouched
             (the sigmoid gate counts its load in forward: that must happen once).

Both recompute exactly what the first forward computed (checkpoint restores the random state, so
router jitter and dropout draw the same numbers): losses, gradients, aux losses and routing
statistics equal those of the model without checkpointing, bit for bit on the same device.

How a recomputing MoE layer knows: `checkpoint_block` gives torch.utils.checkpoint a context_fn
whose forward context records each layer's plan and whose recompute context replays it; the
layer asks `routing_phase()`. A model's blocks take part by subclassing CheckpointedBlock: the
mode is set on them, and they call checkpoint_block / checkpoint_call on their own parts, so this
module knows no model.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

from torch import nn
from torch.utils.checkpoint import checkpoint

from moetrain.moe.experts import splits_hidden

MODES = ("none", "selective", "full")


def check_mode(mode) -> str:
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing must be one of {list(MODES)}, got {mode!r}")
    return mode


class RoutingRecord:
    """The routing of each MoE layer inside one checkpointed call, in call order per layer."""

    def __init__(self):
        self.entries: dict[int, list] = {}
        self.replayed: dict[int, int] = {}

    def add(self, layer: nn.Module, entry) -> None:
        self.entries.setdefault(id(layer), []).append(entry)

    def next(self, layer: nn.Module):
        index = self.replayed.get(id(layer), 0)
        entries = self.entries.get(id(layer), [])
        if index >= len(entries):
            raise RuntimeError("activation checkpointing: the recomputed block called an MoE layer more often "
                               "than its first forward did")
        self.replayed[id(layer)] = index + 1
        return entries[index]


# (record, replaying) of the checkpointed calls in progress, innermost last. Not thread-local: on
# GPUs the autograd engine recomputes in its own threads.
_PHASES: list[tuple[RoutingRecord, bool]] = []


@contextmanager
def _phase(record: RoutingRecord, replaying: bool):
    if replaying:
        record.replayed.clear()  # a second backward through retain_graph replays from the start
    _PHASES.append((record, replaying))
    try:
        yield
    finally:
        _PHASES.pop()


def routing_phase() -> tuple[RoutingRecord, bool] | None:
    """(record, replaying) when an MoE layer runs inside a block checkpointed by checkpoint_block."""
    return _PHASES[-1] if _PHASES else None


def checkpoint_block(function, *args):
    """function(*args) with its activations recomputed in backward; MoE layers inside record their
    routing in the forward and replay it in the recomputation."""
    record = RoutingRecord()
    return checkpoint(function, *args, use_reentrant=False,
                      context_fn=lambda: (_phase(record, False), _phase(record, True)))


def checkpoint_call(function, *args):
    """function(*args) with its activations recomputed in backward (a part without routing)."""
    return checkpoint(function, *args, use_reentrant=False)


def checkpoint_experts(run, experts, x_RD: torch.Tensor, *args):
    """run(x_RD, *args) -> the experts' output, with their hidden activations recomputed in
    backward. run(x, *args, part=...) must run that part of the experts (Experts.forward's part).
    Experts that split (moetrain.moe.experts.splits_hidden) recompute the hidden part alone: the
    output GEMM's input is kept and that GEMM runs once, a third of the experts' forward FLOPs
    (SwiGLU) not spent again. Others are recomputed whole."""
    if not splits_hidden(experts):
        return checkpoint_call(run, x_RD, *args)
    h_RH = checkpoint_call(functools.partial(run, part="hidden"), x_RD, *args)
    return run(h_RH, *args, part="project")


class CheckpointedBlock(nn.Module):
    """A block that activation checkpointing recomputes (a transformer block): set_activation_checkpointing
    sets `activation_checkpointing` to one of MODES; under "full" the block runs its forward through
    checkpoint_block, under "selective" the parts it chooses through checkpoint_call."""

    activation_checkpointing = "none"
