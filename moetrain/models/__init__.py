"""MoE transformer models: an image classifier and a decoder-only language model, plus presets."""

from moetrain.models.vision import VisionMoE

__all__ = ["VisionMoE"]
