"""The one step timer every benchmark uses (benchmarks/, moetrain.models.throughput), and the peak
FLOP/s the trainer divides by for its MFU.

    ms = median_ms(lambda: layer(x).sum().backward(), device, warmup=5, steps=20)

On a GPU each timed call sits between two CUDA events, so the figure is the call's GPU time, not
its host time; with sync_each=False the calls are queued back to back and synchronised once at the
end (the host may run ahead, as in training), with sync_each=True every call is waited for (calls
whose host work must not overlap the next one). On a CPU the host clock times each call.
peak_bf16_flops gives the device's dense bf16 peak that MFU figures divide by; profile_table the
kernels of a few steps, most time first (the benchmarks' --profile); host_ms the host's time to
issue a step on a GPU, which says whether the host or the GPU bounds it.
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


def host_ms(step: Callable[[], object], device: torch.device | str, steps: int = 4) -> float | None:
    """Milliseconds the host takes to issue one call of step() on a GPU: the calls are queued without
    waiting for the GPU, so a figure well below the step's GPU time means the GPU bounds the step,
    and one near it that the host does (or that the step waits for the GPU somewhere). None on a
    CPU, where the host does all the work."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    begin = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - begin) * 1e3 / steps
    torch.cuda.synchronize(device)
    return ms


def kernel_table(kernels: list[tuple[str, float, int]], steps: int, wall_ms: float, rows: int) -> str:
    """Rows of (kernel name, total microseconds, launches) over `steps` steps -> a table of the
    `rows` costliest, per step, with the GPU's busy time against wall_ms, a step's wall time."""
    busy_ms = sum(us for _, us, _ in kernels) / 1e3 / steps
    lines = [f"GPU busy {busy_ms:.2f} ms a step (profiled) of a {wall_ms:.2f} ms step (not profiled: "
             f"{busy_ms / wall_ms:.0%}); kernels, most time first (ms and launches per step):",
             f"{'ms':>9} {'share':>6} {'launches':>8}  kernel"]
    costliest = sorted(kernels, key=lambda kernel: -kernel[1])[:rows]
    for name, us, count in costliest:
        ms = us / 1e3 / steps
        lines.append(f"{ms:9.3f} {ms / busy_ms:6.1%} {count / steps:8.1f}  {name[:140]}")
    shown = sum(us for _, us, _ in costliest) / 1e3 / steps
    lines.append(f"{busy_ms - shown:9.3f} {(busy_ms - shown) / busy_ms if busy_ms else 0:6.1%} "
                 f"{'':>8}  the other {max(0, len(kernels) - rows)} kernels")
    return "\n".join(lines)


def profile_table(step: Callable[[], None], device: torch.device, rows: int = 40) -> str:
    """What three steps run, most time first: on a GPU each kernel's own GPU time per step and how
    busy the GPU is, on a CPU the host's operators; then the lines where a step waits for the GPU."""
    steps = 3
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
    if device.type != "cuda":
        return profiler.key_averages().table(sort_by="cpu_time_total", row_limit=rows)
    # The wall time of a step without the profiler, whose own host work would stretch it.
    wall_ms = sum(step_times_ms(step, device, warmup=0, steps=steps)) / steps
    # GPU-side entries, without the ranges user annotations (the optimizer's step) span over kernels.
    kernels = [(entry.key, entry.self_device_time_total, entry.count) for entry in profiler.key_averages()
               if entry.device_type == torch.autograd.DeviceType.CUDA and entry.self_device_time_total > 0
               and not getattr(entry, "is_user_annotation", False)]
    table = kernel_table(kernels, steps, wall_ms, rows)
    # A host sync inside the step leaves the GPU idle while the host launches what follows.
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
    torch.cuda.set_sync_debug_mode("default")
    syncs = sorted({f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)})
    return table + "\nhost syncs in one step: " + (", ".join(syncs) or "none")
