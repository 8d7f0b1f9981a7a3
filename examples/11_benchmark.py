"""The benchmark from Python: one MoE layer of your own shape, forward + backward, timed against
the naive loop (and, on a GPU, torch's sort + grouped-GEMM recipe), after checking they agree.

    python examples/11_benchmark.py
    python -m moetrain.bench              # the same harness on the shapes of PERFORMANCE.md

Figure of merit (PERFORMANCE.md): useful expert TFLOP/s = tokens * D * H * k * 2 * 2 * 3 / step
time. On a GPU: bf16, CUDA-event timings; on a CPU: fp32 and the ratios matter, not the numbers.
"""

import sys
from pathlib import Path

import torch

# The harness is the repository's benchmarks/layer.py (benchmarks/ sits beside examples/).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from layer import Shape, bench_shape, build_layer, naive_moe  # noqa: E402


def main(tokens=1024, model_dim=128, hidden_size=256, num_experts=8, top_k=2, warmup=2, steps=5):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = Shape("my_shape", tokens, model_dim, hidden_size, num_experts, top_k)

    # Correct first: with nothing dropped (dropless) the layer and the naive loop compute the same.
    layer = build_layer(shape, device, dtype, capacity_factor=0, impl="kernel")
    x_TD = torch.randn(tokens, model_dim, device=device, dtype=dtype)
    with torch.no_grad():
        max_diff = (layer(x_TD) - naive_moe(layer, x_TD)).abs().max().item()
    print(f"{shape}: layer vs naive loop max |difference| {max_diff:.1e}")

    # Then fast: the same harness as python -m moetrain.bench, dropless and with capacity 1.0.
    columns = {}
    for capacity_factor in (0.0, 1.0):
        result = bench_shape(shape, device, dtype, capacity_factor, warmup, steps)
        print(f"capacity_factor {capacity_factor} (dropped {result['dropped_fraction']:.1%}):")
        for name, figures in result.items():
            if isinstance(figures, dict) and "ms" in figures:
                print(f"  {name:18} {figures['ms']:8.2f} ms  {figures['tflops']:8.3f} TFLOP/s")
                columns[f"{name}@cf={capacity_factor}"] = figures
    return {"max_diff_vs_naive": max_diff, "dtype": str(dtype), "useful_flops": shape.useful_flops(),
            "columns": columns}


if __name__ == "__main__":
    main()
