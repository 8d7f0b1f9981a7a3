"""moetrain: train Mixture-of-Experts models; MoELayer is usable from plain Python."""

from moetrain.moe import MoELayer

__version__ = "0.1.0"

__all__ = ["MoELayer", "__version__"]
