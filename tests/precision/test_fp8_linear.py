"""FP8 training of dense linear layers (moetrain.precision.fp8_linear), against a reference written
here from the recipe's definition: each row of each GEMM operand scaled by its largest magnitude
onto E4M3's 448, rounded by torch's E4M3 cast, multiplied in float64, rounded to bf16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moetrain.precision.fp8_linear import FP8Linear, fp8_linear, use_fp8_linears

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="no sm90 GPU")])]
E4M3_MAX = 448.0


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _row_quantized(a: torch.Tensor) -> torch.Tensor:
    """a's rows as the recipe rounds them, in float64: a row at a time, its scale amax / 448."""
    rows = []
    for row in a.double().cpu():
        scale = row.abs().max() / E4M3_MAX if row.abs().max() > 0 else torch.tensor(1.0, dtype=torch.float64)
        rows.append((row / scale).float().to(torch.float8_e4m3fn).double() * scale)
    return torch.stack(rows)


def _reference(x_MK, w_NK, dy_MN, fp8_dgrad=True):
    """(y, dx, dw): y and dx from row-quantized operands (dx from the bf16 ones without fp8_dgrad),
    dw = dy^T x of the bf16 operands."""
    y = (_row_quantized(x_MK) @ _row_quantized(w_NK).t()).to(torch.bfloat16)
    if fp8_dgrad:
        dx = (_row_quantized(dy_MN) @ _row_quantized(w_NK.t()).t()).to(torch.bfloat16)
    else:
        dx = (dy_MN.cpu().double() @ w_NK.cpu().double()).to(torch.bfloat16)
    dw = (dy_MN.cpu().double().t() @ x_MK.cpu().double()).to(torch.bfloat16)
    return y, dx, dw


def _run(function, x_MK, w_NK, dy_MN):
    x, w = x_MK.clone().requires_grad_(), w_NK.clone().requires_grad_()
    y = function(x, w)
    y.backward(dy_MN)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 37, 256])
@pytest.mark.parametrize("fp8_dgrad", [True, False])
def test_the_gemms_are_the_recipe_on_row_quantized_operands(device, rows, fp8_dgrad):
    """Forward and dgrad multiply row-quantized operands (dgrad's second operand quantized per
    column of w), the weight gradient is the bf16 GEMM: within one bf16 rounding of the float64
    reference, which only the order of the fp32 sums can move (rows of any count: the GPU pads
    them to 16)."""
    torch.manual_seed(rows)
    k, n = 96, 64
    x = (torch.randn(rows, k, device=device) * torch.rand(rows, 1, device=device) * 4).to(torch.bfloat16)
    w = (torch.randn(n, k, device=device) / k**0.5).to(torch.bfloat16)
    w[3] *= 20  # an outlier row: its scale is its own
    dy = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
    got = _run(lambda a, b: fp8_linear(a, b, fp8_dgrad=fp8_dgrad), x, w, dy)
    for name, g, want in zip(("y", "dx", "dw"), got, _reference(x, w, dy, fp8_dgrad)):
        assert g.dtype == torch.bfloat16 and torch.isfinite(g).all(), name
        assert _rel(g, want) < 2**-7, name


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_stays_within_its_rounding_of_the_full_precision_linear(device):
    """Against F.linear in float64: E4M3 rounds each operand by up to 2^-4 relative (about 2.5 %
    rms), so a GEMM of two such operands is off by about 3.5 %; never more than 6 %."""
    torch.manual_seed(1)
    x = torch.randn(128, 256, device=device, dtype=torch.bfloat16)
    w = (torch.randn(192, 256, device=device) / 16).to(torch.bfloat16)
    dy = torch.randn(128, 192, device=device, dtype=torch.bfloat16)
    y, dx, dw = _run(fp8_linear, x, w, dy)
    full = _run(lambda a, b: a @ b.t(), x.double(), w.double(), dy.double())
    assert 1e-3 < _rel(y, full[0]) < 0.06 and 1e-3 < _rel(dx, full[1]) < 0.06
    assert _rel(dw, full[2]) < 2**-7  # the weight gradient is a bf16 GEMM


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_bias_and_batch_dims_as_nn_linear(device):
    """Under bf16 autocast an fp32 FP8Linear computes in bf16 as nn.Linear would, adds its bias, keeps
    the leading dims, and gives the fp32 parameters fp32 gradients."""
    torch.manual_seed(2)
    linear = nn.Linear(64, 48).to(device)
    fp8 = FP8Linear.from_linear(linear)
    x = torch.randn(2, 5, 64, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = fp8(x)
        want = linear(x)
    assert y.shape == (2, 5, 48) and y.dtype == torch.bfloat16
    assert 1e-3 < _rel(y, want) < 0.06
    y.float().sum().backward()
    assert linear.weight.grad.dtype == torch.float32 and linear.bias.grad.dtype == torch.float32
    assert torch.allclose(linear.bias.grad, torch.full_like(linear.bias, 10.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_norm", [False, True])
def test_compiled_fp8_linear_has_the_eager_result_and_gradients(device, with_norm):
    """Compiled in one graph, the same GEMMs on the same E4M3 operands as eager: output and gradients
    within the reordering of fp32 sums. After a norm, the compiled kernel quantizes the norm's fp32
    result where eager first rounds it to bf16 (inductor skips intermediate roundings), which moves
    some E4M3 roundings: then within FP8's own error (a lost or misrouted gradient is 1 apart)."""
    torch.manual_seed(3)
    norm = nn.RMSNorm(128).to(device, torch.bfloat16) if with_norm else nn.Identity()
    fp8 = FP8Linear.from_linear(nn.Linear(128, 96, bias=False).to(device, torch.bfloat16))

    def step(x):
        return fp8(norm(x)).float().square().sum()

    torch._dynamo.reset()
    x = torch.randn(64, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    results = []
    for run in (step, torch.compile(step, fullgraph=True)):
        x.grad = fp8.weight.grad = None
        loss = run(x)
        loss.backward()
        results.append((loss.detach(), x.grad.float(), fp8.weight.grad.float()))
    (loss, dx, dw), (compiled_loss, compiled_dx, compiled_dw) = results
    assert dx.norm() > 0 and dw.norm() > 0
    bound = 0.06 if with_norm else 2**-7
    assert _rel(compiled_loss, loss) < bound / 4
    assert _rel(compiled_dx, dx) < bound and _rel(compiled_dw, dw) < bound


def test_use_fp8_linears_keeps_parameters_and_names():
    """Every fitting nn.Linear below the module becomes an FP8Linear holding the same Parameter
    objects: the state_dict's keys and the optimizer's entries stay; a shape the FP8 GEMMs cannot
    take (not a multiple of 16) and other modules stay as they were."""
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 48, bias=False), nn.Linear(48, 10)))
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    assert use_fp8_linears(model) == ["0", "2.0"]
    assert type(model[0]) is FP8Linear and type(model[2][0]) is FP8Linear and type(model[2][1]) is nn.Linear
    assert dict(model.named_parameters()) == before and all(before[k] is p for k, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    assert model(torch.randn(3, 32)).shape == (3, 10)


@pytest.mark.parametrize("precision, fp8_linears", [("fp8", True), ("fp8", False), ("fp8_block", False)])
def test_trainer_fp8_linears_puts_the_blocks_dense_linears_in_fp8(precision, fp8_linears, tmp_path, monkeypatch):
    """trainer.fp8_linears with precision fp8 on a language model: every block's attention
    projections are FP8Linear and run the FP8 GEMMs in training, the LM head and the embedding do
    not. Without it (fp8 or fp8_block) the dense linears stay as they are: only the experts are FP8."""
    from moetrain.config import Device, LoggerConfig, OptimConfig, Precision, TrainerConfig
    from moetrain.data.text import synthetic_lm
    from moetrain.models import build_lm
    from moetrain.precision import fp8_linear as module
    from moetrain.train import Trainer, seed_everything

    calls = []
    monkeypatch.setattr(module, "_scaled_matmul",
                        lambda a, scale, b, _gemm=module._scaled_matmul: calls.append(a.shape) or _gemm(a, scale, b))
    seed_everything(0)
    model = build_lm("qwen3_moe_tiny", vocab_size=64, dim=32, depth=2, max_seq_len=16)
    data = synthetic_lm(vocab_size=64, seq_len=16, train_size=64, eval_size=8, batch_size=4, eval_batch_size=4)
    trainer = Trainer(model, data, trainer=TrainerConfig(max_steps=2, eval_every=0, eval_batches=1, checkpoint_every=0,
                                                         progress_bar=False, device=Device.cpu,
                                                         precision=Precision(precision), fp8_linears=fp8_linears),
                      optim=OptimConfig(lr=3e-3, warmup_steps=1), logger=LoggerConfig(tensorboard=False, log_every=1),
                      run_dir=tmp_path, seed=0, run_config={"model": {"name": "tiny"}, "trainer": {"max_steps": 2}})
    want = FP8Linear if fp8_linears else nn.Linear
    projections = [m for name, m in model.named_modules() if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))]
    assert len(projections) == 8 and all(type(m) is want for m in projections)
    assert type(model.lm_head) is nn.Linear and type(model.embed) is nn.Embedding
    metrics = trainer.fit()
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    # each training step: 8 projections forward and the 2 o_proj input gradients in FP8 (q, k and v's
    # input gradients are bf16 GEMMs), plus the evaluation's forwards
    assert len(calls) >= (2 * 10 if fp8_linears else 0) and fp8_linears == bool(calls)
    if fp8_linears:
        named = dict(model.named_modules())
        assert all(named[n].fp8_dgrad == n.endswith("o_proj") for n in named if n.endswith("_proj"))


@pytest.mark.parametrize("precision", ["bf16", "fp8_block"])
def test_fp8_linears_without_row_wise_fp8_is_refused(precision):
    """The library refuses fp8_linears with any precision but fp8 and changes nothing on the way."""
    from moetrain.models import build_lm
    from moetrain.moe import set_training_precision

    model = build_lm("qwen3_moe_tiny", vocab_size=64, dim=32, depth=2, max_seq_len=16)
    with pytest.raises(ValueError, match=f"fp8_linears applies only with precision 'fp8'.*not '{precision}'"):
        set_training_precision(model, precision, fp8_linears=True)
    assert not any(isinstance(m, FP8Linear) for m in model.modules())


def test_fp8_linears_names_what_it_converted_and_refuses_a_model_with_nothing_to_convert():
    """The block linears whose features are multiples of 16 are converted and named; a model with
    none is refused (not trained as if fp8_linears were on), and the head stays as it was."""
    from moetrain.models import build_lm
    from moetrain.moe import set_training_precision

    model = build_lm("qwen3_moe_tiny", vocab_size=64, dim=32, depth=2, max_seq_len=16)
    names = set_training_precision(model, "fp8", fp8_linears=True)
    assert names == [name for name, m in model.named_modules() if isinstance(m, FP8Linear)]
    assert sorted(names) == sorted(f"blocks.{b}.attn.{p}_proj" for b in range(2) for p in "qkvo")
    assert set_training_precision(build_lm("qwen3_moe_tiny", vocab_size=64, dim=32, depth=1), "fp8") == []
    odd = build_lm("qwen3_moe_tiny", vocab_size=64, dim=40, depth=1, max_seq_len=16)
    with pytest.raises(ValueError, match="no dense linear whose input and output features are multiples of 16"):
        set_training_precision(odd, "fp8", fp8_linears=True)
    assert not any(isinstance(m, FP8Linear) for m in odd.modules())
