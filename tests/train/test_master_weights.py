"""bf16 parameters with fp32 master weights (trainer.param_dtype=bfloat16): the optimizer against
torch's AdamW on fp32 parameters, its state across a checkpoint, the kernel against its reference,
and the trainer's casting."""

from __future__ import annotations

import io
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetrain.config import OptimConfig, OptimizerName
from moetrain.models import build_lm
from moetrain.moe import moe_layers, set_parameter_dtype
from moetrain.ops import adamw
from moetrain.train.optim import MasterWeightAdamW, build_optimizer, step_with_device_flags, takes_device_flags



def _pairs(seed: int, shapes=((33, 17), (5,), (4, 8, 3))):
    """bf16 parameters and fp32 copies of exactly their values."""
    generator = torch.Generator().manual_seed(seed)
    low = [torch.nn.Parameter(torch.randn(s, generator=generator).bfloat16()) for s in shapes]
    high = [torch.nn.Parameter(p.detach().float().clone()) for p in low]
    return low, high


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_masters_follow_torch_adamw_on_fp32_parameters(weight_decay):
    low, high = _pairs(0)
    ours = MasterWeightAdamW(low, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    torchs = torch.optim.AdamW(high, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, foreach=False)
    generator = torch.Generator().manual_seed(1)
    for _ in range(6):
        for p, q in zip(low, high):
            grad = torch.randn(p.shape, generator=generator).bfloat16()
            p.grad, q.grad = grad, grad.float()  # the same gradient, as bf16 backward would give it
        ours.step()
        torchs.step()
    for p, q in zip(low, high):
        master = ours.state[p]["master"]
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, q.detach(), rtol=2e-6, atol=1e-7)
        assert torch.equal(p.detach(), master.bfloat16())  # the parameter is its master rounded
        assert not torch.equal(master, master.bfloat16().float())  # the master keeps what bf16 rounds away


def test_fp32_parameters_are_their_own_masters():
    router = torch.nn.Parameter(torch.randn(8, 16))
    reference = torch.nn.Parameter(router.detach().clone())
    ours, torchs = MasterWeightAdamW([router], lr=1e-2), torch.optim.AdamW([reference], lr=1e-2, foreach=False)
    for _ in range(3):
        grad = torch.randn(8, 16)
        router.grad, reference.grad = grad, grad.clone()
        ours.step()
        torchs.step()
    assert "master" not in ours.state[router]
    torch.testing.assert_close(router.detach(), reference.detach(), rtol=2e-6, atol=1e-7)


def test_device_flags_follow_torch_fused_adamw():
    """grad_scale and found_inf as torch's fused AdamW reads them (GradScaler's protocol): gradients
    divided by the scale, a flagged step leaves everything as it was and is not counted, also when
    it is the first; the counts are right in state_dict() before the next step."""
    low, high = _pairs(5)
    ours = MasterWeightAdamW(low, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    torchs = torch.optim.AdamW(high, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    generator = torch.Generator().manual_seed(6)
    skipped_at = {0, 3}
    for step in range(6):
        for p, q in zip(low, high):
            grad = torch.randn(p.shape, generator=generator).bfloat16()
            p.grad, q.grad = grad, grad.float()
        found_inf = torch.tensor(float(step in skipped_at))
        grad_scale = 1 + 3 * torch.rand((), generator=generator)  # a clipping factor's inverse
        before = [p.detach().clone() for p in low]
        step_with_device_flags(ours, found_inf.bool(), 1 / grad_scale)
        torchs.grad_scale, torchs.found_inf = grad_scale, found_inf
        torchs.step()
        if step in skipped_at:
            assert all(torch.equal(b, p) for b, p in zip(before, low))
        assert not hasattr(ours, "found_inf") and not hasattr(ours, "grad_scale")
        saved = ours.state_dict()["state"]
        assert [float(saved[i]["step"]) for i in range(len(low))] == [float(torchs.state[q]["step"]) for q in high]
    assert float(torchs.state[high[0]]["step"]) == 4
    for p, q in zip(low, high):
        torch.testing.assert_close(ours.state[p]["master"], q.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.state[p]["exp_avg_sq"], torchs.state[q]["exp_avg_sq"], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_bf16_moments_follow_torch_adamw_with_its_moments_rounded(weight_decay):
    """moment_dtype=bfloat16: the moments updated in fp32 and stored rounded to nearest bf16, against
    torch's AdamW on fp32 copies whose moments are rounded to bf16 after each of its steps; they are
    stored (and checkpointed) as bf16, and a checkpoint's fp32 moments load as bf16."""
    low, high = _pairs(7)
    ours = MasterWeightAdamW(low, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay,
                             moment_dtype=torch.bfloat16)
    torchs = torch.optim.AdamW(high, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, foreach=False)
    generator = torch.Generator().manual_seed(8)
    for _ in range(6):
        for p, q in zip(low, high):
            grad = torch.randn(p.shape, generator=generator).bfloat16()
            p.grad, q.grad = grad, grad.float()
        ours.step()
        torchs.step()
        for q in high:
            for key in ("exp_avg", "exp_avg_sq"):
                torchs.state[q][key].copy_(torchs.state[q][key].bfloat16())
    for p, q in zip(low, high):
        state = ours.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[key], torchs.state[q][key].bfloat16(), rtol=2**-7, atol=1e-6)
        torch.testing.assert_close(state["master"], q.detach(), rtol=1e-5, atol=1e-6)
    buffer = io.BytesIO()
    torch.save(ours.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert saved["state"][0]["exp_avg"].dtype == torch.bfloat16 and saved["state"][0]["master"].dtype == torch.float32
    fp32_moments = MasterWeightAdamW(low, lr=3e-3)
    fp32_moments.load_state_dict(saved)
    assert fp32_moments.state[low[0]]["exp_avg"].dtype == torch.float32  # each optimizer keeps its own dtype
    ours.load_state_dict(fp32_moments.state_dict())
    assert ours.state[low[0]]["exp_avg"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="moment_dtype must be one of"):
        MasterWeightAdamW(low, moment_dtype=torch.float16)


def test_takes_device_flags_names_the_optimizers_that_read_them():
    params = [torch.nn.Parameter(torch.randn(3))]
    assert takes_device_flags(MasterWeightAdamW(params))
    assert takes_device_flags(torch.optim.AdamW(params, fused=True))
    assert not takes_device_flags(torch.optim.AdamW(params))
    assert not takes_device_flags(torch.optim.SGD(params, lr=0.1))


def test_state_survives_a_checkpoint_bit_for_bit():
    low, _ = _pairs(2)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in low]
    first, second = MasterWeightAdamW(low, lr=1e-2, weight_decay=0.1), MasterWeightAdamW(copies, lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(3)
    grads = [[torch.randn(p.shape, generator=generator).bfloat16() for p in low] for _ in range(5)]
    for step in range(3):
        for p, g in zip(low, grads[step]):
            p.grad = g
        first.step()
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    for p, q in zip(copies, low):
        p.data.copy_(q.detach())
    second.load_state_dict(torch.load(buffer, weights_only=True))
    assert all(second.state[p]["master"].dtype == torch.float32 for p in copies)  # not cast to bf16 on load
    for step in range(3, 5):
        for optimizer, params in ((first, low), (second, copies)):
            for p, g in zip(params, grads[step]):
                p.grad = g
            optimizer.step()
    for p, q in zip(low, copies):
        assert torch.equal(p.detach(), q.detach())
        assert torch.equal(first.state[p]["master"], second.state[q]["master"])


FLAGS = {"none": (None, None), "scaled": (2.75, None), "kept": (None, 0.0), "skipped": (1.5, 1.0)}


def kernel_checks(device: str, dtypes=(torch.bfloat16, torch.float16, torch.float32), sizes=(1, 2047, 2048, 100_003)):
    """The Triton kernel against the reference on fresh random tensors, with and without the device
    flags (grad_scale, found_inf), with fp32 and bf16 moments; on the CPU under TRITON_INTERPRET=1
    (the test below, which tells kernel_runs that the kernel runs on CPU tensors there)."""
    generator = torch.Generator().manual_seed(4)
    for dtype, moments, elements in itertools.product(dtypes, adamw.MOMENT_DTYPES, sizes):
        for scale, found in FLAGS.values():
            param = torch.randn(elements, generator=generator).to(device, dtype)
            master = param.float().clone() if dtype != torch.float32 else param
            grad = torch.randn(elements, generator=generator).to(device, dtype)
            exp_avg, exp_avg_sq = torch.randn(elements, generator=generator), torch.rand(elements, generator=generator)
            exp_avg, exp_avg_sq = exp_avg.to(device, moments), exp_avg_sq.to(device, moments)
            state = [t.clone() for t in (param, master, exp_avg, exp_avg_sq)]
            if dtype == torch.float32:
                state[1] = state[0]
            if dtype != torch.float32 and not found:
                param.fill_(float("nan"))  # every element must be written
            flags = [None if v is None else torch.tensor(v, device=device) for v in (scale, found)]
            untouched = [t.clone() for t in (param, master, exp_avg, exp_avg_sq)]
            assert adamw.kernel_runs(param, grad, master)  # the kernel, not the reference, is what runs
            adamw.adamw_master_step_(param, grad, master, exp_avg, exp_avg_sq, 7, 1e-3, 0.9, 0.95, 1e-8, 0.1, *flags)
            adamw.reference(*state[:1], grad, *state[1:], 7, 1e-3, 0.9, 0.95, 1e-8, 0.1, *flags)
            if found:  # nothing written
                assert all(torch.equal(a, b) for a, b in zip((param, master, exp_avg, exp_avg_sq), untouched))
                assert all(torch.equal(a, b) for a, b in zip(state, untouched))
                continue
            # an fp32 ulp or two apart (the kernel's fused multiply-adds against torch's ops)
            torch.testing.assert_close(master, state[1], rtol=1e-5, atol=1e-6)
            for ours, theirs in zip((exp_avg, exp_avg_sq), state[2:]):
                assert ours.dtype == moments
                # bf16 moments: an ulp of fp32 arithmetic (near a cancellation, more) may round them either way
                torch.testing.assert_close(ours, theirs, **(dict(rtol=1e-5, atol=1e-6) if moments == torch.float32
                                                            else dict(rtol=2**-7, atol=1e-6)))
            if param.is_cuda or dtype != torch.bfloat16:
                assert torch.equal(param, master.to(dtype))  # the parameter is its master rounded, every element
            else:  # Triton's interpreter rounds fp32 to bf16 its own way: within one bf16 step
                torch.testing.assert_close(param, master.to(dtype), rtol=2**-7, atol=0)
    stochastic_kernel_checks(device, sizes)


def stochastic_kernel_checks(device: str, sizes) -> None:
    """A bf16 parameter that is its own master (rounding_seed): the kernel writes, at every element, one
    of the two bf16 neighbours of the reference's fp32 update, the upper one as often as the fraction of
    the spacing says (the mean over many elements), the same bits for the same seed, others for
    another, and nothing on a skipped step."""
    generator = torch.Generator().manual_seed(17)
    for moments, elements in itertools.product(adamw.MOMENT_DTYPES, sizes):
        for scale, found in FLAGS.values():
            param = torch.randn(elements, generator=generator).to(device, torch.bfloat16)
            grad = torch.randn(elements, generator=generator).to(device, torch.bfloat16)
            exp_avg = torch.randn(elements, generator=generator).to(device, moments)
            exp_avg_sq = torch.rand(elements, generator=generator).to(device, moments)
            flags = [None if v is None else torch.tensor(v, device=device) for v in (scale, found)]
            same_bits = param.clone()  # the torch path: the same hash, the same bits
            adamw.reference_stochastic(same_bits, grad, exp_avg.clone(), exp_avg_sq.clone(), 7, 1e-3, 0.9, 0.95,
                                       1e-8, 0.1, 21, *flags)
            expected = param.float()
            reference_moments = (exp_avg.clone(), exp_avg_sq.clone())
            adamw.reference(expected, grad, expected, *reference_moments, 7, 1e-3, 0.9, 0.95, 1e-8, 0.1, *flags)
            untouched = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
            results = []
            for seed in (21, 21, 22):
                for t, u in zip((param, exp_avg, exp_avg_sq), untouched):
                    t.copy_(u)
                assert adamw.kernel_runs(param, grad, param, stochastic=True)
                adamw.adamw_master_step_(param, grad, param, exp_avg, exp_avg_sq, 7, 1e-3, 0.9, 0.95, 1e-8, 0.1,
                                         *flags, rounding_seed=seed)
                results.append(param.clone())
            if found:
                assert all(torch.equal(r, untouched[0]) for r in results)
                continue
            for ours, theirs in zip((exp_avg, exp_avg_sq), reference_moments):
                torch.testing.assert_close(ours, theirs, **(dict(rtol=1e-5, atol=1e-6) if moments == torch.float32
                                                            else dict(rtol=2**-7, atol=1e-6)))
            got, expected = results[0].cpu().double(), expected.cpu()
            lower, upper = _bf16_neighbours(expected)
            # the kernel's fused multiply-adds may put its fp32 result an ulp from the reference's
            assert _a_bf16_neighbour(got, expected).all()
            assert torch.equal(results[0], results[1])
            # bit for bit the torch path's, but where an fp32 ulp between the two updates changes a carry
            assert (results[0] == same_bits).double().mean() > 0.999
            assert elements < 100 or not torch.equal(results[0], results[2])  # (one element: a coin toss)
            if elements > 50_000:  # unbiased: the rounding error over the spacing averages to 0 (sd 0.002 here)
                inexact = lower != upper  # (in magnitude: a bias toward zero cancels over signs in the values)
                error = (got.abs() - expected.double().abs())[inexact] / (upper - lower)[inexact].abs()
                assert abs(error.mean().item()) < 0.01, error.mean().item()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_matches_reference():
    kernel_checks("cuda")


def test_kernel_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    command = ("import sys; sys.path.insert(0, 'tests/train'); import test_master_weights as t; "
               "t.adamw.kernel_runs = lambda param, grad, master, stochastic=False: True; "
               "t.kernel_checks('cpu', sizes=(1, 2047, 4100)); t.stochastic_kernel_checks('cpu', (60_000,)); print('ok')")
    result = subprocess.run([sys.executable, "-c", command], cwd=Path(__file__).parents[2],
                            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout[-2000:] + result.stderr[-4000:]


def test_parameter_dtype_keeps_routers_and_buffers_fp32():
    model = build_lm("qwen3_moe_tiny")
    routers = {id(p) for layer in moe_layers(model) for p in layer.gate.parameters()}
    buffers = {name: b.dtype for name, b in model.named_buffers()}
    set_parameter_dtype(model, torch.bfloat16)
    for p in model.parameters():
        assert p.dtype == (torch.float32 if id(p) in routers else torch.bfloat16)
    assert routers and {name: b.dtype for name, b in model.named_buffers()} == buffers
    optimizer = build_optimizer(model, OptimConfig())
    assert isinstance(optimizer, MasterWeightAdamW)
    with pytest.raises(ValueError, match="needs fp32 parameters"):
        build_optimizer(model, OptimConfig(name=OptimizerName.sgd))
    from moetrain.config import ParamDtype

    with pytest.raises(ValueError, match="moment_dtype='bfloat16' keeps the moments of the master-weight AdamW"):
        build_optimizer(build_lm("qwen3_moe_tiny"), OptimConfig(moment_dtype=ParamDtype.bfloat16))


def _tiny_lm_trainer(run_dir, moment_dtype="float32", master_weights=True, **trainer_settings):
    from moetrain.config import LoggerConfig, ParamDtype, TrainerConfig
    from moetrain.data.text import synthetic_lm
    from moetrain.train import Trainer, seed_everything

    seed_everything(0)
    model = build_lm("qwen3_moe_tiny", vocab_size=64, dim=32, depth=2, max_seq_len=16)
    data = synthetic_lm(vocab_size=64, seq_len=16, train_size=64, eval_size=8, batch_size=4, eval_batch_size=4)
    settings = dict(max_steps=6, eval_every=0, eval_batches=1, checkpoint_every=3, keep_checkpoints=0,
                    progress_bar=False, param_dtype="bfloat16")
    settings.update(trainer_settings)
    optim = OptimConfig(lr=3e-3, warmup_steps=1, moment_dtype=ParamDtype(moment_dtype), master_weights=master_weights)
    return Trainer(model, data, trainer=TrainerConfig(**settings), optim=optim,
                   logger=LoggerConfig(tensorboard=False, log_every=1), run_dir=run_dir, seed=0,
                   run_config={"model": {"name": "tiny"}, "trainer": {"max_steps": settings["max_steps"]}})


@pytest.mark.parametrize("moments, masters", [("float32", True), ("bfloat16", True), ("bfloat16", False)])
def test_the_trainer_trains_bf16_parameters_and_resumes_them_exactly(tmp_path, moments, masters):
    from moetrain.config import ParamDtype

    straight = _tiny_lm_trainer(tmp_path / "straight", param_dtype=ParamDtype.bfloat16, moment_dtype=moments,
                                master_weights=masters)
    assert straight.optimizer.moment_dtype == getattr(torch, moments)
    assert straight.optimizer.master_weights is masters
    routers = {id(p) for layer in moe_layers(straight.model) for p in layer.gate.parameters()}
    assert isinstance(straight.optimizer, MasterWeightAdamW)
    assert {p.dtype for p in straight.model.parameters() if id(p) not in routers} == {torch.bfloat16}
    before = {name: p.detach().clone() for name, p in straight.model.named_parameters()}
    straight.fit()
    assert all(not torch.equal(before[name], p.detach()) for name, p in straight.model.named_parameters()
               if "gate" not in name)  # every weight trained (bf16 rounding did not swallow the updates)
    # From the straight run's checkpoint at step 3 (fp32 masters, moments, bf16 weights) to step 6.
    middle = tmp_path / "straight" / "checkpoints" / "step_00000003.pt"
    resumed = _tiny_lm_trainer(tmp_path / "resumed", param_dtype=ParamDtype.bfloat16, resume=str(middle),
                               moment_dtype=moments, master_weights=masters)
    resumed.fit()
    assert masters or not any("master" in state for state in resumed.optimizer.state.values())
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        for key, value in straight.optimizer.state[p].items():
            assert torch.equal(value, resumed.optimizer.state[q][key]), key


def test_profile_at_writes_the_anatomy_of_the_profiled_steps(tmp_path):
    trainer = _tiny_lm_trainer(tmp_path, max_steps=5, profile_at=2)
    trainer.fit()
    text = (tmp_path / "anatomy.md").read_text()
    assert text.startswith("# Steps 2-4")  # three steps, from profile_at on
    assert "aten::mm" in text  # on a CPU: the host's costliest operators


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_at_on_a_gpu_says_where_the_gpu_waited(tmp_path):
    """On a GPU anatomy.md has the parts' table and the idle gaps by host activity: a tiny model's
    step is bound by its host, so the GPU waits, and the rows' time is at most the profiled steps'."""
    import re

    from moetrain.config import Device

    trainer = _tiny_lm_trainer(tmp_path, max_steps=5, profile_at=2, device=Device.cuda)
    trainer.fit()
    text = (tmp_path / "anatomy.md").read_text()
    assert text.startswith("# Steps 2-4 on ") and "| **step** (GPU busy" in text
    waited = re.search(r"Where the GPU waited in the profiled steps \(([0-9.]+) ms a step", text)
    step_ms = float(re.search(r"\| \*\*step\*\* \(GPU busy [0-9.]+\) \| \*\*([0-9.]+)\*\*", text).group(1))
    assert waited and 0 < float(waited.group(1))
    rows = re.findall(r"^- (.+): ([0-9.]+) ms, (\d+) gaps$", text, flags=re.MULTILINE)
    assert rows and all(int(count) > 0 for _, _, count in rows)
    assert sum(float(ms) for _, ms, _ in rows) <= float(waited.group(1)) + 0.01 + 0.01 * len(rows)
    assert step_ms > 0


# ---- without master weights: bf16 parameters rounded stochastically (master_weights=False)

def _bf16_neighbours(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values nearest below and above |value| in magnitude, signed like value, in float64, from
    the spacing formula (8 significant bits: the spacing at |x| in [2**e, 2**(e+1)) is 2**(e-7)); for a
    value that is a bf16 itself both are the value."""
    x = value.double()
    exponent = torch.floor(torch.log2(x.abs())).clamp(min=-126)  # subnormals share the smallest spacing
    spacing = torch.exp2(exponent - 7)
    lower = torch.floor(x.abs() / spacing) * spacing
    upper = torch.where(lower == x.abs(), lower, lower + spacing)
    return lower * x.sign(), upper * x.sign()


def _a_bf16_neighbour(got: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Where `got` is one of the two bf16 neighbours of the fp32 `value`, or within one bf16 step of it
    (an fp32 ulp between two computations of `value` may move it across a bf16 value)."""
    lower, upper = _bf16_neighbours(value)
    return (got == lower) | (got == upper) | ((got - value.double()).abs() <= 2**-8 * got.abs())


def test_stochastic_rounding_lands_on_a_neighbour_with_the_right_odds():
    """Each result is one of the two bf16 values around the fp32 input (the input itself where it is a
    bf16), non-finite inputs stay as they are, the same seed gives the same bits, and over many seeds
    the result's mean is the input: the upper neighbour comes with probability (|x| - lower) / spacing."""
    generator = torch.Generator().manual_seed(11)
    values = torch.cat([torch.randn(300, generator=generator) * 10.0 ** torch.randint(-30, 30, (300,), generator=generator),
                        torch.randn(50, generator=generator).bfloat16().float(),  # exact bf16 values
                        torch.tensor([1e-40, -3e-39])])  # subnormals
    lower, upper = _bf16_neighbours(values)
    draws = torch.stack([adamw.stochastic_round(values, seed).double() for seed in range(4000)])
    assert ((draws == lower) | (draws == upper)).all()
    exact = lower == upper
    assert (draws[:, exact] == values[exact].double()).all()
    p_up = (values.double().abs() - lower.abs()) / (upper - lower).abs()
    frequency = (draws == upper).double().mean(0)
    inexact = ~exact
    # 4000 Bernoulli draws: a standard deviation of at most 0.008; 5 of them apart is a bug
    assert ((frequency - p_up)[inexact].abs() < 0.04).all()
    assert torch.equal(adamw.stochastic_round(values, 7), adamw.stochastic_round(values, 7))
    assert not torch.equal(adamw.stochastic_round(values, 7), adamw.stochastic_round(values, 8))
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    assert torch.equal(adamw.stochastic_round(special, 0)[:2], special[:2].bfloat16())
    assert adamw.stochastic_round(special, 0)[2].isnan()


def test_rounding_noise_is_the_documented_hash_and_uniform():
    """rounding_noise against the hash written out with Python's integers, element by element, and its
    16 bits spread evenly: each of 256 buckets of the values holds its share of 2**20 draws (a chi-square
    test), and another seed draws other bits."""
    def naive(seed, index):
        h = (index * 0x9E3779B1 + seed) % 2**32
        h ^= h >> 16
        h = h * 0x85EBCA6B % 2**32
        h ^= h >> 13
        h = h * 0xC2B2AE35 % 2**32
        h ^= h >> 16
        return h >> 16

    seed = int(torch.randint(0, 2**31, ()))
    noise = adamw.rounding_noise(seed, 5000)
    assert noise.tolist() == [naive(seed, i) for i in range(5000)]
    draws = adamw.rounding_noise(seed, 1 << 20)
    counts = torch.bincount(draws >> 8, minlength=256).double()
    chi2 = ((counts - 4096) ** 2 / 4096).sum().item()
    assert chi2 < 400, chi2  # 255 degrees of freedom: 400 is far in the tail
    assert (draws != adamw.rounding_noise(seed + 1, 1 << 20)).double().mean() > 0.99


def test_without_masters_each_step_is_torch_adamw_rounded_to_a_neighbour():
    """master_weights=False: no fp32 copy in the state, and after each step every bf16 parameter is one
    of the two bf16 neighbours of what torch's AdamW computes in fp32 from the same bf16 weights."""
    low, high = _pairs(12)
    ours = MasterWeightAdamW(low, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, master_weights=False,
                             moment_dtype=torch.float32, rounding_seed=5)
    torchs = torch.optim.AdamW(high, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    generator = torch.Generator().manual_seed(13)
    moved_up = moved_down = 0
    for _ in range(5):
        for p, q in zip(low, high):
            q.data.copy_(p.detach().float())  # torch starts each step from our rounded weights
            grad = torch.randn(p.shape, generator=generator).bfloat16()
            p.grad, q.grad = grad, grad.float()
        ours.step()
        torchs.step()
        for p, q in zip(low, high):
            assert p.dtype == torch.bfloat16 and "master" not in ours.state[p]
            # torch's ops and ours may differ by an fp32 ulp: a neighbour of either side of it is fine
            got = p.detach().double()
            assert _a_bf16_neighbour(got, q.detach()).all()
            nearest = q.detach().bfloat16().double()
            moved_up += int((got.abs() > nearest.abs()).sum())
            moved_down += int((got.abs() < nearest.abs()).sum())
    assert moved_up and moved_down  # not round-to-nearest: some elements round the other way


def test_without_masters_updates_smaller_than_a_bf16_step_still_move_the_weights():
    """Updates of a tenth of a bf16 step: rounded to nearest they vanish, rounded stochastically the
    weights' mean follows the fp32 trajectory (here AdamW's lr a step, from 1.0: the first moment over
    the second's root is 1 for a constant gradient)."""
    steps, lr = 20, 2**-7 / 10  # bf16's spacing at 1.0 is 2**-7
    param = torch.nn.Parameter(torch.ones(1 << 14, dtype=torch.bfloat16))
    optimizer = MasterWeightAdamW([param], lr=lr, weight_decay=0.0, master_weights=False, rounding_seed=3)
    for _ in range(steps):
        param.grad = torch.full_like(param, 0.5)
        optimizer.step()
    mean = param.detach().double().mean().item()
    # below 1.0 the spacing is 2**-8: each step rounds up with odds near 0.2, an error of variance
    # 0.16 spacings squared, 3.2 over the 20 steps; the mean of 16384 weights has a standard deviation
    # of 0.014 spacings (0.007 of 2**-7), and 0.04 of 2**-7 is over five of them. Not moving at all
    # would be 2 * 2**-7 off.
    assert abs(mean - (1.0 - steps * lr)) < 2**-7 * 0.04, mean
    assert torch.tensor(1.0 - lr).bfloat16() == 1.0  # rounded to nearest, one step does not move a weight
    assert (param.detach() != 1.0).double().mean() > 0.5


def test_without_masters_replicas_and_resumed_runs_round_alike():
    """The random bits are a function of the seed, the parameter's place and the step: two optimizers
    over equal parameters write equal bits (data-parallel replicas), a state_dict round trip continues
    bit for bit, and another rounding_seed rounds otherwise."""
    low, _ = _pairs(14)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in low]
    others = [torch.nn.Parameter(p.detach().clone()) for p in low]
    first = MasterWeightAdamW(low, lr=1e-2, master_weights=False, rounding_seed=9)
    second = MasterWeightAdamW(copies, lr=1e-2, master_weights=False, rounding_seed=9)
    third = MasterWeightAdamW(others, lr=1e-2, master_weights=False, rounding_seed=10)
    generator = torch.Generator().manual_seed(15)
    grads = [[torch.randn(p.shape, generator=generator).bfloat16() for p in low] for _ in range(4)]
    for step in range(4):
        if step == 2:  # the second resumes from the first's state
            buffer = io.BytesIO()
            torch.save(first.state_dict(), buffer)
            buffer.seek(0)
            second = MasterWeightAdamW(copies, lr=1e-2, master_weights=False, rounding_seed=9)
            second.load_state_dict(torch.load(buffer, weights_only=True))
        for optimizer, params in ((first, low), (second, copies), (third, others)):
            for p, g in zip(params, grads[step]):
                p.grad = g
            optimizer.step()
        assert all(torch.equal(p, q) for p, q in zip(low, copies))
    assert not all(torch.equal(p, q) for p, q in zip(low, others))


def test_rounding_keys_outlive_narrowed_groups_and_other_keys_round_otherwise():
    """A parameter's bits follow its key, its place among the constructor's parameters: an optimizer
    whose groups were narrowed to one parameter afterwards (as ZeRO-1 narrows each rank's) rounds it
    as the whole one does; set_rounding_key gives it other bits."""
    low, _ = _pairs(16)
    copies = [[torch.nn.Parameter(p.detach().clone()) for p in low] for _ in range(3)]
    whole, narrowed, rekeyed = (MasterWeightAdamW(params, lr=1e-2, master_weights=False, rounding_seed=3)
                                for params in copies)
    for optimizer in (narrowed, rekeyed):
        optimizer.param_groups[0]["params"] = optimizer.param_groups[0]["params"][-1:]
    assert whole.rounding_keys[copies[0][-1]] == narrowed.rounding_keys[copies[1][-1]] == len(low) - 1
    rekeyed.set_rounding_key(copies[2][-1], 7)
    generator = torch.Generator().manual_seed(17)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=generator).bfloat16() for p in low]
        for params, optimizer in zip(copies, (whole, narrowed, rekeyed)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            optimizer.step()
    assert torch.equal(copies[0][-1], copies[1][-1])
    assert not torch.equal(copies[0][-1], copies[2][-1])
    assert all(torch.equal(p, q) for p, q in zip(low[:-1], copies[1][:-1]))  # narrowed away: not stepped
    with pytest.raises(ValueError, match="not one this optimizer was built with"):
        whole.set_rounding_key(low[0], 1)
    with pytest.raises(ValueError, match="key must be in"):
        whole.set_rounding_key(copies[0][0], -1)


def test_checkpoints_move_between_master_and_masterless_optimizers():
    """A checkpoint with masters loaded without them: the masters are dropped (the weights come with the
    model). One without masters loaded with them: the masters start from the bf16 weights."""
    low, _ = _pairs(16)
    with_masters = MasterWeightAdamW(low, lr=1e-2)
    for p in low:
        p.grad = torch.randn(p.shape).bfloat16()
    with_masters.step()
    masterless = MasterWeightAdamW(low, lr=1e-2, master_weights=False)
    masterless.load_state_dict(with_masters.state_dict())
    assert all("master" not in masterless.state[p] and "exp_avg" in masterless.state[p] for p in low)
    masterless.step()
    again = MasterWeightAdamW(low, lr=1e-2)
    again.load_state_dict(masterless.state_dict())
    for p in low:
        assert again.state[p]["master"].dtype == torch.float32 and torch.equal(again.state[p]["master"], p.float())
    with pytest.raises(ValueError, match="master_weights=False rounds bf16 parameters stochastically"):
        MasterWeightAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))], master_weights=False)
    with pytest.raises(ValueError, match="master_weights=False rounds bf16 parameters stochastically"):
        build_optimizer(torch.nn.Linear(2, 2), OptimConfig(master_weights=False))
