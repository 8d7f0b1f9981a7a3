"""moetrain: train Mixture-of-Experts models; MoELayer is usable from plain Python."""

from moetrain.moe import MoELayer

__version__ = "0.1.0"

__all__ = ["MoELayer", "__version__", "load_run"]


def __getattr__(name: str):
    # load_run brings in the data, checkpoint and trainer modules: imported on first use, so that
    # `import moetrain` (and every command's start) stays as quick as the MoE layer alone.
    if name == "load_run":
        from moetrain.run import load_run

        return load_run
    raise AttributeError(f"module 'moetrain' has no attribute {name!r}")
