"""Does the H200 hold its GEMM rate under sustained load? (GPU only): python benchmarks/sustained.py

Runs one GEMM back to back for a few seconds and prints TFLOP/s over the first and the last 20
iterations, with the SM clock and power sampled by nvidia-smi meanwhile: the dense 8192^3 GEMM of
moetrain.bench's ceiling and mixtral's first expert GEMM (bmm [8, 2048, 4096] x [8, 4096, 14336]).
"""

from __future__ import annotations

import statistics
import subprocess

import torch


def run(name, fn, flops, seconds=4.0):
    n = max(40, int(seconds * 1e3 / timing.median_ms(fn, "cuda", warmup=3, steps=1)))
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader",
                            "-lms", "250"], stdout=subprocess.PIPE, text=True)
    ms = timing.step_times_ms(fn, "cuda", warmup=0, steps=n)  # back to back, one sync at the end
    smi.terminate()
    samples = smi.communicate()[0].strip().splitlines()
    first, last = statistics.median(ms[:20]), statistics.median(ms[-20:])
    print(f"{name}: {n} iterations, {sum(ms) / 1e3:.1f} s; first 20: {flops / first / 1e9:.0f} TFLOP/s, "
          f"last 20: {flops / last / 1e9:.0f} TFLOP/s; nvidia-smi (clock, power, temp) first/last: "
          f"{samples[0] if samples else '-'} / {samples[-1] if samples else '-'}")


def main():
    print(torch.cuda.get_device_name(), torch.__version__)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    run("dense 8192^3", lambda: torch.mm(a, b), 2 * 8192**3)
    x = torch.randn(8, 2048, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8, 4096, 14336, device="cuda", dtype=torch.bfloat16) * 0.02
    run("mixtral bmm 8x2048x4096x14336", lambda: torch.bmm(x, w), 2 * 8 * 2048 * 4096 * 14336)
    run("dense 8192^3 again", lambda: torch.mm(a, b), 2 * 8192**3, seconds=1.0)


if __name__ == "__main__":
    main()
