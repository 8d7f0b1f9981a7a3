"""moetrain.ops.triton_grouped: the grouped GEMM kernels against their pure-torch references.

Without a GPU the kernels run in Triton's CPU interpreter (in a subprocess: it is switched on by an
environment variable read when Triton is imported) on fp32 and float8_e4m3fn operands; the
interpreter's bf16 dots are wrong, so 16-bit operands run only in the CUDA tests. What the
interpreter cannot check, the lowering for Hopper (tensor-core MMAs, pipelined copies), is checked
by compiling the kernels for sm_90 on the CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetrain.ops import triton_grouped as tg

ROOT = Path(__file__).resolve().parents[2]
SM90 = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="no sm90 GPU")]
# Small tiles for the interpreter: several row, column and K tiles on small operands.
TINY = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2, GROUP=2)


def _ends(counts: list[int], device) -> torch.Tensor:
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def _fp8(*shape, device) -> torch.Tensor:
    """float8_e4m3fn values over most of E4M3's range."""
    return (torch.randn(*shape, device=device) * 32).to(tg.FP8)


def _scales(*shape, device) -> torch.Tensor:
    return torch.rand(*shape, device=device) + 0.5


def _operands(dtype, scaling: str, kind: str, rows: int, k: int, n: int, num_experts: int, layout: str, device):
    """(a, b, a_scale, b_scale, block) for grouped_mm (kind "mm", b [E, K, N]) or wgrad (kind
    "wgrad", b [R, N]). layout: "plain" every operand contiguous as named; "reduction" the
    reduction dimension contiguous in both (FP8's fast layout: b stored [E, N, K] for mm, a and b
    stored [K, R] and [N, R] for wgrad); "transposed" every operand a view of its transpose."""
    def make(*shape, transposed: bool):
        stored = (*shape[:-2], shape[-1], shape[-2]) if transposed else shape
        t = _fp8(*stored, device=device) if dtype == tg.FP8 else torch.randn(*stored, device=device).to(dtype)
        return t.transpose(-1, -2) if transposed else t

    a = make(rows, k, transposed=layout == "transposed" or (layout == "reduction" and kind == "wgrad"))
    b = make(*((num_experts, k, n) if kind == "mm" else (rows, n)), transposed=layout != "plain")
    if scaling == "none":
        return a, b, None, None, 0
    kb, nb, rb = -(-k // 128), -(-n // 128), -(-rows // 128)
    if kind == "mm" and scaling == "row":
        return a, b, _scales(rows, device=device), _scales(num_experts, n, device=device), 0
    if kind == "mm":
        return a, b, _scales(rows, kb, device=device), _scales(num_experts, kb, nb, device=device), 128
    first = num_experts if scaling == "row" else rb
    return a, b, _scales(first, k, device=device), _scales(first, n, device=device), 128 if scaling == "block" else 0


def _dequantized(t: torch.Tensor) -> torch.Tensor:
    return t.float().abs()


def check(kind: str, dtype, scaling: str, counts: list[int], k: int, n: int, device="cpu", layout="plain",
          out_dtype=torch.float32, config=None, tolerance=None) -> None:
    """One kernel call against its reference: |c - ref| within the error of fp32 accumulation in
    another order (a multiple of K * 2^-24 * (|a| @ |b|)), plus the rounding to out_dtype."""
    rows, num_experts = sum(counts), len(counts)
    ends_E = _ends(counts, device)
    a, b, a_scale, b_scale, block = _operands(dtype, scaling, kind, rows, k, n, num_experts, layout, device)
    if kind == "mm":
        c = tg.grouped_mm(a, b, ends_E, a_scale, b_scale, block, out_dtype, config)
        ref = tg.grouped_mm_reference(a, b, ends_E, a_scale, b_scale, block)
        magnitude = tg.grouped_mm_reference(_dequantized(a), _dequantized(b), ends_E, a_scale, b_scale, block)
        depth = k
    else:
        c = tg.grouped_mm_wgrad(a, b, ends_E, a_scale, b_scale, block, out_dtype, config)
        ref = tg.grouped_mm_wgrad_reference(a, b, ends_E, a_scale, b_scale, block)
        magnitude = tg.grouped_mm_wgrad_reference(_dequantized(a), _dequantized(b), ends_E, a_scale, b_scale, block)
        depth = max(counts, default=0)
    assert c.dtype == out_dtype and c.shape == ref.shape, (c.dtype, c.shape, ref.shape)
    # One unit in the last place of out_dtype (Triton's interpreter truncates fp32 to bf16)
    rounding = 2.0 ** -23 if out_dtype == torch.float32 else 2.0 ** -7 if out_dtype == torch.bfloat16 else 2.0 ** -10
    bound = (tolerance or 4 * depth * 2.0 ** -24) * magnitude + rounding * ref.abs() + 1e-30
    error = (c.float() - ref).abs()
    assert (error <= bound).all(), (f"{kind} {dtype} {scaling} counts={counts} k={k} n={n} {layout}: "
                                    f"max error {error.max().item():.3g}, max |ref| {ref.abs().max().item():.3g}")


def interpreter_checks() -> None:
    """Every kernel variant on small shapes (run under TRITON_INTERPRET=1 by the test below)."""
    torch.manual_seed(0)
    # Ragged experts with empty first, middle and last ones; then one expert, one row, no rows.
    for counts in ([20, 0, 33, 7, 0], [0, 45], [37], [1], []):
        for scaling in ("none", "row", "block"):
            dtype = torch.float32 if scaling == "none" else tg.FP8
            # K and N not multiples of the tiles (masked K); K a multiple (unmasked) with transposed
            # views; K > 128 and not a multiple of 128 (two scale blocks, the last one partial).
            sizes = ((40, 24, "plain"), (48, 33, "transposed"), (200, 20, "reduction")) if len(counts) == 5 \
                else ((40, 24, "reduction"),)
            for k, n, layout in sizes:
                check("mm", dtype, scaling, counts, k, n, layout=layout,
                      config=dict(TINY, BLOCK_K=32) if k == 200 else TINY)
    # The TMA kernel (config TMA=1) in the layout it reads: K contiguous, 16-byte rows. N not a multiple
    # of BLOCK_N (a tile reads the next expert's weight rows) and K not one of BLOCK_K (zeros past the
    # end), experts empty at the start, middle and end; where the layout does not allow TMA (K = 200
    # E4M3 bytes) the pointer kernel runs.
    for counts in ([0, 21, 0, 40, 3, 0], [37]):
        for dtype, scaling in ((torch.float32, "none"), (tg.FP8, "row")):
            for k, n in ((64, 40), (80, 16), (200, 24)):
                a, b, *_ = _operands(dtype, scaling, "mm", sum(counts), k, n, len(counts), "reduction", "cpu")
                assert tg._tma_layout(a, b) == (k * a.element_size() % 16 == 0), (dtype, k)
                for tma in (1, 2):
                    check("mm", dtype, scaling, counts, k, n, layout="reduction", config=dict(TINY, BLOCK_K=32, TMA=tma))
    a = torch.randn(8, 16)
    assert not tg._tma_layout(a, torch.randn(2, 16, 8)) and not tg._tma_layout(a.t(), torch.randn(2, 8, 16).mT)
    # Weight gradients: experts crossing 128-row scale blocks and BLOCK_K slab edges, starting and
    # ending inside a slab, an empty one, one within one slab, one aligned to both; operands with
    # columns or rows contiguous.
    for counts in ([5, 0, 95, 28, 172], [3], [0, 0], [128, 64]):
        for scaling in ("none", "row", "block"):
            dtype = torch.float32 if scaling == "none" else tg.FP8
            layouts = ("plain", "reduction") if len(counts) == 5 else ("reduction" if counts == [128, 64] else "plain",)
            for layout in layouts:
                check("wgrad", dtype, scaling, counts, 40, 24, layout=layout, config=dict(TINY, BLOCK_K=32))
    # bf16 outputs; the default tiles; BLOCK_K = 128 for the block scales.
    check("mm", tg.FP8, "block", [30, 90], 256, 48, out_dtype=torch.bfloat16,
          config=dict(TINY, BLOCK_M=32, BLOCK_K=128))
    check("wgrad", tg.FP8, "row", [30, 90], 32, 16, out_dtype=torch.bfloat16)
    check("mm", torch.float32, "none", [3, 60], 24, 40)
    print("ok")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests run the kernels there")
def test_kernels_in_the_interpreter():
    pytest.importorskip("triton")
    command = "import sys; sys.path.insert(0, 'tests/ops'); import test_triton_grouped as t; t.interpreter_checks()"
    result = subprocess.run([sys.executable, "-c", command], cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout[-2000:] + result.stderr[-4000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests compile the kernels there")
def test_kernels_compile_for_hopper(tmp_path):
    """Compiled for sm_90 by Triton on this CPU at the default tiles of a large GEMM, with aligned
    operands in FP8's fast layout (as the launches specialise them): warp-group MMAs (on E4M3 for
    FP8), pipelined asynchronous copies in the reduction loops, and (ptxas -v) no register spills."""
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    from hopper_ptx import assert_no_spills, compile_ptx

    pointers = {"a_ptr": "", "b_ptr": "", "c_ptr": "*bf16", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "ends_ptr": "*i32"}
    ints = {"mm": "N K M_TILES E stride_am stride_be stride_bn stride_cm stride_sam stride_sak stride_sbe stride_sbk "
                  "stride_sbn", "wgrad": "R N K stride_ak stride_bn stride_ce stride_ck stride_sa0 stride_sb0"}
    unit_strides = {"mm": ("stride_ak", "stride_bk", "stride_cn"),
                    "wgrad": ("stride_ar", "stride_br", "stride_cn", "stride_sak", "stride_sbn")}
    for kind, dtype, scaling in (("mm", torch.bfloat16, 0), ("mm", tg.FP8, 1), ("mm", tg.FP8, 2),
                                 ("wgrad", torch.bfloat16, 0), ("wgrad", tg.FP8, 1), ("wgrad", tg.FP8, 2)):
        fn = tg._grouped_mm_kernel if kind == "mm" else tg._grouped_mm_wgrad_kernel
        config = tg.default_config(dtype, 4096, 1024, 128 if scaling == 2 else 0)
        element = "*bf16" if dtype == torch.bfloat16 else "*fp8e4nv"
        types = {**pointers, "a_ptr": element, "b_ptr": element, **dict.fromkeys(ints[kind].split(), "i32")}
        constants = dict.fromkeys(unit_strides[kind], 1)
        constants.update(SCALING=scaling, PRECISION="tf32", GROUP=config["GROUP"],
                         **{key: config[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K")})
        if kind == "mm":
            constants.update(E_P2=128, EVEN_K=True)
        ptx = compile_ptx(fn, types, constants, config["num_warps"], config["num_stages"])
        what = (kind, dtype, scaling)
        assert "wgmma.mma_async" in ptx and "cp.async.cg.shared.global" in ptx, what
        assert ("e4m3" in ptx) == (dtype == tg.FP8), what
        assert_no_spills(ptx, tmp_path, what)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests compile the kernels there")
def test_tma_kernel_compiles_for_hopper(tmp_path):
    """grouped_mm's TMA kernel, compiled for sm_90 on this CPU at FP8's default tiles, one program a
    tile and persistent: tensor-memory copies (cp.async.bulk.tensor) feeding E4M3 warp-group MMAs,
    and (ptxas -v) no register spills."""
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    if tg.TensorDescriptor is None:
        pytest.skip("this Triton has no host tensor descriptors")
    from hopper_ptx import assert_no_spills, compile_ptx

    fn = tg._grouped_mm_tma_kernel
    config = tg.default_config(tg.FP8, 4096, 1024)
    assert config["TMA"] == 1
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    types = {"a_desc": f"tensordesc<fp8e4nv[{block_m}, {block_k}]>", "b_desc": f"tensordesc<fp8e4nv[{block_n}, {block_k}]>",
             "c_ptr": "*bf16", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "ends_ptr": "*i32",
             **dict.fromkeys("N K M_TILES E stride_cm stride_sam stride_sbe".split(), "i32")}
    for persistent in (False, True):
        constants = dict(stride_cn=1, stride_sbn=1, SCALING=1, PRECISION="tf32", E_P2=8, BLOCK_M=block_m,
                         BLOCK_N=block_n, BLOCK_K=block_k, GROUP=config["GROUP"], PERSISTENT=persistent)
        ptx = compile_ptx(fn, types, constants, config["num_warps"], config["num_stages"])
        assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx and "e4m3" in ptx, persistent
        assert_no_spills(ptx, tmp_path, persistent)


def test_bad_arguments_are_refused():
    pytest.importorskip("triton")
    ends = _ends([2, 2], "cpu")
    a, b = torch.randn(4, 8), torch.randn(2, 8, 16)
    q, w = a.to(tg.FP8), b.to(tg.FP8)
    with pytest.raises(ValueError, match="one dtype"):
        tg.grouped_mm(a, b.half(), ends)
    with pytest.raises(ValueError, match="need a_scale"):
        tg.grouped_mm(q, w, ends)
    with pytest.raises(ValueError, match="a_scale must have shape"):
        tg.grouped_mm(q, w, ends, torch.ones(4, 1), torch.ones(2, 16))
    with pytest.raises(ValueError, match="block must be"):
        tg.grouped_mm(q, w, ends, torch.ones(4), torch.ones(2, 16), block=64)
    with pytest.raises(ValueError, match="BLOCK_K dividing"):
        tg.grouped_mm(q, w, ends, torch.ones(4, 1), torch.ones(2, 1, 1), block=128, config=dict(BLOCK_K=96))
    with pytest.raises(ValueError, match="b_scale must have shape"):
        tg.grouped_mm_wgrad(q, q, ends, torch.ones(2, 8), torch.ones(1, 8))
    with pytest.raises(ValueError, match="ends_E must be int32"):
        tg.grouped_mm_wgrad(a, a, ends.long())
    with pytest.raises(ValueError, match="unknown config keys"):
        tg.grouped_mm(a, b, ends, config=dict(BLOCK=16))


def test_custom_ops_trace_into_one_graph():
    """torch.export (Dynamo, whole graph) of forward, dgrad and wgrad on fake CUDA tensors: the
    custom ops and their fake implementations, without a GPU."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Step(torch.nn.Module):
        def forward(self, x, w, ends):
            y = tg.grouped_mm(x, w, ends)
            dx = tg.grouped_mm(y, w.transpose(1, 2), ends, config=dict(BLOCK_N=64))
            return dx, tg.grouped_mm_wgrad(x, y, ends)

    with FakeTensorMode():
        x = torch.empty(160, 64, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(3, 64, 96, device="cuda", dtype=torch.bfloat16)
        ends = torch.empty(3, device="cuda", dtype=torch.int32)
        program = torch.export.export(Step(), (x, w, ends))
    calls = [node for node in program.graph.nodes if node.op == "call_function"]
    assert [str(node.target) for node in calls] == ["moetrain.grouped_mm.default", "aten.transpose.int",
                                                     "moetrain.grouped_mm.default", "moetrain.grouped_mm_wgrad.default"]
    outputs = [(tuple(node.meta["val"].shape), node.meta["val"].dtype) for node in calls
               if "moetrain" in str(node.target)]
    assert outputs == [((160, 96), torch.bfloat16), ((160, 64), torch.bfloat16), ((3, 64, 96), torch.float32)]


def test_import_without_triton():
    """The module imports without Triton (the references run; the kernels say what they need)."""
    command = ("import sys; sys.modules['triton'] = None; import torch; from moetrain.ops import triton_grouped as tg; "
               "assert tg.triton is None; ends = torch.tensor([1, 3], dtype=torch.int32); "
               "tg.grouped_mm_reference(torch.ones(3, 2), torch.ones(2, 2, 4), ends)\n"
               "try:\n    tg.grouped_mm(torch.ones(3, 2), torch.ones(2, 2, 4), ends)\n"
               "except RuntimeError as e:\n    print(e)")
    result = subprocess.run([sys.executable, "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "needs Triton" in result.stdout, result.stderr[-3000:]


def test_benchmark_refuses_a_cpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the benchmark would run")
    result = subprocess.run([sys.executable, "benchmarks/grouped_gemm.py"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "GPU" in result.stdout + result.stderr


# ---------------------------------------------------------------- CUDA

# Error bounds on the GPU, in units of (|a| @ |b|): the tensor cores' accumulation order, and for
# FP8 on sm90 its accumulation inside the tensor cores, which keeps fewer bits than fp32 (module
# docstring). Loose next to the interpreter's bound; indexing and scale bugs (checked tightly there)
# show up as errors of order 1.
GPU_TOLERANCE = {torch.bfloat16: 1e-3, tg.FP8: 5e-3}

# The LM shapes (tokens x top-k rows, D, H, E) scaled down: gate-up (K=D, N=2H) and down (K=H, N=D).
SHAPES = {"moe_1b5": (2048 * 2, 512, 512, 8), "qwen3_30b": (1024 * 8, 512, 192, 32),
          "mixtral": (512 * 2, 1024, 1792, 8), "dsv3": (512 * 8, 896, 256, 64)}


def _random_counts(rows: int, num_experts: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(num_experts, generator=generator) + 0.2
    picks = torch.multinomial(weights, rows, replacement=True, generator=generator)
    return torch.bincount(picks, minlength=num_experts).tolist()


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype,scaling", [(torch.bfloat16, "none"), (tg.FP8, "row"), (tg.FP8, "block")])
@pytest.mark.parametrize("kind", ["mm", "dgrad", "wgrad"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=SM90)])
def test_lm_shapes_on_the_gpu(shape, dtype, scaling, kind, device):
    """Default tiles at the LM shapes scaled down, each operand laid out as training holds it.
    Tolerance: GPU_TOLERANCE and the bf16 output's rounding."""
    torch.manual_seed(1)
    rows, d, h, num_experts = SHAPES[shape]
    counts = _random_counts(rows, num_experts, seed=3)
    fast = dtype == tg.FP8
    tolerance = GPU_TOLERANCE[dtype]
    for k, n in ((d, 2 * h), (h, d)):
        if kind == "dgrad":
            k, n = n, k  # dy [R, N_out] @ w^T: reduce over the forward's N
        # FP8 in its fast layout; bf16 as a layer holds it (w [E, K, N], dgrad through w's transpose)
        layout = "reduction" if fast or kind == "dgrad" else "plain"
        check("wgrad" if kind == "wgrad" else "mm", dtype, scaling, counts, k, n, device, layout=layout,
              out_dtype=torch.bfloat16, tolerance=tolerance)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype,scaling", [(torch.bfloat16, "none"), (tg.FP8, "row")])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=SM90)])
def test_tma_kernel_at_lm_shapes_on_the_gpu(shape, dtype, scaling, device):
    """grouped_mm's TMA kernel (config TMA=1, and TMA=2 persistent) at the scaled-down LM shapes, forward and dgrad, in the
    layout it reads (K contiguous); then ragged experts with K and N off the tiles."""
    torch.manual_seed(4)
    rows, d, h, num_experts = SHAPES[shape]
    counts = _random_counts(rows, num_experts, seed=5)
    for tma in (1, 2):
        config = dict(tg.default_config(dtype, 1024, rows / num_experts), TMA=tma)
        for k, n in ((d, 2 * h), (h, d), (2 * h, d), (d, h)):
            check("mm", dtype, scaling, counts, k, n, device, layout="reduction", out_dtype=torch.bfloat16,
                  config=config, tolerance=GPU_TOLERANCE[dtype])
        for ragged in ([0, 0, 300, 0], [517], [1, 0, 255, 129]):
            check("mm", dtype, scaling, ragged, 208, 136, device, layout="reduction", out_dtype=torch.bfloat16,
                  config=config, tolerance=GPU_TOLERANCE[dtype])


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=SM90)])
def test_edge_layouts_on_the_gpu(device):
    """Empty experts (first, last, all but one), one expert, no experts; K and N off the tiles."""
    torch.manual_seed(2)
    bf16, fp8 = GPU_TOLERANCE[torch.bfloat16], GPU_TOLERANCE[tg.FP8]
    for counts in ([0, 0, 300, 0], [517], [1, 0, 255, 129], []):
        for kind in ("mm", "wgrad"):
            check(kind, torch.bfloat16, "none", counts, 200, 136, device, out_dtype=torch.bfloat16, tolerance=bf16)
            check(kind, torch.bfloat16, "none", counts, 200, 136, device, layout="transposed", tolerance=bf16)
            check(kind, tg.FP8, "block", counts, 200, 136, device, layout="reduction", tolerance=fp8)
            check(kind, tg.FP8, "row", counts, 200, 136, device, layout="plain", tolerance=fp8)
            check(kind, torch.float32, "none", counts, 72, 40, device, tolerance=2e-3)  # TF32 allowed or not


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=SM90)])
def test_custom_ops_compile_into_one_graph(device):
    torch.manual_seed(3)
    counts = [100, 0, 60]
    ends = _ends(counts, device)
    x = torch.randn(160, 64, device=device, dtype=torch.bfloat16)
    w = torch.randn(3, 64, 96, device=device, dtype=torch.bfloat16)

    def step(x, w, ends):
        y = tg.grouped_mm(x, w, ends)
        dx = tg.grouped_mm(y, w.transpose(1, 2), ends)
        return dx, tg.grouped_mm_wgrad(x, y, ends)

    compiled = torch.compile(step, fullgraph=True)
    for got, expected in zip(compiled(x, w, ends), step(x, w, ends)):
        torch.testing.assert_close(got, expected)
