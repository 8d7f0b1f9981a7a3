"""Loading the compiled kernels (moetrain._C).

The extension is normally built by `pip install` (setup.py). On a machine whose torch differs from
the one it was built against (an import error about undefined symbols, or no built file at all),
we compile the same sources for the running torch with torch.utils.cpp_extension.load, once, into
torch's extension cache, and say so while it compiles. If that fails too, the error names both
causes; nothing falls back silently to the pure-torch path.
"""

from __future__ import annotations

import glob
import importlib
import logging
import os
import sys
import types

import torch

log = logging.getLogger("moetrain")

_module: types.ModuleType | None = None
_error: str | None = None


class ExtensionUnavailable(RuntimeError):
    """The compiled kernels cannot be loaded; the message says why and what to do."""


def _source_dir() -> str:
    """csrc/ as installed (package data moetrain.csrc), or beside moetrain/ in an uninstalled checkout."""
    try:
        import moetrain.csrc as csrc
    except ImportError:
        checkout = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc")
        if not os.path.isfile(os.path.join(checkout, "bindings.cpp")):
            raise ExtensionUnavailable(
                "moetrain's C++/CUDA sources were not found: install moetrain (pip install --no-build-isolation -e .) "
                "or run from a checkout that has csrc/"
            ) from None
        return checkout
    return os.path.dirname(csrc.__file__)


def _jit_build() -> types.ModuleType:
    from torch.utils import cpp_extension

    src = _source_dir()
    sources = sorted(glob.glob(os.path.join(src, "*.cpp")))
    cuda_sources = sorted(glob.glob(os.path.join(src, "cuda", "*.cu")))
    with_cuda = torch.cuda.is_available() and bool(cuda_sources) and cpp_extension.CUDA_HOME is not None
    if with_cuda:
        sources += cuda_sources
    print(
        f"moetrain: compiling the kernels for torch {torch.__version__} "
        f"({'CUDA + CPU' if with_cuda else 'CPU'}; once, cached by torch.utils.cpp_extension) ...",
        file=sys.stderr,
        flush=True,
    )
    major, minor = torch.cuda.get_device_capability() if with_cuda else (0, 0)
    nvcc_flags = ["-O3", "--use_fast_math", "-lineinfo"]
    if with_cuda:
        nvcc_flags.append(f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}")
    return cpp_extension.load(
        name=f"moetrain_C_{torch.__version__.replace('.', '_').replace('+', '_')}",
        sources=sources,
        extra_cflags=["-O3", "-fopenmp"] + (["-DMOETRAIN_WITH_CUDA"] if with_cuda else []),
        extra_cuda_cflags=nvcc_flags + ["-DMOETRAIN_WITH_CUDA"],
        extra_ldflags=["-fopenmp"],
        with_cuda=with_cuda,
        verbose=False,
    )


def load() -> types.ModuleType:
    """Return the loaded extension, building it for this torch if needed; raise ExtensionUnavailable."""
    global _module, _error
    if _module is not None:
        return _module
    if _error is not None:
        raise ExtensionUnavailable(_error)
    try:
        _module = importlib.import_module("moetrain._C")
    except ImportError as import_error:
        try:
            _module = _jit_build()
        except Exception as build_error:  # noqa: BLE001 - reported whole below
            _error = (
                f"moetrain's compiled kernels are unavailable: importing moetrain._C failed ({import_error}) "
                f"and compiling them for torch {torch.__version__} failed ({type(build_error).__name__}: "
                f"{str(build_error).strip().splitlines()[-1] if str(build_error).strip() else build_error}). "
                "Reinstall with `pip install --no-build-isolation -e .` after torch, or pass impl='torch' "
                "to use the pure-torch path."
            )
            raise ExtensionUnavailable(_error) from build_error
    from moetrain.ops import fake

    fake.register()  # so that torch.compile traces through the operators
    if torch.cuda.is_available() and not getattr(_module, "has_cuda", False):
        log.warning("moetrain: the kernels were built without CUDA; CUDA tensors need impl='torch' or a CUDA build")
    return _module


def has_cuda_kernels() -> bool:
    return bool(getattr(load(), "has_cuda", False))
