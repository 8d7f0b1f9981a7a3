"""The shared step timer (moetrain.timing) on the CPU: every call is made, warm-up calls are not
timed, and a step's time is at least the time it sleeps; the step anatomy places kernels in parts."""

import time

import pytest

from moetrain import timing
from moetrain.timing import median_ms, step_times_ms


def test_warm_up_calls_are_made_and_not_timed():
    calls = []
    times = step_times_ms(lambda: calls.append(1), "cpu", warmup=4, steps=7)
    assert len(calls) == 11 and len(times) == 7


def test_a_step_lasts_at_least_its_sleep():
    slow = median_ms(lambda: time.sleep(0.02), "cpu", warmup=1, steps=3)
    quick = median_ms(lambda: None, "cpu", warmup=1, steps=3)
    assert 20.0 <= slow < 2000.0 and quick < slow


def test_kernel_table_divides_by_the_steps_and_sorts_by_time():
    """The kernel table of --profile: per-step milliseconds and launches, most time first, the
    shares of the GPU's busy time, the costliest `rows` and one line for the rest."""
    import random

    from moetrain.timing import kernel_table

    rng = random.Random()
    kernels = [(f"kernel_{i}", rng.uniform(1, 5000), rng.randint(1, 30)) for i in range(12)]
    steps, wall_ms = 3, 50.0
    lines = kernel_table(kernels, steps, wall_ms, rows=5).splitlines()
    busy_ms = sum(us for _, us, _ in kernels) / 1e3 / steps
    assert lines[0].startswith(f"GPU busy {busy_ms:.2f} ms a step (profiled) of a 50.00 ms step")
    expected = sorted(kernels, key=lambda k: k[1], reverse=True)
    for line, (name, us, count) in zip(lines[2:7], expected):
        ms, share, launches, printed_name = line.split()
        assert printed_name == name
        assert float(ms) == pytest.approx(us / 1e3 / steps, abs=1e-3)
        assert float(launches) == pytest.approx(count / steps, abs=0.05)
        assert float(share.rstrip("%")) == pytest.approx(100 * us / 1e3 / steps / busy_ms, abs=0.05)
    rest = sum(us for _, us, _ in expected[5:]) / 1e3 / steps
    assert lines[7].split()[0] == f"{rest:.3f}" and lines[7].endswith("the other 7 kernels")


# ---- the step anatomy's kernel parts ---------------------------------------------------------------
VOCAB = 32768


@pytest.mark.parametrize("tokens", [VOCAB, 4096])  # the token count may equal the vocabulary size
def test_dense_gemms_are_told_apart_by_their_shapes(tokens):
    D, out = 2048, 512
    head = [[[tokens, D], [D, VOCAB]], [[tokens, VOCAB], [VOCAB, D]], [[VOCAB, tokens], [tokens, D]]]
    projections = [[[tokens, D], [D, out]], [[tokens, out], [out, D]], [[out, tokens], [tokens, D]],
                   [[tokens, D], [D, D]]]
    for shapes in head:
        assert timing.kernel_part("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", shapes, VOCAB, tokens) == "LM head + loss"
    for shapes in projections:
        assert timing.kernel_part("sm90_xmma_gemm_bf16bf16", shapes, VOCAB, tokens) == "attention projections"


def test_kernels_are_placed_by_name():
    named = {
        "_adamw_master_kernel": "optimizer",
        "void multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma": "attention core",
        "_router_kernel": "router", "router_grad_w_kernel": "router",
        "_swiglu_backward_kernel": "SwiGLU",
        "_quantize_fp8_kernel": "FP8 quantizers", "_quantize_transposed_kernel": "FP8 quantizers",
        "_column_amax_kernel": "FP8 quantizers", "_quantize_weight_blocks_kernel": "FP8 quantizers",
        "cutlass::device_kernel<GemmUniversal<GroupProblemShape<...>>>": "expert GEMMs",
        "dispatch_kernel": "dispatch/combine", "combine_backward_kernel": "dispatch/combine",
        "triton_red_fused__log_softmax_nll_loss_forward_3": "LM head + loss",
        "triton_per_fused__fused_rms_norm_add_mul_2": "norms/rotary/residual",
        "Memset (Device)": "copies and fills",
        "some_kernel_nobody_knows": "other kernels",
    }
    assert {name: timing.kernel_part(name) for name in named} == named


def test_the_anatomy_adds_up_to_the_step():
    # (name, microseconds over 2 steps, shapes): 10 ms of expert GEMMs, 4 of attention, 2 unknown a step
    kernels = [("cutlass_GroupProblemShape", 20_000.0, [], ""), ("flash_fwd", 6_000.0, [], ""),
               ("flash_bwd", 2_000.0, [], ""), ("mystery", 4_000.0, [], "")]
    anatomy = timing.step_anatomy(kernels, steps=2, wall_ms=20.0)
    parts = anatomy["parts_ms"]
    assert parts["expert GEMMs"] == pytest.approx(10.0) and parts["attention core"] == pytest.approx(4.0)
    assert parts["other kernels"] == pytest.approx(2.0) and parts["idle"] == pytest.approx(4.0)
    assert anatomy["busy_ms"] == pytest.approx(16.0)
    assert sum(parts.values()) == pytest.approx(20.0)
    assert anatomy["other_kernels"] == [("mystery", pytest.approx(2.0))]
    assert "other kernels" not in anatomy["part_kernels"]  # listed once, as other_kernels
    table = timing.anatomy_markdown(anatomy)
    assert "| expert GEMMs | 10.0 | 50.0% |" in table and "| idle | 4.0 | 20.0% |" in table


def test_each_parts_costliest_kernels_are_named_with_their_time():
    """Against a naive sum by (part, name): each part lists its kernels' per-step ms, largest first,
    the same name launched several times summed, at most KERNELS_PER_PART; the Markdown says them."""
    import random

    rng = random.Random()
    names = ["triton_per_fused__fused_rms_norm_add_%d" % i for i in range(8)] + ["flash_fwd", "flash_bwd",
                                                                                 "_quantize_fp8_kernel"]
    kernels = [(rng.choice(names), rng.uniform(1.0, 5_000.0), [], "") for _ in range(60)]
    steps = 3
    anatomy = timing.step_anatomy(kernels, steps=steps, wall_ms=1e6)
    expected: dict[str, dict[str, float]] = {}
    for name, us, _, _ in kernels:
        part = expected.setdefault(timing.kernel_part(name), {})
        part[name] = part.get(name, 0.0) + us / 1e3 / steps
    assert set(anatomy["part_kernels"]) == set(expected)
    for part, listed in anatomy["part_kernels"].items():
        assert len(listed) == min(timing.KERNELS_PER_PART, len(expected[part]))
        assert [ms for _, ms in listed] == sorted((ms for _, ms in listed), reverse=True)
        assert all(ms == pytest.approx(expected[part][name]) for name, ms in listed)
        assert listed[-1][1] >= max([ms for name, ms in expected[part].items() if name not in dict(listed)], default=0)
        assert sum(ms for _, ms in listed) <= anatomy["parts_ms"][part] + 1e-9
    table = timing.anatomy_markdown(anatomy)
    top_name, top_ms = anatomy["part_kernels"]["norms/rotary/residual"][0]
    assert f"- norms/rotary/residual: {top_name} {top_ms:.2f}" in table


def test_kernels_in_the_fused_heads_region_are_the_heads():
    """The fused LM head + loss runs its chunks' GEMMs and its compiled softmax kernel inside
    timing.LM_HEAD_SCOPE: they are the head's whatever their shapes or names say (with 32768 tokens
    and a vocabulary of 32768, a chunk's dgrad GEMM [C, V] x [V, D] has a projection's weight-gradient
    shape [N, T] x [T, D])."""
    tokens, D, chunk = VOCAB, 2048, 4096
    dgrad_chunk = [[chunk, VOCAB], [VOCAB, D]]
    assert timing.kernel_part("nvjet_tst_128x256", dgrad_chunk, VOCAB, tokens) == "attention projections"
    for name, shapes in (("nvjet_tst_128x256", dgrad_chunk), ("triton_red_fused_exp_logsumexp_sub_0", [])):
        assert timing.kernel_part(name, shapes, VOCAB, tokens, timing.LM_HEAD_SCOPE) == "LM head + loss"


def test_the_fused_losss_operators_are_found_in_its_region():
    """On a CPU profile: every operator linear_cross_entropy runs sits inside LM_HEAD_SCOPE (its
    GEMMs among them), and a matmul before it does not."""
    import torch

    from moetrain.ops.linear_cross_entropy import linear_cross_entropy

    hidden = torch.randn(64, 32, requires_grad=True)
    weight = torch.randn(50, 32, requires_grad=True)
    targets = torch.randint(0, 50, (64,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        outside = hidden @ weight.t()
        linear_cross_entropy(hidden, weight, targets, chunk_tokens=16).backward()
    events = profiler.events()
    gemms = ("aten::mm", "aten::addmm", "aten::addmm_")
    inside_mms = [e for e in events if e.name in gemms and timing._scope(e) == timing.LM_HEAD_SCOPE]
    assert len(inside_mms) >= 3 * 4  # three GEMMs a chunk, four chunks
    outside_mms = [e for e in events if e.name in ("aten::mm", "aten::matmul") and timing._scope(e) == ""]
    assert outside_mms and outside.shape == (64, 50)


def _idle_by_cells(gpu, host, steps, queued):
    """The reference: time in 1 us cells, a cell idle when no GPU span covers it, gaps the runs of idle
    cells between the first start and the last end, each charged at its midpoint."""
    first, last = min(a for a, _ in gpu), max(b for _, b in gpu)
    busy = [any(a <= t < b for a, b in gpu) for t in range(first, last)]
    rows = {}
    t = 0
    while t < len(busy):
        if busy[t]:
            t += 1
            continue
        begin = t
        while t < len(busy) and not busy[t]:
            t += 1
        length, middle = t - begin, first + (begin + t) / 2
        if length < queued:
            activity = "between queued kernels"
        else:
            holding = [(b - a, -a, name) for a, b, name in host if a <= middle < b]
            if not holding:
                activity = "no host operator"
            else:
                outer, inner = max(holding), min(holding)
                activity = outer[2] if outer == inner else f"{outer[2]} > {inner[2]}"
        ms, count = rows.get(activity, (0.0, 0))
        rows[activity] = (ms + length / 1e3 / steps, count + 1)
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_idle_is_charged_to_what_the_host_was_doing(seed):
    """Random GPU spans (overlapping, as from two streams) and host spans (nested and not): each gap
    between the GPU's busy intervals is charged to the longest and the shortest host span holding its
    midpoint, short gaps to the queue; against a naive walk over 1 us cells."""
    import random

    rng = random.Random(seed)
    gpu = []
    for _ in range(rng.randint(5, 40)):
        a = rng.randint(0, 400)
        gpu.append((a, a + rng.randint(1, 30)))
    spans = {}
    for i in range(rng.randint(0, 25)):
        a = rng.randint(-20, 420)
        spans.setdefault((a, a + rng.randint(1, 200)), f"op{i}")  # one name per distinct span
    host = [(a, b, name) for (a, b), name in spans.items()]
    steps = rng.randint(1, 3)
    got = timing.idle_by_host_activity([(float(a), float(b)) for a, b in gpu],
                                       [(float(a), float(b), n) for a, b, n in host], steps, queued_gap_us=3.0)
    want = _idle_by_cells(gpu, host, steps, queued=3)
    assert {activity: (pytest.approx(ms), count) for activity, (ms, count) in want.items()} == {
        activity: (ms, count) for activity, ms, count in got}
    assert [ms for _, ms, _ in got] == sorted((ms for _, ms, _ in got), reverse=True)
    if len(gpu) == 1:
        assert got == []  # one span: nothing to wait between


def test_the_profilers_host_regions_are_spans_and_idle_rows_are_listed():
    """On the CPU the profiler records host operators and regions (no GPU spans); anatomy.md lists the
    idle rows it is given, the most first."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        with torch.profiler.record_function("optimizer region"):
            torch.ones(64).sum()
    gpu, host = timing.profiled_spans(profiler)
    assert gpu == []
    names = [name for _, _, name in host]
    assert "optimizer region" in names and "aten::sum" in names
    (outer,) = [(a, b) for a, b, name in host if name == "optimizer region"]
    assert all(outer[0] <= a and b <= outer[1] for a, b, name in host if name == "aten::sum")
    anatomy = timing.step_anatomy([("mystery", 1000.0, [], "")], steps=1, wall_ms=3.0)
    anatomy["idle_by_host"] = [("Optimizer.step > cudaLaunchKernel", 1.25, 40), ("between queued kernels", 0.5, 900)]
    table = timing.anatomy_markdown(anatomy)
    assert "Where the GPU waited in the profiled steps (1.8 ms a step" in table
    assert table.index("- Optimizer.step > cudaLaunchKernel: 1.25 ms, 40 gaps") < table.index(
        "- between queued kernels: 0.50 ms, 900 gaps")


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H200", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
    ("NVIDIA H200 NVL", 835), ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA GeForce RTX 4090", None)])
def test_each_card_gets_its_own_bf16_peak(name, tflops):
    """The data sheets' dense bf16 figures: an H100 PCIe is not credited an SXM's 989 TFLOP/s (which
    would understate its MFU by a quarter), and an unknown card has no MFU rather than a guessed one."""
    peak = timing.peak_bf16_flops_of(name)
    assert (peak if peak is None else round(peak / 1e12)) == tflops


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_timing_leaves_the_hosts_launch_out():
    """A kernel over 1 GiB, far longer than its launch: the graph's time per call is the event-timed
    call's, within 10 %. The same kernel over 4 bytes: the graph's time is a fraction of the call
    waited for one at a time (which times the host's launch too), and under 20 us. (An elementwise
    kernel, not copy_: a device-to-device copy_ is a cudaMemcpy, which a graph captures as a memcpy
    node that runs at its own rate; on an H200, 0.78 ms a GiB in the graph against 0.52 eager.)"""
    import torch

    device = torch.device("cuda")
    big = torch.randn(256 * 2**20, device=device)
    big_out = torch.empty_like(big)
    graph = timing.graph_median_ms(lambda: torch.mul(big, 2.0, out=big_out), device, steps=10, calls=5)
    events = timing.median_ms(lambda: torch.mul(big, 2.0, out=big_out), device, steps=10, sync_each=True)
    assert graph == pytest.approx(events, rel=0.10)
    small, small_out = torch.ones(1, device=device), torch.empty(1, device=device)
    graph = timing.graph_median_ms(lambda: torch.mul(small, 2.0, out=small_out), device, steps=10, calls=50)
    events = timing.median_ms(lambda: torch.mul(small, 2.0, out=small_out), device, steps=10, sync_each=True)
    assert graph < 0.020 and graph < events / 2


def test_graph_timing_is_plain_timing_off_cuda():
    """On the CPU there is no graph to capture: graph_median_ms times each call as median_ms does."""
    calls = []
    ms = timing.graph_median_ms(lambda: calls.append(time.sleep(0.002)), "cpu", steps=3)
    assert len(calls) == 3 + 3 and ms >= 2.0
