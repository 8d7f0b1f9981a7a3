"""Build and install moetrain.

The extension moetrain._C is built from csrc/: CUDA + CPU kernels when torch was built with CUDA and
nvcc is found, CPU kernels only otherwise. MOETRAIN_CUDA=1 forces the CUDA build (and fails if it
cannot), MOETRAIN_CUDA=0 forces CPU-only. Install after torch with --no-build-isolation, so the
extension is compiled against the torch you run.
"""

import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - the message is the point
    sys.exit(
        "moetrain: torch must be installed before building moetrain "
        "(pip install torch==2.14.1 torchvision==0.29.1, then pip install --no-build-isolation -e .)"
    )

ROOT = os.path.dirname(os.path.abspath(__file__))
VERSION = "0.1.0"


def want_cuda() -> bool:
    forced = os.environ.get("MOETRAIN_CUDA")
    if forced not in (None, "", "0", "1"):
        sys.exit(f"moetrain: MOETRAIN_CUDA must be 0 or 1, got {forced!r}")
    if os.environ.get("CUDA_HOME") is None and os.path.exists("/usr/local/cuda/bin/nvcc"):
        # torch otherwise guesses the nvcc on PATH's parent, which may be /usr/local, and the link fails.
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
        cpp_extension.CUDA_HOME = "/usr/local/cuda"
    has_nvcc = cpp_extension.CUDA_HOME is not None and os.path.exists(
        os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
    )
    has_sources = bool(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
    if forced == "1":
        if torch.version.cuda is None or not has_nvcc:
            sys.exit(
                "moetrain: MOETRAIN_CUDA=1 but "
                + ("this torch has no CUDA" if torch.version.cuda is None else "nvcc was not found (set CUDA_HOME)")
            )
        return True
    if forced == "0":
        return False
    return torch.version.cuda is not None and has_nvcc and has_sources


def extension():
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cxx = ["-O3", "-fopenmp"]
    if want_cuda():
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            # With no GPU visible torch cannot read the architecture; build for Hopper (sm_90).
            os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        print(f"moetrain: building CUDA + CPU kernels ({len(sources)} files, nvcc from {cpp_extension.CUDA_HOME})")
        return cpp_extension.CUDAExtension(
            "moetrain._C",
            sources,
            define_macros=[("MOETRAIN_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--use_fast_math", "-lineinfo"]},
            extra_link_args=["-fopenmp"],
        )
    print("moetrain: building CPU kernels only (no CUDA torch or no nvcc, or MOETRAIN_CUDA=0)")
    return cpp_extension.CppExtension("moetrain._C", sources, extra_compile_args=cxx, extra_link_args=["-fopenmp"])


class BuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension, with a plain statement of what failed and what to try."""

    def run(self):
        try:
            super().run()
        except Exception as error:
            print(
                "\nmoetrain: building the extension moetrain._C failed: "
                f"{type(error).__name__}: {error}\n"
                "  - install torch first and use --no-build-isolation so the build sees it;\n"
                "  - a C++17 compiler (g++ >= 9) is needed; for CUDA, nvcc matching torch.version.cuda;\n"
                "  - MOETRAIN_CUDA=0 builds the CPU kernels only.\n",
                file=sys.stderr,
            )
            raise


setup(
    name="moetrain",
    version=VERSION,
    description="Train Mixture-of-Experts models from the command line, with fast dispatch kernels",
    long_description=open(os.path.join(ROOT, "README.md")).read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["moetrain", "moetrain.*"]) + ["moetrain.conf", "moetrain.recipes", "moetrain.csrc"],
    package_dir={"moetrain.conf": "conf", "moetrain.recipes": "recipes", "moetrain.csrc": "csrc"},
    package_data={
        "moetrain.conf": ["*.yaml", "*/*.yaml"],
        "moetrain.recipes": ["*.yaml"],
        "moetrain.csrc": ["*.cpp", "*.h", "cuda/*.cu", "cuda/*.cuh", "cuda/*.h"],
    },
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)},
    install_requires=[
        "torch>=2.4",
        "torchvision",
        "hydra-core>=1.3.2",
        "omegaconf>=2.3",
        "numpy",
        "safetensors>=0.4",
        "tqdm",
        "tensorboard",
        "tokenizers>=0.19",
    ],
    # transformers only checks interoperability in tests (tiny checkpoints made and read back); the
    # library never imports it.
    extras_require={"test": ["pytest>=7", "transformers>=4.56"]},
    entry_points={"console_scripts": ["moetrain = moetrain.cli:main"]},
)
