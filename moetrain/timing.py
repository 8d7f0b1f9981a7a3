"""The one step timer every benchmark uses (moetrain.bench, moetrain.parallel.bench,
moetrain.quant.bench, moetrain.models.throughput, benchmarks/).

    ms = median_ms(lambda: layer(x).sum().backward(), device, warmup=5, steps=20)

On a GPU each timed call sits between two CUDA events, so the figure is the call's GPU time, not
its host time; with sync_each=False the calls are queued back to back and synchronised once at the
end (the host may run ahead, as in training), with sync_each=True every call is waited for (calls
whose host work must not overlap the next one). On a CPU the host clock times each call.
peak_bf16_flops gives the device's dense bf16 peak that MFU figures divide by; profile_table the
kernels of a few steps, most time first (the benchmarks' --profile).
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Callable

import torch


# Dense bf16 tensor-core peaks (no sparsity), from the vendors' data sheets, by device-name part.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_bf16_flops(device: torch.device | str) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None where it is not known (CPUs, other GPUs)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in PEAK_BF16_FLOPS.items() if part in name), None)


def step_times_ms(step: Callable[[], object], device: torch.device | str, warmup: int = 3, steps: int = 10,
                  sync_each: bool = False) -> list[float]:
    """Milliseconds of each of `steps` calls of step(), after `warmup` untimed calls."""
    device = torch.device(device)
    for _ in range(warmup):
        step()
    if device.type != "cuda":
        times = []
        for _ in range(steps):
            begin = time.perf_counter()
            step()
            times.append((time.perf_counter() - begin) * 1e3)
        return times
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        step()
        end.record()
        if sync_each:
            end.synchronize()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def median_ms(step: Callable[[], object], device: torch.device | str, warmup: int = 3, steps: int = 10,
              sync_each: bool = False) -> float:
    """Median milliseconds of one call of step() (step_times_ms)."""
    return statistics.median(step_times_ms(step, device, warmup, steps, sync_each))


def profile_table(step: Callable[[], None], device: torch.device, rows: int = 15) -> str:
    """The kernels of three steps, most time first, and the lines where a step waits for the GPU."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(3):
            step()
    sort_by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort_by, row_limit=rows)
    if device.type == "cuda":
        # A host sync inside the step leaves the GPU idle while the host launches what follows.
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
        torch.cuda.set_sync_debug_mode("default")
        syncs = sorted({f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)})
        table += "\nhost syncs in one step: " + (", ".join(syncs) or "none")
    return table
