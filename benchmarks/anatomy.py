"""Where one MoE-layer step goes on the GPU (GPU only).

    python benchmarks/anatomy.py [shape ...]

For each benchmark shape (moetrain column, cf=1.0, forward + backward as in moetrain.bench):
  eager      the step as the benchmark times it;
  gemms      the expert GEMMs alone (bmm, forward + backward);
and, from the profiler, the GPU time per kernel category in one eager step.
"""

from __future__ import annotations

import sys

import torch

import layer as bench  # benchmarks/layer.py (this script's folder): python -m moetrain.bench
from moetrain import timing


def median_ms(fn):
    """Median CUDA-event milliseconds of fn, timed as moetrain.bench times a step."""
    return timing.median_ms(fn, "cuda", warmup=5, steps=20)


def category(name: str) -> str:
    low = name.lower()
    if "moetrain" in low or "dispatch" in low or "combine" in low or "route" in low or "rank_" in low:
        return "moetrain kernels"
    if any(key in low for key in ("gemm", "cutlass", "nvjet", "sm90", "xmma", "cublas")):
        return "gemm"
    if "reduce" in low or "sum" in low:
        return "reductions"
    if "elementwise" in low or "vectorized" in low or "unrolled" in low:
        return "elementwise"
    if "softmax" in low or "topk" in low or "sort" in low or "scan" in low:
        return "router"
    return "other"


def layer_step(shape):
    """The benchmark's moetrain column for one shape: (layer, x_TD, params, step)."""
    device = torch.device("cuda")
    torch.manual_seed(1)
    x_TD = torch.randn(shape.tokens, shape.model_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    layer = bench.build_layer(shape, device, torch.bfloat16, 1.0, impl="kernel")
    params = list(layer.parameters())
    return layer, x_TD, params, bench._forward_backward(layer, x_TD, params)


def anatomy(shape):
    layer, x_TD, _, step = layer_step(shape)
    eager = median_ms(step)
    gemms = median_ms(bench.gemms_alone(layer, shape, x_TD))  # the bench's "gemms alone" column

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    by_cat: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for event in prof.key_averages():
        t = event.device_time_total / 3 / 1e3  # ms per step
        if t <= 0:
            continue
        by_cat[category(event.key)] = by_cat.get(category(event.key), 0.0) + t
        by_name[event.key] = t
    flops = shape.useful_flops()
    print(f"{shape.name}: eager {eager:.2f} ms ({flops / eager / 1e9:.0f} TFLOP/s), gemms alone {gemms:.2f} ms ({flops / gemms / 1e9:.0f})")
    busy = sum(by_cat.values())
    print(f"  GPU busy per step {busy:.2f} ms: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])))
    for name, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:14]:
        print(f"    {t:7.3f} ms  [{category(name)}] {name[:110]}")


def epilogue_micro():
    """One expert's first GEMM with bias + ReLU: separate ops against cuBLASLt's fused epilogue."""
    for rows, d, h in ((4096, 2048, 2048), (2048, 4096, 14336), (1024, 1024, 4096)):
        x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(d, h, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(h, device="cuda", dtype=torch.bfloat16)
        sep = median_ms(lambda: torch.relu(x @ w + b))
        fused = median_ms(lambda: torch._addmm_activation(b, x, w))
        plain = median_ms(lambda: x @ w)
        print(f"  epilogue {rows}x{d}x{h}: mm {plain:.3f} ms, mm+add+relu {sep:.3f}, fused addmm_activation {fused:.3f}")


def main(names):
    shapes = [s for s in bench.GPU_SHAPES.values() if not names or s.name in names]
    print(torch.cuda.get_device_name(), torch.__version__)
    for shape in shapes:
        anatomy(shape)
    epilogue_micro()


if __name__ == "__main__":
    main(sys.argv[1:])
