"""Compiling Triton kernels for Hopper (sm_90) on a machine without a GPU, for tests that pin what the
compiled code must hold (tensor-core instructions, vector memory accesses, no register spills)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path


def compile_ptx(fn, types: dict[str, str], constants: dict, num_warps: int, num_stages: int = 3) -> str:
    """PTX of the jitted fn for sm_90, its arguments typed by `types` (pointers and integers, each
    taken as a multiple of 16, as launches with aligned tensors and sizes specialise them) and
    `constants` (its constexprs)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=fn, signature={**types, **dict.fromkeys(constants, "constexpr")}, constexprs=constants,
                       attrs={(fn.arg_names.index(name),): [["tt.divisibility", 16]]
                              for name, kind in types.items() if not kind.startswith("tensordesc")})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages)).asm["ptx"]


def assert_no_spills(ptx: str, tmp_path: Path, what) -> None:
    """ptxas -v (Triton's own, when it ships one) reports no register spills for sm_90a."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if ptxas.exists():
        path = tmp_path / "kernel.ptx"
        path.write_text(ptx)
        report = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(path), "-o", os.devnull],
                                capture_output=True, text=True).stderr
        assert re.search(r"\b0 bytes spill stores", report), (what, report)
