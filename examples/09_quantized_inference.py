"""Quantized MoE inference: expert weights in FP8 or 4-bit (MXFP4), the busiest experts kept
more precise, saved and loaded as one small checkpoint.

    python examples/09_quantized_inference.py

calibrate() counts the tokens each expert receives on sample data; QuantPolicy("mxfp4",
hot_format="fp8", hot_fraction=0.25) gives the busiest quarter of the experts FP8 and the rest
MXFP4; quantize_model() swaps every layer's experts for QuantizedExperts in place. On CPUs (and
GPUs without FP8/FP4 matmuls) the quantized matmuls are emulated exactly, on Hopper/Blackwell they
use the hardware formats.
"""

import copy
import tempfile
from pathlib import Path

import torch
from torch import nn

from moetrain import MoELayer
from moetrain.quant import QuantPolicy, calibrate, expert_memory, format_memory, load_quantized, quantize_model, save_quantized


def build_model(model_dim: int, num_experts: int, hidden_size: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(model_dim, model_dim),
        MoELayer(model_dim=model_dim, num_experts=num_experts, hidden_size=hidden_size, top_k=2,
                 capacity_factor=0, activation="gelu"),
    )


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y - reference).norm() / reference.norm()).item()


@torch.no_grad()
def main(tokens=256, model_dim=128, num_experts=8, hidden_size=256):
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(model_dim, num_experts, hidden_size).to(device).eval()
    calibration_batches = [torch.randn(tokens, model_dim, device=device) for _ in range(4)]
    x_TD = torch.randn(tokens, model_dim, device=device)
    reference_TD = model(x_TD)

    results = {}
    counts = calibrate(model, calibration_batches)  # one int64 [E] tensor per MoE layer
    for name, policy in (("fp8", QuantPolicy("fp8")),
                         ("mxfp4", QuantPolicy("mxfp4")),
                         ("mxfp4 + fp8 hot", QuantPolicy("mxfp4", hot_format="fp8", hot_fraction=0.25))):
        quantized = copy.deepcopy(model)
        plan = quantize_model(quantized, policy, counts)
        memory = expert_memory(quantized)
        total_bytes = sum(row.bytes for row in memory.values())
        bf16_bytes = sum(row.bf16_bytes for row in memory.values())
        error = relative_error(quantized(x_TD), reference_TD)
        print(f"\n{name}: relative output error {error:.4f}; experts' formats {plan[0]}")
        print(format_memory(memory))
        results[name] = {"relative_error": error, "bytes_vs_bf16": total_bytes / bf16_bytes, "plan": plan}

    # Hot experts: the fp8 ones are the most used on the calibration data.
    hot = [e for e, fmt in enumerate(results["mxfp4 + fp8 hot"]["plan"][0]) if fmt == "fp8"]
    results["hot_experts"] = hot
    results["busiest_experts"] = torch.argsort(counts[0], descending=True, stable=True)[:len(hot)].tolist()

    # Save, then load into a freshly built model (float weights of any value): same outputs.
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "model.q.pt")
        save_quantized(quantized, plan, str(path))
        fresh = build_model(model_dim, num_experts, hidden_size).to(device).eval()
        load_quantized(fresh, str(path))
        results["reload_max_diff"] = (fresh(x_TD) - quantized(x_TD)).abs().max().item()
        print(f"\ncheckpoint {path.stat().st_size / 1024:.0f} KiB; reloaded model max |difference| "
              f"{results['reload_max_diff']:.1e}")
    return results


if __name__ == "__main__":
    main()
