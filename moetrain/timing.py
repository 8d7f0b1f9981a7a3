"""The one step timer every benchmark uses (benchmarks/, benchmarks/lm_throughput.py), and the peak
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

import heapq
import statistics
import time
import warnings
from typing import Callable

import torch


# Dense bf16 tensor-core peaks (no sparsity), from the vendors' data sheets, by device-name part;
# the first part a name contains wins, so the PCIe and NVL cards (lower clocks and power) come first.
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12,
                   "H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_bf16_flops_of(name: str) -> float | None:
    """The dense bf16 peak in FLOP/s of the GPU torch names `name`, or None where it is not known."""
    return next((peak for part, peak in PEAK_BF16_FLOPS.items() if part in name), None)


def peak_bf16_flops(device: torch.device | str) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None where it is not known (CPUs, other GPUs)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return peak_bf16_flops_of(torch.cuda.get_device_name(device))


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


def graph_median_ms(step: Callable[[], object], device: torch.device | str, steps: int = 10, calls: int = 20) -> float:
    """Median GPU milliseconds of one call of step() without the host's launch work: on CUDA, `calls`
    calls captured in one CUDA graph, the graph replayed `steps` times (each replay timed by events),
    the median divided by `calls`. median_ms with sync_each=True counts, for a kernel shorter than its
    launch, the host's Python and launch time too, which a training step hides (its host runs ahead
    of the GPU). step() must be capturable (no host sync, no CPU tensors made on the way). Elsewhere
    than CUDA: median_ms."""
    device = torch.device(device)
    if device.type != "cuda":
        return median_ms(step, device, steps=steps)
    # Warm-up on a side stream, as capture requires: compiles kernels and fills the allocator's caches.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    times = step_times_ms(graph.replay, device, warmup=1, steps=steps)
    return statistics.median(times) / calls


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


# ---- the anatomy of a profiled training step, by part ------------------------------------------
# Each GPU kernel is put in one part of a language-model step by its name (and, for dense GEMMs, by
# the shapes of the operator that launched it). The rules are checked in order; the first match wins.
STEP_PARTS = ("embedding", "attention projections", "attention core", "router", "dispatch/combine",
              "expert GEMMs", "SwiGLU", "FP8 quantizers", "LM head + loss", "norms/rotary/residual", "optimizer",
              "copies and fills", "other kernels")
# The profiler region the fused LM head + loss (moetrain.ops.linear_cross_entropy) runs in: its GEMMs
# cannot be told from a projection's by their shapes alone when the vocabulary size equals the token
# count (each chunk's GEMMs hold the vocabulary once, as a projection's weight gradient holds the
# tokens), and its compiled chunk kernel would pass for a norm's.
LM_HEAD_SCOPE = "moetrain.lm_head_loss"
KERNELS_PER_PART = 5  # anatomy.md names each part's costliest kernels, this many at most
_NAME_RULES = (
    ("optimizer", ("adam", "lpnorm", "sgd")),
    ("attention core", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("router", ("router",)),
    ("SwiGLU", ("swiglu",)),
    ("FP8 quantizers", ("quantize", "column_amax", "fp8_scales")),
    ("expert GEMMs", ("grouped", "groupproblemshape")),
    ("dispatch/combine", ("route_", "invert_plan", "dispatch", "combine", "scatter", "index_add", "gather",
                          "sort", "histc", "bincount", "cumsum")),
    ("LM head + loss", ("log_softmax", "nll_loss", "cross_entropy", "logsumexp")),
    ("embedding", ("embedding",)),
    ("copies and fills", ("memcpy", "memset", "copy_kernel", "fill_kernel")),
)
_GEMM_MARKS = ("gemm", "nvjet", "xmma", "cutlass", "matmul", "cublas")
_NORM_MARKS = ("rsqrt", "mean", "pow", "sin", "cos", "add", "mul", "silu", "neg", "cat", "_to_copy")


def _is_head_gemm(op_shapes: list, vocab_size: int | None, tokens: int | None) -> bool:
    """Whether a dense GEMM launched with these operand shapes is the LM head's: its (M, K, N) hold
    the vocabulary size once more than the token count explains (tokens may equal the vocabulary
    size: then a projection's weight gradient has it once, and every head GEMM twice)."""
    matrices = [shape for shape in op_shapes if shape is not None and len(shape) == 2]
    if not vocab_size or len(matrices) < 2:
        return False
    (m, k), (_, n) = matrices[-2], matrices[-1]
    return [m, k, n].count(vocab_size) > (1 if tokens == vocab_size else 0)


def kernel_part(name: str, op_shapes: list | None = None, vocab_size: int | None = None,
                tokens: int | None = None, scope: str = "") -> str:
    """The step part of one kernel (STEP_PARTS), from its name and, for a dense GEMM, the operand
    shapes of the operator that launched it (the LM head's GEMMs have the vocabulary size in them);
    every kernel launched inside the LM_HEAD_SCOPE region is the head's."""
    if scope == LM_HEAD_SCOPE:
        return "LM head + loss"
    lowered = name.lower()
    for part, marks in _NAME_RULES:
        if any(mark in lowered for mark in marks):
            return part
    if any(mark in lowered for mark in _GEMM_MARKS):
        return "LM head + loss" if _is_head_gemm(op_shapes or [], vocab_size, tokens) else "attention projections"
    if lowered.startswith("triton") and any(mark in lowered for mark in _NORM_MARKS):
        return "norms/rotary/residual"
    return "other kernels"


def _scope(event) -> str:
    """LM_HEAD_SCOPE if the profiled operator `event` ran inside that region, else ""."""
    while event is not None:
        if event.name == LM_HEAD_SCOPE:
            return LM_HEAD_SCOPE
        event = event.cpu_parent
    return ""


def profiled_kernels(profiler) -> list[tuple[str, float, list, str]]:
    """(kernel name, GPU microseconds, operand shapes of the operator that launched it, its region:
    LM_HEAD_SCOPE or "") for the kernels a finished torch.profiler run recorded on the GPU. Each
    kernel name's time is the GPU's own total for it, shared out over the operators that launched it
    (record_shapes=True gives their shapes); kernels launched outside an operator (Triton kernels
    called from Python) come without shapes or region."""
    events = profiler.events()
    device_us: dict[str, float] = {}
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False):
            device_us[event.name] = device_us.get(event.name, 0.0) + event.device_time_total
    launches: dict[str, list[tuple[float, list, str]]] = {}
    for event in events:
        for kernel in getattr(event, "kernels", []):
            launches.setdefault(kernel.name, []).append((kernel.duration, list(event.input_shapes or []),
                                                         _scope(event)))
    kernels = []
    for name, us in device_us.items():
        linked = launches.get(name, [])
        linked_us = sum(duration for duration, _, _ in linked)
        if linked_us <= 0:
            kernels.append((name, us, [], ""))
        else:
            kernels += [(name, us * duration / linked_us, shapes, scope) for duration, shapes, scope in linked]
    return kernels


def step_anatomy(kernels: list[tuple[str, float, list, str]], steps: int, wall_ms: float,
                 vocab_size: int | None = None, tokens: int | None = None) -> dict:
    """Milliseconds per step of each part (STEP_PARTS, plus "idle": the step's wall time minus the GPU's
    busy time) from profiled_kernels over `steps` steps; "part_kernels": each placed part's costliest
    kernels (name, ms a step), at most KERNELS_PER_PART, and "other_kernels": the first 8 of "other
    kernels"; tokens: per micro-batch, which tells the LM head's GEMMs from the others."""
    parts = dict.fromkeys(STEP_PARTS, 0.0)
    by_part: dict[str, dict[str, float]] = {}
    for name, us, shapes, scope in kernels:
        part = kernel_part(name, shapes, vocab_size, tokens, scope)
        parts[part] += us / 1e3 / steps
        names = by_part.setdefault(part, {})
        names[name] = names.get(name, 0.0) + us / 1e3 / steps
    busy = sum(parts.values())
    parts["idle"] = max(0.0, wall_ms - busy)
    ranked = {part: sorted(names.items(), key=lambda item: -item[1]) for part, names in by_part.items()}
    other = ranked.pop("other kernels", [])
    return {"step_ms": wall_ms, "busy_ms": busy, "parts_ms": parts,
            "part_kernels": {part: names[:KERNELS_PER_PART] for part, names in ranked.items()},
            "other_kernels": other[:8]}


QUEUED_GAP_US = 10.0  # a gap this short is the GPU moving from one queued kernel to the next
HOST_ACTIVITIES = 6  # anatomy.md names this many host activities the GPU waited for, the longest first


def profiled_spans(profiler) -> tuple[list[tuple[float, float]], list[tuple[float, float, str]]]:
    """From a finished torch.profiler run: the GPU's work as (start, end) microseconds (kernels,
    copies and fills), and the host's operators and regions as (start, end, name) on the same clock."""
    gpu, host = [], []
    for event in profiler.events():
        if getattr(event, "is_user_annotation", False) and event.device_type != torch.autograd.DeviceType.CPU:
            continue  # a GPU-side copy of a region's range, not work
        span = (event.time_range.start, event.time_range.end)
        if event.device_type == torch.autograd.DeviceType.CUDA:
            gpu.append(span)
        elif event.device_type == torch.autograd.DeviceType.CPU and not event.is_async:
            host.append((*span, event.name))
    return gpu, host


def idle_by_host_activity(gpu: list[tuple[float, float]], host: list[tuple[float, float, str]], steps: int,
                          queued_gap_us: float = QUEUED_GAP_US) -> list[tuple[str, float, int]]:
    """Where the GPU waited and what the host was doing meanwhile: the gaps between the GPU's busy
    intervals (the union of the `gpu` spans, from the first start to the last end), each charged to
    the host spans that hold the gap's midpoint, as "outermost > innermost" (the longest and the
    shortest of them; one name when they are one span; "no host operator" when none holds it).
    Gaps shorter than queued_gap_us are one row of their own, "between queued kernels": the GPU
    going from one kernel to the next, not waiting for the host. -> (activity, ms a step, gaps),
    the most idle time first."""
    idle: dict[str, list] = {}
    # A sweep over the gaps' midpoints, which rise: the host spans started by then enter a heap by end,
    # those ended by then leave it, and what stays holds the midpoint.
    host = sorted(host)
    entered, open_spans = 0, []
    busy_until = None
    for start, end in sorted(gpu):
        if busy_until is not None and start > busy_until:
            gap = start - busy_until
            if gap < queued_gap_us:
                activity = "between queued kernels"
            else:
                middle = (busy_until + start) / 2
                while entered < len(host) and host[entered][0] <= middle:
                    a, b, name = host[entered]
                    heapq.heappush(open_spans, (b, a, entered, name))
                    entered += 1
                while open_spans and open_spans[0][0] <= middle:
                    heapq.heappop(open_spans)
                if not open_spans:
                    activity = "no host operator"
                else:
                    # longest (then earliest) outside, shortest (then latest) inside
                    ranked = sorted(open_spans, key=lambda span: (-(span[0] - span[1]), span[1]))
                    outer, inner = ranked[0], ranked[-1]
                    activity = outer[3] if outer is inner else f"{outer[3]} > {inner[3]}"
            row = idle.setdefault(activity, [0.0, 0])
            row[0] += gap
            row[1] += 1
        busy_until = end if busy_until is None else max(busy_until, end)
    rows = [(activity, us / 1e3 / steps, count) for activity, (us, count) in idle.items()]
    return sorted(rows, key=lambda row: -row[1])


def anatomy_markdown(anatomy: dict) -> str:
    """step_anatomy's result as a Markdown table: part, ms per step, share of the step."""
    step = anatomy["step_ms"]
    lines = ["| part | ms a step | share |", "|---|---:|---:|"]
    lines += [f"| {part} | {ms:.1f} | {ms / step:.1%} |" for part, ms in anatomy["parts_ms"].items() if ms > 0.05]
    lines.append(f"| **step** (GPU busy {anatomy['busy_ms']:.1f}) | **{step:.1f}** | 100% |")
    if anatomy["other_kernels"]:
        lines.append("")
        lines.append("Costliest kernels in 'other kernels': " + "; ".join(
            f"{name[:80]} {ms:.2f} ms" for name, ms in anatomy["other_kernels"]))
    if anatomy["part_kernels"]:
        lines += ["", "Costliest kernels of each part (ms a step):", ""]
        lines += [f"- {part}: " + "; ".join(f"{name[:80]} {ms:.2f}" for name, ms in ranked)
                  for part, ranked in anatomy["part_kernels"].items()]
    if anatomy.get("idle_by_host"):
        rows = anatomy["idle_by_host"]
        lines += ["", f"Where the GPU waited in the profiled steps ({sum(ms for _, ms, _ in rows):.1f} ms a step, the "
                  "profiler's own host work included), by what the host was doing at each gap's midpoint "
                  "(outermost > innermost operator; ms a step, gaps over the profiled steps):", ""]
        lines += [f"- {activity[:160]}: {ms:.2f} ms, {count} gaps" for activity, ms, count in rows[:HOST_ACTIVITIES]]
    return "\n".join(lines)
