"""FP8 training of the expert GEMMs (moetrain.quant.training, MoELayer(precision="fp8")).

Each quantization is checked bit for bit against moetrain.quant.formats (the E4M3 codec and scale
written from the format definition); each of the three GEMMs of a step (forward, dgrad, wgrad)
against an fp32 GEMM of the dequantized operands, which it equals up to the order of the fp32
accumulation and the final bfloat16 rounding; and the layer's gradients against the same layer in
full precision within the bound E4M3's 3-bit mantissa allows. On a GPU the CUDA path (Triton
quantization, torch._scaled_grouped_mm) is checked against the same references.
"""

import pytest
import torch

from moetrain import MoELayer
from moetrain.quant import training
from moetrain.quant.formats import FORMATS, dequantize_fp8_groups, quantize_fp8_groups

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="no sm90 GPU")])
DEVICES = ["cpu", CUDA]
BF16_ULP = 2.0**-7  # a bfloat16 rounding of the output: at most half of this, relative


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
    padded = int(training.padded_ends(counts_E)[-1]) + (16 if device == "cuda" else 0)  # CUDA: any bound works
    q_CP, scale_EC = training.quantize_columns(x, counts_E, padded)
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
        pad = -(-count // training.ALIGN) * training.ALIGN
        assert not q_CP[:, padded_start + count:padded_start + pad].float().any(), "padding columns must be zero"
        start += count
        padded_start += pad


@pytest.mark.parametrize("device", DEVICES)
def test_row_and_weight_quantization_are_the_formats(device):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(50, 96, generator=g) * 10).to(device, torch.bfloat16)
    q, scale = training.quantize_rows(x)
    want_q, want_scale = quantize_fp8_groups(x.cpu().float(), 96)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale.cpu(), want_scale.view(-1))
    w = torch.randn(3, 32, 48, generator=g).to(device)
    fmt = FORMATS["fp8"]
    q_ENK, scale_EN = training.quantize_weight(w, over=1)
    q_EKN, scale_EK = training.quantize_weight(w, over=2)
    for e in range(3):
        forward = fmt.quantize(w[e].cpu().t())
        assert torch.equal(q_ENK[e].cpu().view(torch.uint8), forward["data"].view(torch.uint8))
        assert torch.equal(scale_EN[e].cpu(), forward["scale"])
        dgrad = fmt.quantize(w[e].cpu())
        assert torch.equal(q_EKN[e].cpu().view(torch.uint8), dgrad["data"].view(torch.uint8))
        assert torch.equal(scale_EK[e].cpu(), dgrad["scale"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,k,n,experts,padding", [(64, 32, 48, 4, 0), (517, 128, 80, 6, 11), (9, 16, 16, 3, 0)])
def test_three_gemms_are_fp32_gemms_of_the_dequantized_operands(device, rows, k, n, experts, padding):
    g = torch.Generator().manual_seed(rows)
    counts = _counts(rows, experts, g, empty=1)
    x = torch.randn(rows + padding, k, generator=g)
    x[rows:] = 0  # the packed layout's padding rows
    x = x.to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(experts, k, n, generator=g) / k**0.5).to(device).requires_grad_()
    y = training.fp8_expert_matmul(x, w, torch.tensor(counts, device=device), None)
    assert y.shape == (rows + padding, n) and y.dtype == torch.bfloat16
    all_counts = counts[:-1] + [counts[-1] + padding]
    want_y = _per_expert(_dequantized_rows(x.detach()), _dequantized_weight(w.detach(), over=1), all_counts)
    assert _rel(y[:rows], want_y[:rows]) < BF16_ULP
    dy = torch.randn(rows + padding, n, generator=g).to(device, torch.bfloat16)
    y.backward(dy)
    want_dx = _per_expert(_dequantized_rows(dy), _dequantized_weight(w.detach(), over=2).transpose(1, 2), all_counts)
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert _rel(x.grad, want_dx) < BF16_ULP
    xs, dys = _dequantized_columns(x.detach(), all_counts), _dequantized_columns(dy, all_counts)
    want_dw = torch.stack([a.t() @ b for a, b in zip(torch.split(xs, all_counts), torch.split(dys, all_counts))])
    for e, count in enumerate(all_counts):
        if count:
            assert _rel(w.grad[e], want_dw[e]) < BF16_ULP, f"expert {e}"
        else:
            assert not w.grad[e].any()


def _layer_pair(device, expert, capacity_factor, seed):
    torch.manual_seed(seed)
    # GELU, not ReLU, for the FFN: where ReLU's input is within rounding of 0 its derivative flips
    # between 0 and 1, and those few flips (in any precision) would dominate the comparison.
    kwargs = dict(model_dim=64, num_experts=4, hidden_size=96, top_k=2, expert=expert, capacity_factor=capacity_factor,
                  activation="gelu" if expert == "ffn" else "silu", gate_kwargs={"normalize": True} if expert == "swiglu" else None)
    full = MoELayer(**kwargs).to(device)
    fp8 = MoELayer(**kwargs, precision="fp8").to(device)
    fp8.load_state_dict(full.state_dict())
    return full, fp8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("expert,capacity_factor", [("swiglu", 0.0), ("ffn", 0.0), ("ffn", 1.25)])
def test_layer_gradients_stay_within_the_fp8_bound_of_full_precision(device, expert, capacity_factor):
    """Same weights, same routing (the gate is not quantized): outputs and every gradient within
    10% relative. E4M3 rounds each operand by up to 2^-4 relative (about 2.5% rms), one GEMM of two
    quantized operands is off by about 3.5%, and a gradient here passes through two such GEMMs."""
    full, fp8 = _layer_pair(device, expert, capacity_factor, seed=5)
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
def test_empty_batch_and_empty_experts(device):
    full, fp8 = _layer_pair(device, "swiglu", 0.0, seed=1)
    x = torch.randn(0, 64, device=device, requires_grad=True)
    y = fp8(x)
    y.sum().backward()
    assert y.shape == (0, 64) and not fp8.experts.w_down.grad.any()
    w = torch.randn(3, 16, 16, device=device, requires_grad=True)
    y = training.fp8_expert_matmul(torch.randn(0, 16, device=device, dtype=torch.bfloat16), w,
                                   torch.zeros(3, dtype=torch.long, device=device), None)
    y.sum().backward()
    assert y.shape == (0, 16) and torch.equal(w.grad, torch.zeros_like(w))


def test_precision_is_checked_and_settable():
    with pytest.raises(ValueError, match="precision must be one of"):
        MoELayer(16, 2, 16, precision="fp16")
    layer = MoELayer(16, 2, 16)
    assert layer.precision == "bf16"
    layer.precision = "fp8"
    assert layer.experts.precision == "fp8" and "precision='fp8'" in repr(layer)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="no sm90 GPU")
def test_fp8_layer_compiles_to_one_graph_with_the_eager_result():
    _, fp8 = _layer_pair("cuda", "swiglu", 0.0, seed=2)
    fp8.to(torch.bfloat16)
    fp8.gate.float()
    x = torch.randn(2, 300, 64, device="cuda", dtype=torch.bfloat16)
    eager = fp8(x)
    compiled = torch.compile(fp8, fullgraph=True)(x)
    assert _rel(compiled.float(), eager.float()) < BF16_ULP


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
