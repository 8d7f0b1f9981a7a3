"""Running a function outside torch.compile's graph."""

from __future__ import annotations

from collections.abc import Callable

_outside: dict[Callable, Callable] = {}


def outside_the_graph(function: Callable) -> Callable:
    """function, never traced by torch.compile: a compiled caller breaks its graph around the call, and
    a caller that runs eagerly under torch.compile (a frame dynamo fell back on) does not hand the
    frames it calls to dynamo either. Eager callers pay a few microseconds. Made on first use, since
    torch.compiler.disable imports torch._dynamo, which the command's start does not."""
    outside = _outside.get(function)
    if outside is None:
        import torch.compiler  # noqa: PLC0415

        outside = _outside[function] = torch.compiler.disable(function)
    return outside
