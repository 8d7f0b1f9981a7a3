"""Host cost of one MoE-layer step against its GPU time (GPU only): python benchmarks/hostcost.py [shape ...]

For each shape: the host time to issue one step (GPU idle before, no sync inside), the step time
by CUDA events (as moetrain.bench), the GPU busy time (profiler), the ops that cost the host most,
the Python functions that cost it most, and the same for the layer under torch.compile.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

import layer as bench  # benchmarks/, this script's folder
from anatomy import layer_step, median_ms


def host_ms(step, n=20):
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        step()
        times.append((time.perf_counter() - begin) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def run(shape):
    layer, x_TD, params, step = layer_step(shape)
    gpu = median_ms(step)
    host = host_ms(step)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 3 / 1e3
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")) / 3
    print(f"{shape.name}: step {gpu:.3f} ms (events), host issue {host:.3f} ms, GPU busy {busy:.3f} ms, "
          f"{launches:.0f} kernel launches a step")
    rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:22]
    for e in rows:
        print(f"    host self {e.self_cpu_time_total / 3 / 1e3:7.3f} ms  x{e.count / 3:4.0f}  {e.key[:90]}")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(22)
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])

    # The same step through torch.compile (one graph): host issue time and step time.
    torch._dynamo.reset()
    compiled = bench._forward_backward(torch.compile(layer), x_TD, params)
    compiled()
    print(f"  torch.compile: step {median_ms(compiled):.3f} ms (events), host issue {host_ms(compiled):.3f} ms")


def main(names):
    print(torch.cuda.get_device_name(), torch.__version__)
    for shape in bench.GPU_SHAPES.values():
        if not names or shape.name in names:
            run(shape)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
