"""Where a Triton kernel launches."""

from __future__ import annotations

import contextlib

import torch


def on_device_of(t: torch.Tensor):
    """The context that launches a Triton kernel on t's GPU (Triton launches on the current device);
    for a CPU tensor none: Triton's interpreter runs the kernel."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
