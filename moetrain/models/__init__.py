"""MoE transformer models: an image classifier, a decoder-only language model, architecture
presets and Hugging Face checkpoint loading."""

from moetrain.models.hf import CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from moetrain.models.lm import LMConfig, MoETransformerLM, flops_per_token, parameter_counts
from moetrain.models.presets import PRESETS, build_lm
from moetrain.models.vision import VisionMoE

__all__ = [
    "PRESETS", "CheckpointError", "LMConfig", "MoETransformerLM", "VisionMoE", "build_lm", "flops_per_token",
    "load_hf_checkpoint", "parameter_counts", "save_hf_checkpoint",
]
