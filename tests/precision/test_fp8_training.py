"""FP8 training of the expert GEMMs (moetrain.precision.fp8_matmul, MoELayer(precision="fp8" | "fp8_block")).

Each quantization is checked bit for bit: "fp8"'s against moetrain.precision.formats (the E4M3 codec and
scale written from the format definition), "fp8_block"'s 1x128, 128x1 and 128x128 tiles against a
loop over the tiles written from the definition (scale = the tile's largest magnitude / 448, values
divided by it and rounded to E4M3). Each of the three GEMMs of a step (forward, dgrad, wgrad) is
checked against an fp32 GEMM of the dequantized operands, which it equals up to the order of the
fp32 accumulation and the final bfloat16 rounding; and the layer's gradients against the same
layer in full precision within the bound E4M3's 3-bit mantissa allows. On a GPU the CUDA paths
(Triton quantization, torch._scaled_grouped_mm for "fp8", moetrain.ops.triton_grouped for
"fp8_block") are checked against the same references.
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetrain import MoELayer, ops
from moetrain.moe.routing import make_plan
from moetrain.precision import fp8_matmul, fp8_quantize, kernels
from moetrain.precision.formats import FORMATS, dequantize_fp8_groups, quantize_fp8_groups
from moetrain.precision.fp8_matmul import fp8_supported

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="no sm90 GPU")])
DEVICES = ["cpu", CUDA]
BF16_ULP = 2.0**-7  # a bfloat16 rounding of the output: at most half of this, relative


def _skip_unless_supported(device: str, precision: str) -> None:
    ok, why = fp8_supported(torch.device(device), precision)
    if not ok:
        pytest.skip(f"precision={precision!r} does not run here: {why}")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().cpu(), want.detach().cpu()
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _counts(total: int, experts: int, generator: torch.Generator, empty: int | None = None) -> list[int]:
    """Random row counts per expert summing to total; expert `empty` gets none."""
    weights = torch.rand(experts, generator=generator) + 0.05
    if empty is not None:
        weights[empty] = 0
    counts = (weights / weights.sum() * total).floor().long()
    counts[int(weights.argmax())] += total - int(counts.sum())
    return counts.tolist()


def _dequantized_rows(x_RK: torch.Tensor) -> torch.Tensor:
    """x as the FP8 GEMM sees it when quantized per row (the format's per-token activations)."""
    k = x_RK.size(1)
    return dequantize_fp8_groups(*quantize_fp8_groups(x_RK.float().cpu(), k), k)


def _dequantized_columns(x_RK: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """x as the weight-gradient GEMM sees it: each expert's rows quantized per column."""
    return torch.cat([_dequantized_rows(part.t()).t() if part.size(0) else part
                      for part in torch.split(x_RK.float().cpu(), counts)])


def _dequantized_weight(w_EKN: torch.Tensor, over: int) -> torch.Tensor:
    """w with the format "fp8" (one scale per output channel) applied to w[e].T (over K, the forward)
    or to w[e] (over N, the dgrad)."""
    fmt = FORMATS["fp8"]
    out = []
    for w_KN in w_EKN.float().cpu():
        w_NK = w_KN.t() if over == 1 else w_KN
        deq = fmt.dequantize(fmt.quantize(w_NK), w_NK.size(1))
        out.append(deq.t() if over == 1 else deq)
    return torch.stack(out)


def _per_expert(a_RK: torch.Tensor, w_EKN: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return torch.cat([a @ w for a, w in zip(torch.split(a_RK, counts), w_EKN)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,cols,experts", [(1, 16, 1), (77, 48, 3), (1000, 200, 7)])
def test_column_quantization_is_the_format_per_expert_column(device, rows, cols, experts):
    g = torch.Generator().manual_seed(rows + cols)
    counts = _counts(rows, experts, g, empty=experts // 2 if experts > 1 else None)
    x = (torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, cols)).to(device, torch.bfloat16)
    x[0, 0] = 0
    counts_E = torch.tensor(counts, device=device)
    padded = int(fp8_quantize.padded_ends(counts_E)[-1]) + (16 if device == "cuda" else 0)  # CUDA: any bound works
    q_CP, scale_EC = fp8_quantize.quantize_columns(x, counts_E, padded)
    assert q_CP.shape == (cols, padded) and scale_EC.shape == (experts, cols)
    q_CP, scale_EC = q_CP.cpu(), scale_EC.cpu()
    start = padded_start = 0
    for e, count in enumerate(counts):
        if count:
            want_q, want_scale = quantize_fp8_groups(x[start:start + count].cpu().float().t(), count)
            assert torch.equal(scale_EC[e], want_scale.view(-1))
            got = q_CP[:, padded_start:padded_start + count]
            assert torch.equal(got.view(torch.uint8), want_q.view(torch.uint8))
        else:
            assert torch.equal(scale_EC[e], torch.ones(cols))
        pad = -(-count // fp8_quantize.ALIGN) * fp8_quantize.ALIGN
        assert not q_CP[:, padded_start + count:padded_start + pad].float().any(), "padding columns must be zero"
        start += count
        padded_start += pad


def _e4m3_values(*shape: int) -> torch.Tensor:
    """fp32 tensor of random E4M3 values (any code but NaN)."""
    codes = torch.randint(0, 256, shape, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    return codes.view(torch.float8_e4m3fn).float()


def _exact_values(rows: int, cols: int, group_starts) -> torch.Tensor:
    """E4M3 values times a power of two per column, and 448 times it (either sign) in each group's
    first row: each group's scale is that power of two and every quotient is exact. Triton's
    interpreter rounds to E4M3 wrongly (1.98 becomes 1.0), so its checks leave out the rounding
    (the CUDA tests check it) and test where each value and scale lands."""
    power = 2.0 ** torch.randint(-6, 7, (cols,)).float()
    x = _e4m3_values(rows, cols) * power
    for start in group_starts:
        if start < rows:
            x[start] = 448 * power * torch.where(torch.rand(cols) < 0.5, -1.0, 1.0)
    return x


def quantizer_interpreter_checks() -> None:
    """The training quantizers' Triton kernels against the CPU paths (run under TRITON_INTERPRET=1
    by the test below): the per-expert columns with empty, short and tile-crossing experts and
    extra places past the last one, the weights' columns over K, the 128x1 tiles, the 128x128
    weight blocks; and the token path's row gather."""
    torch.manual_seed(0)
    for counts in ([20, 0, 33, 7, 0], [0, 45], [37], [1], [130, 3, 0, 70], []):
        starts = torch.tensor([0] + counts).cumsum(0)[:-1].tolist()
        for cols in (48, 200):
            x = _exact_values(sum(counts), cols, starts).to(torch.bfloat16)
            counts_E = torch.tensor(counts, dtype=torch.int64)
            for extra in (0, 32):
                places = (int(fp8_quantize.padded_ends(counts_E)[-1]) if counts else 0) + extra
                # with a second operand of other columns, one layout for both (the weight gradient's pair)
                dy = _exact_values(sum(counts), 40, starts).to(torch.bfloat16)
                got = fp8_quantize._quantize_column_list_triton([x, dy], counts_E.to(torch.int32), places)
                want = fp8_quantize.quantize_columns(x, counts_E, places) + fp8_quantize.quantize_columns(dy, counts_E, places)
                for got_t, want_t in zip(got, want, strict=True):
                    assert got_t.dtype == want_t.dtype and got_t.shape == want_t.shape, (counts, cols, extra)
                    assert torch.equal(got_t.view(torch.uint8) if got_t.dtype == torch.float8_e4m3fn else got_t,
                                       want_t.view(torch.uint8) if want_t.dtype == torch.float8_e4m3fn else want_t), \
                        (counts, cols, extra)
    # A NaN or an infinity makes its (expert, column)'s scale NaN and no other (only the scales are
    # compared: the interpreter encodes NaN wrongly).
    x = _exact_values(60, 48, [0, 25]).to(torch.bfloat16)
    x[30, 7], x[5, 40] = float("nan"), float("-inf")
    counts_E = torch.tensor([25, 35])
    _, got_scale = fp8_quantize._quantize_columns_triton(x, counts_E, int(fp8_quantize.padded_ends(counts_E)[-1]))
    nan = torch.zeros(2, 48, dtype=torch.bool)
    nan[1, 7] = nan[0, 40] = True
    assert torch.equal(got_scale.isnan(), nan)
    w = _exact_values(3 * 70, 50, [0, 70, 140]).view(3, 70, 50)  # groups: each expert's K rows of a column
    got_q, got_scale = fp8_quantize._quantize_weight_columns_triton(w)
    want_q, want_scale = fp8_quantize.quantize_weight(w, over=1)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(got_scale, want_scale)
    for rows in (300, 128, 5):
        x = _exact_values(rows, 40, range(0, rows, 128)).to(torch.bfloat16)
        got_q, got_scale = fp8_quantize._quantize_column_tiles_triton(x)
        want_q, want_scale = fp8_quantize.quantize_column_tiles(x)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), rows
        assert torch.equal(got_scale, want_scale), rows
    # 128x128 weight blocks, ragged in K and N, in both layouts; a NaN poisons its block's scale
    # (only the scale is compared there: the interpreter also encodes NaN wrongly).
    for k, n in ((200, 130), (128, 256), (5, 7)):
        w = _exact_blocks(3, k, n)
        for k_contiguous in (True, False):
            got_q, got_scale = fp8_quantize._quantize_weight_blocks_triton(w, k_contiguous)
            want_q, want_scale = fp8_quantize.quantize_weight_blocks(w, k_contiguous)
            assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), (k, n, k_contiguous)
            assert torch.equal(got_scale, want_scale), (k, n, k_contiguous)
        w[1, k - 1, n - 1] = float("nan")
        _, got_scale = fp8_quantize._quantize_weight_blocks_triton(w, True)
        nan = torch.zeros(got_scale.shape, dtype=torch.bool)
        nan[1, -1, -1] = True
        assert torch.equal(got_scale.isnan(), nan), (k, n)
    # The SwiGLU kernels that quantize what they write: bit for bit moetrain.ops.swiglu's kernels
    # followed by the row quantizer (all run by the interpreter), odd widths, a zero row, no rows.
    from moetrain.ops import swiglu

    # (the last width: three slices of a row, the third ragged)
    for rows, hidden in ((5, 48), (3, 100), (1, 4), (0, 8), (7, 64), (3, 2 * kernels.SWIGLU_CHUNK + 5)):
        gate_up = (torch.randn(rows, 2 * hidden) * 3).to(torch.bfloat16)
        if rows > 2:
            gate_up[2] = 0
        grad_h = torch.randn(rows, hidden).to(torch.bfloat16)
        h, grad = torch.empty(rows, hidden, dtype=torch.bfloat16), torch.empty_like(gate_up)
        if rows:
            grid = swiglu._grid(rows * hidden)
            swiglu._swiglu_forward_kernel[grid](gate_up, h, rows * hidden, BLOCK=swiglu._PAIRS_PER_PROGRAM)
            swiglu._swiglu_backward_kernel[grid](grad_h, gate_up, grad, rows * hidden, BLOCK=swiglu._PAIRS_PER_PROGRAM)
        for got, want in ((kernels.swiglu_quantize(gate_up), (h, *kernels.quantize_fp8(h, hidden))),
                          (kernels.swiglu_backward_quantize(grad_h, gate_up), (grad, *kernels.quantize_fp8(grad, 2 * hidden)))):
            assert torch.equal(got[0], want[0]), (rows, hidden)
            assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8)), (rows, hidden)
            assert torch.equal(got[2], want[2].view(-1)), (rows, hidden)
    # The dispatching quantizer: each row from a naive loop (zeros where the source is one past the
    # last token), its codes and scales the row quantizer's (run by the interpreter too); odd widths,
    # rows held whole and rows walked in three slices, a zero token, no tokens, no rows.
    for tokens, rows, width in ((9, 14, 40), (5, 3, 2 * kernels.DISPATCH_CHUNK + 24), (6, 11, 64), (0, 4, 16),
                                (4, 0, 16)):
        x = (torch.randn(tokens, width) * 30).to(torch.bfloat16)
        if tokens > 2:
            x[1] = 0
        source = torch.randint(0, tokens + 1, (rows,))
        source[::3] = tokens
        want_rows = torch.stack([x[i] if i < tokens else torch.zeros(width, dtype=x.dtype)
                                 for i in source.tolist()]) if rows else x.new_empty(0, width)
        got = kernels.dispatch_quantize(x, source)
        want = (want_rows, *kernels.quantize_fp8(want_rows, width))
        assert torch.equal(got[0], want[0]), (tokens, rows, width)
        assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8)), (tokens, rows, width)
        assert torch.equal(got[2], want[2].view(-1)), (tokens, rows, width)
    # The token path's row gather (moetrain::fp8_gather_rows on CUDA): each row from a naive loop,
    # the pad where the source is one past the table; E4M3 rows of odd and multi-block widths, 1-D
    # and 2-D scales (fp8's rows, fp8_block's tiles), an empty table, no rows.
    for tokens, rows, shape, dtype, pad in ((9, 14, (40,), torch.float8_e4m3fn, 0.0),
                                            (5, 3, (2 * fp8_matmul.GATHER_VALUES + 24,), torch.float8_e4m3fn, 0.0),
                                            (7, 12, (), torch.float32, 1.0), (6, 10, (3,), torch.float32, 1.0),
                                            (0, 4, (16,), torch.float8_e4m3fn, 0.0), (4, 0, (16,), torch.float32, 1.0)):
        table = (torch.randn(tokens, *shape) * 50).to(dtype)
        source = torch.randint(0, tokens + 1, (rows,))
        source[::3] = tokens  # pad rows, whatever the draw
        got = fp8_matmul._gather_rows_triton(table, source, pad)
        bytes_of = (lambda t: t.view(torch.uint8)) if dtype == torch.float8_e4m3fn else (lambda t: t)
        want = [bytes_of(table[i]) if i < tokens else bytes_of(torch.full(shape, pad).to(dtype)) for i in source.tolist()]
        assert got.shape == (rows, *shape) and got.dtype == dtype, (tokens, rows, shape)
        for row, expected in enumerate(want):
            assert torch.equal(bytes_of(got[row]), expected), (tokens, rows, shape, row)
    print("ok")


def _exact_blocks(experts: int, k: int, n: int) -> torch.Tensor:
    """[E, K, N] fp32 of E4M3 values times a power of two per 128x128 block, with 448 times it at the
    block's first element: exact quotients, as _exact_values."""
    w = _e4m3_values(experts, k, n)
    for e in range(experts):
        for k0 in range(0, k, 128):
            for n0 in range(0, n, 128):
                power = 2.0 ** torch.randint(-6, 7, ()).item()
                w[e, k0:k0 + 128, n0:n0 + 128] *= power
                w[e, k0, n0] = 448 * power
    return w


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests run the kernels there, rounding included")
def test_quantizers_in_the_interpreter():
    pytest.importorskip("triton")
    command = ("import sys; sys.path.insert(0, 'tests/precision'); import test_fp8_training as t; "
               "t.quantizer_interpreter_checks()")
    result = subprocess.run([sys.executable, "-c", command], cwd=Path(__file__).resolve().parents[2],
                            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout[-2000:] + result.stderr[-4000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests run the kernels there")
def test_swiglu_quantizing_kernels_compile_for_hopper(tmp_path):
    """The SwiGLU quantizing kernels as they launch on moe_1b5's rows (2048 pairs, one pass), compiled
    for sm_90 on this CPU: the rows read and written with 16-byte vector accesses (each thread a run
    of adjacent values, not one interleaved pair), and (ptxas -v) no register spills."""
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    from hopper_ptx import assert_no_spills, compile_ptx

    rows_each, chunk, one_pass = kernels._swiglu_tile(2048)
    assert one_pass and rows_each * chunk == kernels.SWIGLU_CHUNK
    rows = {"R": "i32", "H": "i32", "q_ptr": "*u8", "scale_ptr": "*fp32", "gate_up_ptr": "*bf16"}
    for fn, types in ((kernels._swiglu_quantize_kernel, {**rows, "h_ptr": "*bf16"}),
                      (kernels._swiglu_backward_quantize_kernel, {**rows, "grad_h_ptr": "*bf16", "grad_ptr": "*bf16"})):
        types = {name: types[name] for name in fn.arg_names if name in types}
        ptx = compile_ptx(fn, types, dict(ROWS=rows_each, CHUNK=chunk, ONE_PASS=one_pass), kernels.SWIGLU_WARPS)
        assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx, fn.__name__
        assert not re.search(r"ld\.global(\.nc)?\.b32", ptx), fn.__name__  # no scalar loads of pairs
        assert_no_spills(ptx, tmp_path, fn.__name__)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests run the kernels there")
def test_dispatching_quantizer_compiles_for_hopper(tmp_path):
    """The dispatching quantizer as it launches on moe_1b5's rows (2048 bf16 values, held whole),
    compiled for sm_90 on this CPU: each copied row read and written, and its codes written, with
    16-byte vector accesses; (ptxas -v) no register spills."""
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    from hopper_ptx import assert_no_spills, compile_ptx

    chunk = min(kernels.DISPATCH_CHUNK, 2048)
    types = {"x_ptr": "*bf16", "source_ptr": "*i64", "out_ptr": "*bf16", "q_ptr": "*u8", "scale_ptr": "*fp32",
             "T": "i32", "R": "i32", "K": "i32"}
    ptx = compile_ptx(kernels._dispatch_quantize_kernel, types,
                      dict(ROWS=kernels.DISPATCH_CHUNK // chunk, CHUNK=chunk, ONE_PASS=True), kernels.DISPATCH_WARPS)
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    assert not re.search(r"ld\.global(\.nc)?\.b16", ptx)  # no scalar loads of values
    assert_no_spills(ptx, tmp_path, "_dispatch_quantize_kernel")


@pytest.mark.parametrize("device", DEVICES)
def test_row_and_weight_quantization_are_the_formats(device):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(50, 96, generator=g) * 10).to(device, torch.bfloat16)
    q, scale = fp8_quantize.quantize_rows(x)
    want_q, want_scale = quantize_fp8_groups(x.cpu().float(), 96)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale.cpu(), want_scale.view(-1))
    w = torch.randn(3, 32, 48, generator=g).to(device)
    fmt = FORMATS["fp8"]
    q_ENK, scale_EN = fp8_quantize.quantize_weight(w, over=1)
    q_EKN, scale_EK = fp8_quantize.quantize_weight(w, over=2)
    for e in range(3):
        forward = fmt.quantize(w[e].cpu().t())
        assert torch.equal(q_ENK[e].cpu().view(torch.uint8), forward["data"].view(torch.uint8))
        assert torch.equal(scale_EN[e].cpu(), forward["scale"])
        dgrad = fmt.quantize(w[e].cpu())
        assert torch.equal(q_EKN[e].cpu().view(torch.uint8), dgrad["data"].view(torch.uint8))
        assert torch.equal(scale_EK[e].cpu(), dgrad["scale"])


@pytest.fixture(params=["torch", "triton"])
def rowwise_gemms(request):
    """precision="fp8"'s grouped GEMMs on CUDA: torch._scaled_grouped_mm or moetrain's Triton ones
    (the CPU emulates them either way)."""
    fp8_matmul.set_rowwise_gemms(request.param)
    yield request.param
    fp8_matmul.set_rowwise_gemms("auto")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,k,n,experts,padding", [(64, 32, 48, 4, 0), (517, 128, 80, 6, 11), (9, 16, 16, 3, 0)])
@pytest.mark.parametrize("wgrad", ["bf16", "fp8"])
def test_three_gemms_are_fp32_gemms_of_the_dequantized_operands(device, rows, k, n, experts, padding, wgrad,
                                                                 rowwise_gemms):
    """Forward and dgrad: fp32 GEMMs of the operands as E4M3 rounds them (row-wise scales); wgrad:
    the same per expert column (wgrad="fp8"), or of the bf16 operands (wgrad="bf16")."""
    if device == "cpu" and rowwise_gemms == "triton":
        pytest.skip("the CPU emulates the GEMMs whichever CUDA kernels are chosen")
    g = torch.Generator().manual_seed(rows)
    counts = _counts(rows, experts, g, empty=1)
    x = torch.randn(rows + padding, k, generator=g)
    x[rows:] = 0  # the packed layout's padding rows
    x = x.to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(experts, k, n, generator=g) / k**0.5).to(device).requires_grad_()
    y = fp8_matmul.fp8_expert_matmul(x, w, torch.tensor(counts, device=device), None, wgrad=wgrad)
    assert y.shape == (rows + padding, n) and y.dtype == torch.bfloat16
    all_counts = counts[:-1] + [counts[-1] + padding]
    want_y = _per_expert(_dequantized_rows(x.detach()), _dequantized_weight(w.detach(), over=1), all_counts)
    assert _rel(y[:rows], want_y[:rows]) < BF16_ULP
    dy = torch.randn(rows + padding, n, generator=g).to(device, torch.bfloat16)
    y.backward(dy)
    want_dx = _per_expert(_dequantized_rows(dy), _dequantized_weight(w.detach(), over=2).transpose(1, 2), all_counts)
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert _rel(x.grad, want_dx) < BF16_ULP
    if wgrad == "fp8":
        _assert_weight_gradient(w.grad, _dequantized_columns(x.detach(), all_counts),
                                _dequantized_columns(dy, all_counts), all_counts)
    else:
        _assert_weight_gradient(w.grad, x.detach().float().cpu(), dy.float().cpu(), all_counts)


def _assert_weight_gradient(grad_w, xs, dys, counts) -> None:
    """grad_w[e] against xs_e^T @ dys_e over expert e's rows (the dequantized operands, fp32), within
    bf16 rounding; an expert without rows gets zeros."""
    want = torch.stack([a.t() @ b for a, b in zip(torch.split(xs, counts), torch.split(dys, counts))])
    for e, count in enumerate(counts):
        if count:
            assert _rel(grad_w[e], want[e]) < BF16_ULP, f"expert {e}"
        else:
            assert not grad_w[e].any()


# ---------------------------------------------------------------- fp8_block


def _reference_tiles(x: torch.Tensor, tile: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [A, B] quantized per tile of tile[0] x tile[1] elements (ragged at the far edges), from the
    definition, one tile at a time: scale = largest magnitude / 448 (1 for an all-zero tile), values
    x / scale rounded to E4M3 -> (float8_e4m3fn [A, B], fp32 scales [ceil(A/t0), ceil(B/t1)])."""
    x = x.detach().float().cpu()
    (rows, cols), (t0, t1) = x.shape, tile
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-rows // t0), -(-cols // t1))
    for i in range(scale.size(0)):
        for j in range(scale.size(1)):
            part = x[i * t0:(i + 1) * t0, j * t1:(j + 1) * t1]
            amax = part.abs().max()
            scale[i, j] = amax / 448.0 if amax > 0 else 1.0
            q[i * t0:(i + 1) * t0, j * t1:(j + 1) * t1] = (part / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def _reference_dequantized(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """x as a GEMM sees it once quantized per tile (the reference above, decoded)."""
    q, scale = _reference_tiles(x, tile)
    expanded = scale.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:x.size(0), :x.size(1)]
    return q.float() * expanded


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.detach().cpu().contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_block_tiles_are_the_definition_bit_for_bit(device, monkeypatch):
    """1x128 row tiles (x, dy), 128x1 column tiles over global 128-row blocks (wgrad's x, dy) and
    128x128 weight blocks, on sizes that are not multiples of 128, against _reference_tiles."""
    _skip_unless_supported(device, "fp8_block")
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(300, 200, generator=g) * torch.logspace(-3, 3, 200)).to(device, torch.bfloat16)
    x[:, 128:] = 0  # a zero tile: scale 1
    q_RK, scale_RKb = fp8_quantize.quantize_row_tiles(x)
    want_q, want_scale = _reference_tiles(x, (1, 128))
    assert scale_RKb.shape == (300, 2) and torch.equal(scale_RKb.cpu(), want_scale)
    assert _same_bits(q_RK, want_q)
    q_KR, scale_RbK = fp8_quantize.quantize_column_tiles(x)
    want_q, want_scale = _reference_tiles(x, (128, 1))
    assert q_KR.shape == (200, 300) and scale_RbK.shape == (3, 200)
    assert torch.equal(scale_RbK.cpu(), want_scale) and _same_bits(q_KR.t(), want_q)
    w = (torch.randn(3, 200, 130, generator=g) * torch.logspace(-2, 2, 130)).to(device)
    q_ENK, scale_EKbNb = fp8_quantize.quantize_weight_blocks(w, k_contiguous=True)
    q_EKN, scale_again = fp8_quantize.quantize_weight_blocks(w, k_contiguous=False)
    assert q_ENK.shape == (3, 130, 200) and q_EKN.shape == (3, 200, 130) and scale_EKbNb.shape == (3, 2, 2)
    assert q_ENK.is_contiguous() and q_EKN.is_contiguous()
    assert torch.equal(scale_again, scale_EKbNb)
    for e in range(3):
        want_q, want_scale = _reference_tiles(w[e], (128, 128))
        assert torch.equal(scale_EKbNb[e].cpu(), want_scale)
        assert _same_bits(q_EKN[e], want_q) and _same_bits(q_ENK[e].t(), want_q)
    # Large layers are quantized a group of experts at a time: the same values and scales.
    monkeypatch.setattr(fp8_quantize, "_BLOCK_CHUNK", w[0].numel() * 2)
    for k_contiguous, (want_q, want_scale) in ((True, (q_ENK, scale_EKbNb)), (False, (q_EKN, scale_again))):
        q, scale = fp8_quantize.quantize_weight_blocks(w, k_contiguous=k_contiguous)
        assert _same_bits(q, want_q.cpu()) and torch.equal(scale, want_scale)


@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_value_poisons_only_its_block_tiles(device):
    _skip_unless_supported(device, "fp8_block")
    x = torch.randn(260, 300, device=device, dtype=torch.bfloat16)
    x[130, 5] = float("inf")
    _, row_scale = fp8_quantize.quantize_row_tiles(x)
    _, column_scale = fp8_quantize.quantize_column_tiles(x)
    w = torch.randn(1, 260, 300, device=device)
    w[0, 130, 5] = float("nan")
    _, block_scale = fp8_quantize.quantize_weight_blocks(w, k_contiguous=True)
    for scale, where in ((row_scale, (130, 0)), (column_scale, (1, 5)), (block_scale[0], (1, 0))):
        nan = torch.zeros(scale.shape, dtype=torch.bool)
        nan[where] = True
        assert torch.equal(scale.isnan().cpu(), nan)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,k,n,experts,padding", [(64, 32, 48, 4, 0), (517, 200, 80, 6, 11), (300, 256, 384, 3, 0),
                                                      (9, 16, 16, 3, 0)])
@pytest.mark.parametrize("wgrad", ["bf16", "fp8"])
def test_block_gemms_are_fp32_gemms_of_the_dequantized_operands(device, rows, k, n, experts, padding, wgrad):
    """fp8_block's forward, dgrad and wgrad against fp32 GEMMs of the operands quantized by
    _reference_tiles: K and N below, above and at multiples of 128, an expert without rows, row
    counts (and 128-row blocks) that straddle experts, padding rows past the last expert."""
    _skip_unless_supported(device, "fp8_block")
    g = torch.Generator().manual_seed(rows + k)
    counts = _counts(rows, experts, g, empty=1)
    x = torch.randn(rows + padding, k, generator=g) * torch.logspace(-1, 1, k)
    x[rows:] = 0  # the packed layout's padding rows
    x = x.to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(experts, k, n, generator=g) / k**0.5).to(device).requires_grad_()
    y = fp8_matmul.fp8_expert_matmul(x, w, torch.tensor(counts, device=device), None, "fp8_block", wgrad)
    assert y.shape == (rows + padding, n) and y.dtype == torch.bfloat16
    all_counts = counts[:-1] + [counts[-1] + padding]
    w_blocks = torch.stack([_reference_dequantized(w_KN, (128, 128)) for w_KN in w.detach()])
    want_y = _per_expert(_reference_dequantized(x, (1, 128)), w_blocks, all_counts)
    assert _rel(y[:rows], want_y[:rows]) < BF16_ULP
    dy = torch.randn(rows + padding, n, generator=g).to(device, torch.bfloat16)
    y.backward(dy)
    want_dx = _per_expert(_reference_dequantized(dy, (1, 128)), w_blocks.transpose(1, 2), all_counts)
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert _rel(x.grad, want_dx) < BF16_ULP
    if wgrad == "fp8":
        _assert_weight_gradient(w.grad, _reference_dequantized(x, (128, 1)), _reference_dequantized(dy, (128, 1)),
                                all_counts)
    else:
        _assert_weight_gradient(w.grad, x.detach().float().cpu(), dy.float().cpu(), all_counts)


def test_rowwise_gemms_choice_is_checked():
    with pytest.raises(ValueError, match=r"backend must be one of \['auto', 'torch', 'triton'\], got 'cutlass'"):
        fp8_matmul.set_rowwise_gemms("cutlass")


def test_fp8_precision_is_checked():
    x, w = torch.randn(4, 8), torch.randn(2, 8, 8)
    with pytest.raises(ValueError, match=r"precision must be one of \['fp8', 'fp8_block'\], got 'fp8_row'"):
        fp8_matmul.fp8_expert_matmul(x, w, [2, 2], None, "fp8_row")
    with pytest.raises(ValueError, match="precision must be one of"):
        fp8_supported(torch.device("cpu"), "bf16")
    assert fp8_supported(torch.device("cpu"), "fp8_block") == (True, "CPU: emulated in fp32")
    assert not fp8_supported(torch.device("meta"), "fp8_block")[0]


def _layer_pair(device, expert, capacity_factor, seed, precision="fp8"):
    torch.manual_seed(seed)
    # GELU, not ReLU, for the FFN: where ReLU's input is within rounding of 0 its derivative flips
    # between 0 and 1, and those few flips (in any precision) would dominate the comparison.
    kwargs = dict(model_dim=64, num_experts=4, hidden_size=96, top_k=2, expert=expert, capacity_factor=capacity_factor,
                  activation="gelu" if expert == "ffn" else "silu", gate_kwargs={"normalize": True} if expert == "swiglu" else None)
    full = MoELayer(**kwargs).to(device)
    fp8 = MoELayer(**kwargs, precision=precision).to(device)
    fp8.load_state_dict(full.state_dict())
    return full, fp8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp8", "fp8_block"])
@pytest.mark.parametrize("expert,capacity_factor", [("swiglu", 0.0), ("ffn", 0.0), ("ffn", 1.25)])
def test_layer_gradients_stay_within_the_fp8_bound_of_full_precision(device, precision, expert, capacity_factor):
    """Same weights, same routing (the gate is not quantized): outputs and every gradient within
    10% relative. E4M3 rounds each operand by up to 2^-4 relative (about 2.5% rms), one GEMM of two
    quantized operands is off by about 3.5%, and a gradient here passes through two such GEMMs.
    The bound is the same for fp8_block: a finer scale shrinks only the error of values far below
    their group's largest one (down to E4M3's subnormals), not the 2^-4 relative rounding."""
    _skip_unless_supported(device, precision)
    full, fp8 = _layer_pair(device, expert, capacity_factor, seed=5, precision=precision)
    x = torch.randn(4, 33, 64, device=device)
    probe = torch.randn(4, 33, 64, device=device)  # dy: random, so that rounding errors do not line up
    outputs, grads = [], []
    for layer in (full, fp8):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y.float() * probe).sum().backward()
        outputs.append(y.float())
        grads.append([xi.grad] + [p.grad for p in layer.experts.parameters()])
    assert _rel(outputs[1], outputs[0]) < 0.1
    for got, want in zip(grads[1], grads[0]):
        assert _rel(got, want) < 0.1
    # and FP8 really ran: the result is not the full-precision one
    assert _rel(outputs[1], outputs[0]) > 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp8", "fp8_block"])
@pytest.mark.parametrize("expert,capacity_factor", [("swiglu", 0.0), ("ffn", 1.0), ("swiglu", -0.5)])
@pytest.mark.parametrize("impl", ["kernel", "torch"])
@pytest.mark.parametrize("fp8_wgrad", ["bf16", "fp8"])
def test_tokens_quantized_once_give_the_dispatched_rows_result(device, precision, expert, capacity_factor, impl,
                                                                fp8_wgrad, monkeypatch):
    """In FP8 the layer's first expert GEMM quantizes each token once and gathers its FP8 rows
    (TokenRows) instead of quantizing each dispatched copy. Its output and every gradient are the
    same bit for bit as with the dispatched rows, in the packed layout, the padded one (rows no
    token fills) and the capped one (dropped choices), with moetrain's kernels and in pure torch,
    with the weight gradient in bf16 or in FP8 (where rows no token fills reach the next GEMM's
    per-expert column scales). Row-wise FP8 SwiGLU experts with kernels take the fused operators
    (fp8_token_swiglu_experts: the SwiGLU kernels write the next GEMM's E4M3 rows), the same numbers
    again as the unfused GEMMs and activation on the dispatched rows."""
    _skip_unless_supported(device, precision)
    _, layer = _layer_pair(device, expert, capacity_factor, seed=7, precision=precision)
    layer.fp8_wgrad = fp8_wgrad
    layer.impl = layer.gate.impl = layer.experts.impl = impl  # as MoELayer(impl=impl) sets them
    x = torch.randn(3, 41, 64, device=device)
    probe = torch.randn(3, 41, 64, device=device)
    token_calls = []
    token_matmul = fp8_matmul.fp8_token_matmul
    monkeypatch.setattr(fp8_matmul, "fp8_token_matmul", lambda *a: token_calls.append(1) or token_matmul(*a))
    fused_calls = []
    fused = fp8_matmul.fp8_token_swiglu_experts
    monkeypatch.setattr(fp8_matmul, "fp8_token_swiglu_experts", lambda *a: fused_calls.append(1) or fused(*a))
    results = []
    for gathers in (True, False):
        monkeypatch.setattr(type(layer), "_first_gemm_gathers", lambda self, *args, gathers=gathers: gathers)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y.float() * probe).sum().backward()
        results.append([y, xi.grad] + [p.grad.clone() for p in layer.parameters()])
        layer.zero_grad(set_to_none=True)
    # the first GEMM of the first pass only, or the fused experts in its place
    fuses = expert == "swiglu" and precision == "fp8" and impl == "kernel"
    assert (len(fused_calls), len(token_calls)) == ((1, 0) if fuses else (0, 1))
    if capacity_factor < 0:
        assert layer.stats.dropped_fraction > 0
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_the_row_gather_op_against_a_loop(device):
    """moetrain::fp8_gather_rows (the token path's gather of E4M3 rows and their scales, a custom op
    so that torch.compile never sees E4M3 reinterpreted as bytes): each row from a naive loop over
    the source indices, pad where the index is one past the table; its fake and autograd
    registration pass torch.library.opcheck (its schema test cannot compare E4M3 tensors on a CPU)."""
    _skip_unless_supported(device, "fp8")
    generator = torch.Generator().manual_seed(4)
    table = (torch.randn(6, 40, generator=generator) * 30).to(torch.float8_e4m3fn).to(device)
    scales = torch.rand(6, generator=generator).to(device)
    source = torch.tensor([5, 6, 0, 0, 3, 6], device=device)
    values, gathered_scales = fp8_matmul._gather_rows(table, source, 0.0), fp8_matmul._gather_rows(scales, source, 1.0)
    for row, index in enumerate(source.tolist()):
        want = table[index].view(torch.uint8) if index < 6 else torch.zeros(40, dtype=torch.uint8, device=device)
        assert torch.equal(values[row].view(torch.uint8), want)
        assert gathered_scales[row].item() == (scales[index].item() if index < 6 else 1.0)
    op = torch.ops.moetrain.fp8_gather_rows.default
    torch.library.opcheck(op, (table, source, 0.0),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(op, (scales, source, 1.0))


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("dim", [2048, 40, 2 * kernels.DISPATCH_CHUNK + 24])
def test_the_dispatching_quantizer_on_the_gpu(device, dim):
    """The fused SwiGLU experts' input rows on the GPU (kernels.dispatch_quantize, one pass): the rows
    moetrain.ops.dispatch makes, bit for bit, and their E4M3 rows and scales the row quantizer's, with
    rows no token fills (padding) and a dropped choice; rows held whole, short, and walked in slices."""
    generator = torch.Generator().manual_seed(dim)
    tokens, top_k, experts = 300, 2, 5
    x = (torch.randn(tokens, dim, generator=generator) * 20).to(device, torch.bfloat16)
    x[7] = 0
    logits = torch.randn(tokens, experts, generator=generator).to(device)
    plan = make_plan(logits.topk(top_k, dim=-1).indices, None, experts, capacity_factor=1.0)  # padded rows
    dest = plan.dest_TK.clone()
    dest[3, 1] = -1
    got = fp8_matmul._dispatched_rows(x, dest, plan.num_rows, "kernel")
    x_RK = ops.dispatch(x, dest, plan.num_rows, impl="kernel")
    want = (x_RK, *fp8_quantize.quantize_rows(x_RK))
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
    assert torch.equal(got[2], want[2])


@pytest.mark.parametrize("device", DEVICES)
def test_the_fused_swiglu_operators_register_their_shapes_and_gradients(device):
    """The fused SwiGLU experts' operators (fp8_token_swiglu_experts) pass torch.library.opcheck: their
    fake (shape-only) versions match what they return, and their autograd registration is complete,
    which torch.compile relies on to keep them whole in the graph."""
    _skip_unless_supported(device, "fp8")
    generator = torch.Generator().manual_seed(5)
    tokens, dim, hidden, experts, top_k = 12, 32, 16, 3, 2
    x = torch.randn(tokens, dim, generator=generator).to(device, torch.bfloat16).requires_grad_()
    w_gate_up = torch.randn(experts, dim, 2 * hidden, generator=generator).to(device).requires_grad_()
    w_down = torch.randn(experts, hidden, dim, generator=generator).to(device).requires_grad_()
    dest = torch.randperm(tokens * top_k, generator=generator).view(tokens, top_k).to(device)
    counts = torch.tensor([10, 0, 14], device=device)
    utils = ("test_faketensor", "test_autograd_registration")
    torch.library.opcheck(torch.ops.moetrain.fp8_token_swiglu.default,
                          (x, w_gate_up, counts, dest, tokens * top_k, "bf16", "kernel"), test_utils=utils)
    gate_up = torch.randn(tokens * top_k, 2 * hidden, generator=generator).to(device, torch.bfloat16)
    grad_h = torch.randn(tokens * top_k, hidden, generator=generator).to(device, torch.bfloat16)
    torch.library.opcheck(torch.ops.moetrain.fp8_swiglu_backward.default, (grad_h, gate_up), test_utils=utils)
    h = grad_h.clone().requires_grad_()
    hq, h_scale = fp8_quantize.quantize_rows(h.detach())
    torch.library.opcheck(torch.ops.moetrain.fp8_quantized_rows_matmul.default,
                          (h, hq, h_scale, w_down, counts, "bf16"), test_utils=utils)
    dyq, dy_scale = fp8_quantize.quantize_rows(gate_up)
    torch.library.opcheck(torch.ops.moetrain.fp8_grad_input_quantized.default, (dyq, dy_scale, w_gate_up, counts),
                          test_utils=utils)


def test_the_layer_gathers_tokens_in_fp8_only_where_its_experts_and_layout_allow():
    layer = MoELayer(16, 4, 32, top_k=2, expert="swiglu", capacity_factor=0.0, precision="fp8")
    plan = make_plan(torch.tensor([[0, 1], [2, 0]]), None, 4, 0.0)
    assert layer._first_gemm_gathers(plan, None, None)
    assert not layer._first_gemm_gathers(plan, 2, None) and not layer._first_gemm_gathers(plan, None, 2)
    layer.precision = "bf16"
    assert not layer._first_gemm_gathers(plan, None, None)
    layer.precision = "fp8"
    layer.recompute_experts = True  # selective recomputation re-runs the hidden part from the dispatched rows
    assert not layer._first_gemm_gathers(plan, None, None)
    with torch.no_grad():
        assert layer._first_gemm_gathers(plan, None, None)
    # under expert parallelism: tests/precision/test_fp8_exchange.py


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp8", "fp8_block"])
def test_empty_batch_and_empty_experts(device, precision):
    _skip_unless_supported(device, precision)
    full, fp8 = _layer_pair(device, "swiglu", 0.0, seed=1, precision=precision)
    x = torch.randn(0, 64, device=device, requires_grad=True)
    y = fp8(x)
    y.sum().backward()
    assert y.shape == (0, 64) and not fp8.experts.w_down.grad.any()
    # the padded layout keeps rows (k an expert) that no token fills
    _, padded = _layer_pair(device, "ffn", 1.0, seed=1, precision=precision)
    y = padded(x)
    y.sum().backward()
    assert y.shape == (0, 64) and not padded.experts.w1.grad.any()
    w = torch.randn(3, 16, 16, device=device, requires_grad=True)
    y = fp8_matmul.fp8_expert_matmul(torch.randn(0, 16, device=device, dtype=torch.bfloat16), w,
                                   torch.zeros(3, dtype=torch.long, device=device), None, precision)
    y.sum().backward()
    assert y.shape == (0, 16) and torch.equal(w.grad, torch.zeros_like(w))


def test_precision_is_checked_and_settable():
    with pytest.raises(ValueError, match=r"precision must be one of \['bf16', 'fp8', 'fp8_block'\], got 'fp16'"):
        MoELayer(16, 2, 16, precision="fp16")
    layer = MoELayer(16, 2, 16)
    assert layer.precision == "bf16"
    layer.precision = "fp8"
    assert layer.experts.precision == "fp8" and "precision='fp8'" in repr(layer)
    layer.precision = "fp8_block"
    assert layer.experts.precision == "fp8_block" and "precision='fp8_block'" in repr(layer)


def _compiled_and_eager_gradients(device: str, precision: str, dtype: torch.dtype):
    """A tiny LM with FP8 experts: its loss and every parameter's gradient, eager and compiled."""
    from moetrain.models.presets import build_lm
    from moetrain.moe import moe_layers, set_parameter_dtype

    torch.manual_seed(0)
    with torch.device(device):
        model = build_lm("qwen3_moe_tiny", vocab_size=128, max_seq_len=32)
    if dtype != torch.float32:
        set_parameter_dtype(model, dtype)
    for layer in moe_layers(model):
        layer.precision = precision
    tokens, targets = (torch.randint(0, 128, (2, 32), device=device) for _ in range(2))
    results = []
    for forward in (model, torch.compile(model)):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype != torch.float32):
            loss = forward(tokens, targets=targets)
        loss.backward()
        results.append((loss.detach(), {name: p.grad.float() for name, p in model.named_parameters()}))
    return results


def _check_cpu_gradients() -> None:
    """_compiled_and_eager_gradients on the CPU in fp32: the same loss, and every parameter's
    gradient, the routed experts' included, within 1e-2. The compiled graph sums in another order,
    which can flip an E4M3 or bf16 rounding (1e-4 apart here); a lost gradient is 1 apart."""
    (eager_loss, eager), (compiled_loss, compiled) = _compiled_and_eager_gradients("cpu", "fp8", torch.float32)
    assert torch.allclose(compiled_loss, eager_loss, rtol=1e-5)
    assert any("experts" in name for name in eager)
    for name, grad in eager.items():
        assert grad.norm() > 0 and _rel(compiled[name], grad) < 1e-2, name


def test_a_compiled_fp8_model_has_the_eager_gradients_on_the_cpu():
    _check_cpu_gradients()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp8", "fp8_block"])
@pytest.mark.parametrize("wgrad", ["bf16", "fp8"])
@pytest.mark.parametrize("tokens_quantized_once", [True, False])
def test_fp8_gemms_compile_into_one_graph_with_the_eager_gradients(device, precision, wgrad, tokens_quantized_once):
    """Each FP8 GEMM is one operator in the compiled graph (fullgraph=True: no graph break), and
    the compiled output and gradients are eager's: the same kernels run, differentiated by the same
    formula. Traced as autograd.Functions, CUDA lost the experts' gradients (the module's comment)."""
    import torch._dynamo

    from moetrain.precision.fp8_matmul import fp8_expert_matmul, fp8_token_matmul

    _skip_unless_supported(device, precision)
    torch.manual_seed(3)
    tokens, top_k, num_experts, k, n = 70, 2, 4, 256, 192
    counts_E = torch.bincount(torch.randint(0, num_experts, (tokens * top_k,)), minlength=num_experts)
    dest_TK = torch.randperm(tokens * top_k).view(tokens, top_k).to(device)  # each copy its own row
    x_TK = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    w_EKN = (torch.randn(num_experts, k, n, device=device) / k**0.5).requires_grad_()
    probe_RN = torch.randn(tokens * top_k, n, device=device)

    def step(x_TK, w_EKN):
        if tokens_quantized_once:
            y_RN = fp8_token_matmul(x_TK, dest_TK, tokens * top_k, w_EKN, counts_E, None, precision, wgrad=wgrad)
        else:
            x_RK = torch.zeros(tokens * top_k, k, device=device, dtype=x_TK.dtype).index_copy(
                0, dest_TK.reshape(-1), x_TK.repeat_interleave(top_k, 0))
            y_RN = fp8_expert_matmul(x_RK, w_EKN, counts_E, None, precision, wgrad)
        return (y_RN.float() * probe_RN).sum()

    torch._dynamo.reset()
    results = []
    for run in (step, torch.compile(step, fullgraph=True)):
        x_TK.grad = w_EKN.grad = None
        loss = run(x_TK, w_EKN)
        loss.backward()
        results.append((loss.detach(), x_TK.grad.float(), w_EKN.grad))
    (loss, dx, dw), (compiled_loss, compiled_dx, compiled_dw) = results
    assert dx.norm() > 0 and dw.norm() > 0
    assert _rel(compiled_loss, loss) < 1e-5
    # the same kernels on the same operands; the compiled graph may only reorder the fp32 sums
    # of the probe and of the copies' input gradients
    assert _rel(compiled_dx, dx) < 1e-5 and _rel(compiled_dw, dw) < 1e-5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="no sm90 GPU")
@pytest.mark.parametrize("precision", ["fp8", "fp8_block"])
def test_a_compiled_fp8_model_has_the_eager_gradients_on_the_gpu(precision):
    """bf16 parameters under autocast, as trainer.param_dtype=bfloat16 trains: the compiled model's
    gradients are eager's (traced as autograd.Functions, the FP8 GEMMs' gradients were lost on
    CUDA). Compiling moves even the bf16 model's gradients (sums reordered, intermediate roundings
    skipped): by up to 0.28 relative on this tiny model's norm and router weights (H100, 2026-12-05),
    and FP8 by 0.32. So each parameter's compiled FP8 gradient must stay within twice the bf16
    model's own compiled difference plus 0.4; a lost or zeroed gradient is 1 apart."""
    _skip_unless_supported("cuda", precision)
    (_, bf16_eager), (_, bf16_compiled) = _compiled_and_eager_gradients("cuda", "bf16", torch.bfloat16)
    (eager_loss, eager), (compiled_loss, compiled) = _compiled_and_eager_gradients("cuda", precision, torch.bfloat16)
    assert _rel(compiled_loss, eager_loss) < BF16_ULP
    assert any("experts" in name for name in eager)
    for name, grad in eager.items():
        bound = 2 * _rel(bf16_compiled[name], bf16_eager[name]) + 0.4
        assert grad.norm() > 0 and _rel(compiled[name], grad) < bound, name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="no sm90 GPU")
@pytest.mark.parametrize("precision", ["fp8", "fp8_block"])
def test_a_compiled_fp8_layer_has_the_eager_result_and_gradients(precision):
    _skip_unless_supported("cuda", precision)
    _, fp8 = _layer_pair("cuda", "swiglu", 0.0, seed=2, precision=precision)
    fp8.to(torch.bfloat16)
    fp8.gate.float()
    x = torch.randn(2, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    results = []
    for forward in (fp8, torch.compile(fp8, fullgraph=True)):
        fp8.zero_grad(set_to_none=True)
        x.grad = None
        y = forward(x)
        y.float().square().sum().backward()
        results.append((y.detach().float(), x.grad.float(), fp8.experts.w_gate_up.grad.float()))
    (y, dx, dw), (cy, cdx, cdw) = results
    assert _rel(cy, y) < BF16_ULP and dw.norm() > 0
    assert _rel(cdx, dx) < 2 * BF16_ULP and _rel(cdw, dw) < 2 * BF16_ULP


def _stdlib_corpus(directory, chars: int) -> None:
    """The first `chars` characters of the Python standard library's top-level modules, one .txt
    document per module, in name order (the same corpus on every machine with the same Python)."""
    import sysconfig
    from pathlib import Path

    directory.mkdir()
    total = 0
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = source.read_text(errors="replace")[:chars - total]
        (directory / f"{source.stem}.txt").write_text(text)
        total += len(text)
        if total >= chars:
            break


def test_qwen3_recipe_in_fp8_reaches_the_full_precision_validation_loss(tmp_path):
    """The qwen3_moe_lm recipe on text (the standard library's sources, byte tokens) through the
    command, fp32 against fp8 (the expert GEMMs emulated in FP8 on the CPU), same seed and steps:
    the validation losses agree within 3 % while the training really moved (loss far below ln 257).

    3 %, not the 1 % one would like: at this size one run is noisy. Measured with 160 steps and
    seeds 0-3, fp8 against fp32 was +0.2, +2.5, -0.4 and -0.6 % (mean +0.4 %), while fp32 alone
    moved by 4 % between those seeds; this test's 80 steps at seed 0 gave +1.3 %."""
    import json
    import math
    import os
    import subprocess
    import sys

    _stdlib_corpus(tmp_path / "corpus", 600_000)
    command = [sys.executable, "-m", "moetrain", "-m", "+recipe=qwen3_moe_lm", "data=text",
               f"data.path={tmp_path / 'corpus'}", "data.seq_len=64", "data.batch_size=8", "data.eval_batch_size=16",
               "trainer.max_steps=80", "trainer.eval_every=0", "trainer.eval_batches=8", "trainer.checkpoint_every=0",
               "trainer.progress_bar=false", "trainer.device=cpu", "trainer.precision=fp32,fp8", "logger=none",
               f"hydra.sweep.dir={tmp_path / 'runs'}", "hydra.sweep.subdir=${hydra.job.num}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    losses = {p: json.loads((tmp_path / "runs" / str(job) / "metrics.json").read_text())["eval/loss"]
              for job, p in enumerate(("fp32", "fp8"))}
    assert losses["fp32"] < 0.6 * math.log(257), losses  # it learned: byte-level text is far from uniform
    assert abs(losses["fp8"] - losses["fp32"]) <= 0.03 * losses["fp32"], losses
    assert losses["fp8"] != losses["fp32"]  # the FP8 GEMMs really ran


@pytest.mark.parametrize("fp8_wgrad", [None, "fp8"])
def test_trainer_precision_fp8_block_runs_every_expert_gemm_in_fp8_block(fp8_wgrad, tmp_path, monkeypatch):
    """`moetrain trainer.precision=fp8_block` (in process, the quickstart recipe, tiny, CPU): the
    trainer sets every MoE layer to fp8_block, so each step's forward and dgrad expert GEMMs go
    through the block-scaled path, and the weight gradients through bf16 GEMMs or, with
    trainer.fp8_wgrad=fp8, the block-scaled path too; the run finishes with a finite loss."""
    import json
    import sys

    from conftest import TINY_RUN, TINY_SYNTHETIC

    from moetrain import cli

    calls = {"rows": 0, "columns": 0, "bf16": 0}
    for kind, name in (("rows", "block_rows_matmul"), ("columns", "block_columns_matmul"), ("bf16", "bf16_weight_grad")):
        def counted(*args, _kind=kind, _gemm=getattr(fp8_matmul, name)):
            calls[_kind] += 1
            return _gemm(*args)
        monkeypatch.setattr(fp8_matmul, name, counted)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["moetrain", "+recipe=quickstart", *TINY_RUN, *TINY_SYNTHETIC, "logger=none",
                                      "trainer.device=cpu", "trainer.precision=fp8_block", "trainer.eval_every=0",
                                      *([f"trainer.fp8_wgrad={fp8_wgrad}"] if fp8_wgrad else []),
                                      f"hydra.run.dir={tmp_path / 'run'}", "hydra/job_logging=none",
                                      "hydra/hydra_logging=none"])
    cli.main()
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["step"] == 3
    assert all(math.isfinite(v) for k, v in metrics.items() if "loss" in k), metrics
    # wgrad: once per expert GEMM and step; forward and dgrad: twice that, and the final evaluation's forwards
    wgrads, unused = ("columns", "bf16") if fp8_wgrad == "fp8" else ("bf16", "columns")
    assert calls[wgrads] and calls[wgrads] % 3 == 0 and calls["rows"] > 2 * calls[wgrads], calls
    assert calls[unused] == 0, calls


def test_training_gemm_bench_times_every_path_of_each_expert_gemm(capsys, monkeypatch):
    """python benchmarks/quantized_experts.py --training-gemms: each expert GEMM (gate-up [R, D] x [E, D, 2H],
    down [R, H] x [E, H, D]) on bf16 and both FP8 recipes (weight gradient in bf16 or FP8), its
    forward and both backward GEMMs counted (3 x 2 R K N); torchao's column appears only where
    torchao imports."""
    from benchmarks import quantized_experts

    monkeypatch.setitem(sys.modules, "torchao", None)  # as where it is not installed
    peer, why = quantized_experts.torchao_fp8_grouped_mm()
    assert peer is None and why.startswith("torchao not available (ModuleNotFoundError")
    rows = quantized_experts.training_gemm_rows("tiny", 100, 32, 16, 3, torch.device("cpu"), iters=1)
    assert [(row["gemm"], row["path"]) for row in rows] == [
        (gemm, path) for gemm in ("gate-up", "down")
        for path in ("bf16", "moetrain fp8", "moetrain fp8, fp8 wgrad", "moetrain fp8_block",
                     "moetrain fp8_block, fp8 wgrad")]
    flops = {"gate-up": 3 * 2 * 96 * 32 * 32, "down": 3 * 2 * 96 * 16 * 32}  # 32 rows an expert, 96 in all
    for row in rows:
        assert row["shape"] == "tiny" and row["tflops"] == pytest.approx(flops[row["gemm"]] / (row["ms"] * 1e-3) / 1e12)
    with pytest.raises(SystemExit) as exit_info:
        quantized_experts.main(["--training-gemms", "--device", "cpu"])
    assert exit_info.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err


def test_training_quantizer_bench_times_each_quantizer(capsys):
    """python benchmarks/quantized_experts.py --training-quantizers: every quantizer of both recipes timed,
    and the FP8 rows' gather, with the bytes each must move (rows: read 2 + write 1 per bf16 value; the
    column and tile quantizers read twice; the weights' forward layout reads twice) over its time."""
    from benchmarks import quantized_experts

    rows = quantized_experts.training_quantizer_rows("tiny", 96, 32, 16, 3, torch.device("cpu"), iters=1)
    names = [row["quantizer"] for row in rows]
    assert names == ["rows of x", "rows of dy", "expert columns of x", "expert columns of dy", "weight, forward",
                     "weight, dgrad", "bf16 gate-up weight, forward", "bf16 gate-up weight, dgrad",
                     "bf16 down weight, forward", "bf16 down weight, dgrad", "gather of FP8 token rows",
                     "the same with the scales", "weight blocks, forward", "weight blocks, dgrad", "1x128 tiles of x",
                     "128x1 tiles of x", "copy of x (scale)"]
    moved = {"rows of x": 96 * 32 * 3, "expert columns of dy": 96 * 32 * 5, "weight, forward": 3 * 32 * 32 * 9,
             # bf16 weights: the forward's transposing layout reads twice (2 + 2 + 1), dgrad's once (2 + 1)
             "bf16 down weight, forward": 3 * 16 * 32 * 5, "bf16 gate-up weight, dgrad": 3 * 32 * 32 * 3,
             # 48 tokens' E4M3 rows read, their 96 top-2 copies written
             "gather of FP8 token rows": 48 * 32 + 96 * 32, "the same with the scales": 48 * 36 + 96 * 36}
    for row in rows:
        assert row["ms"] > 0 and row["shape"] == "tiny" and row["timed"] == "call by call"  # no graphs off CUDA
        if row["quantizer"] in moved:
            assert row["gb_per_s"] == pytest.approx(moved[row["quantizer"]] / row["ms"] / 1e6)
    with pytest.raises(SystemExit) as exit_info:
        quantized_experts.main(["--training-quantizers", "--device", "cpu"])
    assert exit_info.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err


def test_the_config_names_the_same_fp8_settings_as_the_layer():
    """The config schema (a leaf: it imports no moetrain module) spells the FP8 settings again for
    the command line; moetrain.precision.recipes owns them, and the two lists must stay one."""
    from moetrain.config import FP8Wgrad, Precision
    from moetrain.precision.recipes import FP8_PRECISIONS, FP8_WGRADS

    assert tuple(member.value for member in FP8Wgrad) == FP8_WGRADS
    assert [member.value for member in Precision if member.value.startswith("fp8")] == list(FP8_PRECISIONS)
