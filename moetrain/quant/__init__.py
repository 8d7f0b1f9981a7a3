"""Quantized MoE inference: FP8, blockwise FP8, MXFP4 and NVFP4 experts, per-expert precision.

    from moetrain.quant import QuantPolicy, calibrate, quantize_model, expert_memory, format_memory
    counts = calibrate(model, batches)                       # only for a hot/cold policy
    plan = quantize_model(model, QuantPolicy("mxfp4", hot_format="fp8"), counts)
    print(format_memory(expert_memory(model)))
    save_quantized(model, plan, "model.q.pt"); load_quantized(fresh_model, "model.q.pt")

Formats and their bit layouts: moetrain.precision.formats. Docs: docs/quantization.md.
"""

from moetrain.quant.experts import QuantizedExperts
from moetrain.quant.export import FormatMemory, expert_memory, format_memory, load_quantized, save_quantized
from moetrain.precision.formats import FORMATS, WeightFormat, get_format
from moetrain.quant.policy import QuantPolicy, apply_plan, calibrate, quantize_model

__all__ = [
    "FORMATS", "FormatMemory", "QuantPolicy", "QuantizedExperts", "WeightFormat", "apply_plan", "calibrate",
    "expert_memory", "format_memory", "get_format", "load_quantized", "quantize_model", "save_quantized",
]
