"""moetrain: train Mixture-of-Experts models; MoELayer is usable from plain Python.

The package is built in floors. A module imports from its own floor and the floors below it, never
from a floor above (not even inside a function), and no imports run in a circle; where a lower
piece needs a higher one's behaviour, the higher one passes it down (a callable, a base class).
From the ground up (tests/test_import_layers.py reads this table and holds the code to it):

  1  config timing collectives                   the config schema, the step timer, the differentiable collectives
  2  ops                                         the kernels' Python face (csrc/, Triton) and their pure-torch twins
  3  precision                                   number formats, their quantizers and FP8 training's scaled GEMMs
  4  moe                                         the MoE layer: gates, routing plan, experts, losses, recompute seam
  5  models quant                                transformer models and presets; quantized inference of their experts
  6  data train parallel                         data sets, the trainer, distributed training and its checkpoints
  7  run evaluate generate export                a trained run from Python: load, evaluate, generate, export
  8  command_errors commands cli __main__ bench  the command line (the only Hydra users), the bench entry

This module's own names (MoELayer, load_run) hand on those of floors 4 and 7.
"""

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
