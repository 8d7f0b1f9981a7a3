"""Micro-benchmark of the padded expert epilogue's backward on one GPU:
    python benchmarks/bias_act_backward.py [--iters 50]
The old path is two ATen passes (threshold_backward, then the per-expert sum over rows that reads
the result again); the new one is torch.ops.moetrain.bias_act_backward. After warm-up, each sample
times 5 calls queued back to back with CUDA events; the figure is the median sample, per call.
GB/s counts the bytes a single pass must move (ReLU: read grad and out, write grad_in; identity:
read grad), against ~4.3 TB/s of copy bandwidth and against a plain copy of grad timed in the same
run. A failing row prints its error and the next row runs.
"""

from __future__ import annotations

import argparse

import torch

from moetrain import ops
from moetrain.ops import reference

COPY_BANDWIDTH = 4.3e12  # bytes/s, the H200's measured copy rate (../shared/PERFORMANCE.md)

# (experts, rows per expert, O): gshard_2k's first GEMM output, mixtral's, 16 experts at 2048
# columns, deepseek_fg's 64 fine-grained experts.
SHAPES = [(8, 2048, 4096), (8, 2048, 14336), (16, 2048, 2048), (64, 768, 1408)]


CALLS_PER_SAMPLE = 5  # queued back to back, as in a training step, so launch costs overlap the GPU's work


def median_ms(fn, iters: int) -> float:
    def sample():
        for _ in range(CALLS_PER_SAMPLE):
            fn()

    return timing.median_ms(sample, "cuda", warmup=1, steps=iters, sync_each=True) / CALLS_PER_SAMPLE


def old_threshold(grad_RO, out_RO):
    return torch.ops.aten.threshold_backward(grad_RO, out_RO, 0)


def old_bias_sum(grad_in_RO, rows_per_expert):
    return grad_in_RO.reshape(-1, rows_per_expert, grad_in_RO.size(-1)).sum(1)


def bench_shape(experts: int, capacity: int, dim: int, relu: bool, iters: int) -> str:
    rows = experts * capacity
    grad_RO = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
    out_RO = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16).relu() if relu else None
    op = torch.ops.moetrain.bias_act_backward

    # Correct before fast: grad_in bit-identical, grad_bias close to the fp32 reference.
    got_in, got_b = op(grad_RO, out_RO, capacity, True)
    want_in, want_b = reference.bias_act_backward(grad_RO, out_RO, capacity, True)
    exact = torch.equal(got_in, want_in)
    bias_err = (got_b.float() - want_b.float()).abs().max().item() / max(want_b.float().abs().max().item(), 1e-30)
    del got_in, got_b, want_in, want_b

    if relu:
        grad_in_RO = old_threshold(grad_RO, out_RO)
        threshold_ms = median_ms(lambda: old_threshold(grad_RO, out_RO), iters)
    else:
        grad_in_RO, threshold_ms = grad_RO, 0.0
    sum_ms = median_ms(lambda: old_bias_sum(grad_in_RO, capacity), iters)
    old_ms = median_ms(lambda: old_bias_sum(old_threshold(grad_RO, out_RO) if relu else grad_RO, capacity), iters)
    new_ms = median_ms(lambda: op(grad_RO, out_RO, capacity, True), iters)

    # The card's streaming rate in the same run, for scale: a plain copy of grad (read + write).
    copy_RO = torch.empty_like(grad_RO)
    copy_ms = median_ms(lambda: copy_RO.copy_(grad_RO), iters)
    copy_rate = 2 * grad_RO.numel() * grad_RO.element_size() / (copy_ms * 1e-3)

    moved = rows * dim * grad_RO.element_size() * (3 if relu else 1)
    new_rate = moved / (new_ms * 1e-3)
    return (f"{rows:>6}x{dim:<6} E={experts:<3} {'relu' if relu else 'ident':<5} | {threshold_ms:7.3f} {sum_ms:7.3f} "
            f"{old_ms:7.3f} | {new_ms:7.3f} {old_ms / new_ms:5.2f}x | {new_rate / 1e9:6.0f} GB/s "
            f"{100 * new_rate / COPY_BANDWIDTH:6.0f}% | copy {copy_rate / 1e9:4.0f} GB/s | "
            f"grad_in {'exact' if exact else 'DIFFERS'}, grad_bias rel err {bias_err:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50, help="timed calls per figure (median taken)")
    args = parser.parse_args()
    ops.load()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, median of {args.iters}, ms")
    print(f"{'[E*C, O]':<19} {'act':<5} | {'thresh':>7} {'sum':>7} {'old':>7} | {'new':>7} {'gain':>6} | "
          f"{'new rate':>11} {'of peak':>7} | {'copy rate':>14} | check")
    for experts, capacity, dim in SHAPES:
        for relu in (True, False):
            try:
                print(bench_shape(experts, capacity, dim, relu, args.iters), flush=True)
            except Exception as error:  # one failing row must not hide the others
                print(f"{experts * capacity:>6}x{dim:<6} E={experts:<3} {'relu' if relu else 'ident':<5} | FAILED: "
                      f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
