"""The trainer: exact resume, non-finite handling, schedule, optimizer groups, checkpoints, TensorBoard."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from moetrain.config import LoggerConfig, NonFinite, OptimConfig, ParamDtype, Precision, TrainerConfig
from moetrain.data import synthetic
from moetrain.models import VisionMoE
from moetrain.moe import is_expert_param
from moetrain.train import NonFiniteLoss, Trainer, checkpoint, seed_everything
from moetrain.train.optim import build_optimizer, build_scheduler


def tiny_model() -> VisionMoE:
    routing = {"gate": "top", "top_k": 2, "capacity_factor": 1.0, "balance_loss_weight": 0.01, "z_loss_weight": 0.001,
               "gate_kwargs": {"jitter_eps": 0.1}}
    return VisionMoE(
        image_size=8, in_channels=3, patch_size=4, num_classes=4, dim=16, depth=2, num_heads=2, num_experts=4,
        expert_hidden_size=16, moe_every=1, dropout=0.1, moe_kwargs=routing,
    )


def make_trainer(run_dir, model=None, tensorboard=False, **trainer_settings) -> Trainer:
    """A trainer on a 4-class synthetic task of 8x8 images (6 batches of 8 per epoch)."""
    settings = dict(max_steps=6, eval_every=0, eval_batches=1, checkpoint_every=0, progress_bar=False)
    settings.update(trainer_settings)
    seed_everything(0)
    data = synthetic(num_classes=4, image_size=8, train_size=48, eval_size=16, batch_size=8, eval_batch_size=8)
    return Trainer(
        model or tiny_model(),
        data,
        trainer=TrainerConfig(**settings),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        logger=LoggerConfig(tensorboard=tensorboard, log_every=1),
        run_dir=run_dir,
        seed=0,
        run_config={"model": {"name": "tiny"}},
    )


def test_killed_run_resumes_to_the_same_weights(tmp_path):
    """Dropout, router jitter, two micro-batches per step, epochs crossed: all must line up."""
    reference = make_trainer(tmp_path / "reference", grad_accum_steps=2)
    reference.fit()

    killed = make_trainer(tmp_path / "run", grad_accum_steps=2, checkpoint_every=2)
    train_step = killed._train_step

    def dies_at_step_5():
        if killed.step == 5:
            raise KeyboardInterrupt
        return train_step()

    killed._train_step = dies_at_step_5
    with pytest.raises(KeyboardInterrupt):
        killed.fit()
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "run" / "checkpoints")] == [
        "step_00000002.pt", "step_00000004.pt"
    ]

    seed_everything(1)  # a different initialisation: the checkpoint must replace all of it
    resumed = make_trainer(tmp_path / "run", model=tiny_model(), grad_accum_steps=2, checkpoint_every=2, resume="auto")
    metrics = resumed.fit()
    assert metrics["step"] == 6
    expected = reference.model.state_dict()
    for name, tensor in resumed.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert resumed.optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    make_trainer(tmp_path, max_steps=1).fit()
    other = make_trainer(tmp_path, max_steps=2, resume="auto")
    other.run_config = {"model": {"name": "another"}}
    with pytest.raises(checkpoint.CheckpointError, match="different model config"):
        other.fit()


class NaNAt(nn.Module):
    """Wraps a model; its `call`-th forward returns NaN logits. Keeps the weights of every call."""

    def __init__(self, model: nn.Module, call: int):
        super().__init__()
        self.model, self.call, self.calls, self.weights_before = model, call, 0, []

    def forward(self, images):
        self.calls += 1
        self.weights_before.append({k: v.clone() for k, v in self.model.state_dict().items()})
        logits = self.model(images)
        return logits * float("nan") if self.calls == self.call else logits


# The two ways a step is decided: on the host, which waits for the step's loss and norm (fp32
# parameters on the CPU: torch's AdamW), and on the device, which the host reads one step later
# (bf16 parameters: MasterWeightAdamW takes the clipping factor and the skip as tensors).
DECIDED = {"on the host": {}, "on the device": dict(param_dtype=ParamDtype.bfloat16, precision=Precision.bf16)}


@pytest.mark.parametrize("decided", list(DECIDED))
def test_nonfinite_loss_stops_naming_the_step_and_leaves_weights_untouched(tmp_path, decided):
    model = NaNAt(tiny_model(), call=3)
    trainer = make_trainer(tmp_path, model=model, **DECIDED[decided])
    assert trainer.device_flags == (decided == "on the device")
    with pytest.raises(NonFiniteLoss, match="at step 3"):
        trainer.fit()
    # The host learns of step 3 once step 4 is queued, before step 4's update.
    assert model.calls == (4 if trainer.device_flags else 3)
    for name, tensor in model.model.state_dict().items():
        assert torch.equal(tensor, model.weights_before[2][name]), name


@pytest.mark.parametrize("decided", list(DECIDED))
def test_nonfinite_loss_skips_the_step_when_configured(tmp_path, decided):
    model = NaNAt(tiny_model(), call=3)
    trainer = make_trainer(tmp_path, model=model, on_nonfinite=NonFinite.skip, max_steps=5, **DECIDED[decided])
    metrics = trainer.fit()
    assert metrics["skipped_steps"] == 1 and metrics["step"] == 5
    for name, tensor in model.weights_before[3].items():  # step 3 changed nothing
        assert torch.equal(tensor, model.weights_before[2][name]), name
    assert not torch.equal(model.weights_before[2]["head.weight"], model.weights_before[1]["head.weight"])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert math.isfinite(json.loads((tmp_path / "metrics.json").read_text())["train/loss"])
    counts = {float(state["step"]) for state in trainer.optimizer.state.values()}
    assert counts == {4.0}  # the skipped step is not counted (Adam's bias correction)


@pytest.mark.parametrize("grad_clip", [0.0, 0.05], ids=["unclipped", "clipped"])
def test_steps_decided_on_the_device_train_as_steps_decided_on_the_host(tmp_path, grad_clip):
    """The same bf16 run, with a non-finite step 3 skipped and every step clipped (or none), decided
    on the device (the host one step behind) and on the host: the same weights, optimizer state,
    skipped steps and logged metrics; bit for bit unclipped (clipped, the host multiplies the bf16
    gradients by the factor, rounding them, and the device divides them in fp32 by its inverse)."""
    runs = {}
    for on_device in (True, False):
        seed_everything(0)
        model = NaNAt(tiny_model(), call=3)
        trainer = make_trainer(tmp_path / str(on_device), model=model, on_nonfinite=NonFinite.skip, grad_clip=grad_clip,
                               checkpoint_every=4, **DECIDED["on the device"])
        trainer.device_flags = on_device
        metrics = trainer.fit()
        lines = [json.loads(line) for line in (tmp_path / str(on_device) / "metrics.jsonl").read_text().splitlines()]
        runs[on_device] = trainer, metrics, lines
    (device, device_metrics, device_lines), (host, host_metrics, host_lines) = runs[True], runs[False]
    assert device_metrics["skipped_steps"] == host_metrics["skipped_steps"] == 1
    assert [line["step"] for line in device_lines] == [line["step"] for line in host_lines]
    # A line a step (log_every=1) but the skipped one's, whose window has no finite loss.
    assert [line["step"] for line in device_lines if "train/loss" in line] == [1, 2, 4, 5, 6]
    if grad_clip:
        assert min(line["train/grad_norm"] for line in host_lines if "train/grad_norm" in line) > grad_clip
    for ours, theirs in zip(device_lines, host_lines):
        assert ours.keys() == theirs.keys()
        for key in ours:
            if key.startswith(("train/loss", "train/aux", "train/grad", "train/lr", "eval/")):
                assert ours[key] == (theirs[key] if not grad_clip else pytest.approx(theirs[key], rel=2e-2)), key
    for (name, p), q in zip(device.model.named_parameters(), host.model.parameters()):
        ours, theirs = device.optimizer.state[p], host.optimizer.state[q]
        assert float(ours["step"]) == float(theirs["step"]) == 5
        # The key bias's gradient is zero but for rounding (softmax ignores what it adds to every
        # score of a query), so Adam's steps on it follow the rounding: compared unclipped only.
        if grad_clip and name.endswith("k_proj.bias"):
            continue
        if grad_clip:
            torch.testing.assert_close(p, q, rtol=2**-7, atol=1e-3, msg=name)
        else:
            assert torch.equal(p, q), name
        for key in ("master", "exp_avg", "exp_avg_sq"):
            if key not in ours:
                continue
            if not grad_clip:
                assert torch.equal(ours[key], theirs[key]), key
            elif key == "master":  # Adam's step is about lr (3e-3) whatever the gradient's scale
                torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-3, msg=name)
            else:  # the moments scale with the clipping factor (about 0.007 here)
                scale = float(theirs[key].abs().max())
                torch.testing.assert_close(ours[key], theirs[key], rtol=2e-2, atol=2e-2 * scale, msg=name)


def test_sigterm_with_steps_decided_on_the_device_stops_a_step_later_and_resumes_exactly(tmp_path):
    """The stop request reaches the host with its step's numbers, one step later (step 3 is no
    checkpoint step, where the host would read it at once): the run stops after step 4 (every rank
    alike), saves it, and resumes to the uninterrupted run's weights."""
    import os
    import signal

    from moetrain.train.trainer import Terminated

    settings = dict(checkpoint_every=5, max_steps=6, **DECIDED["on the device"])
    reference = make_trainer(tmp_path / "reference", **settings)
    reference.fit()
    stopped = make_trainer(tmp_path / "run", **settings)
    step = stopped._train_step

    def sigterm_during_step_3():
        if stopped.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return step()

    stopped._train_step = sigterm_during_step_3
    with pytest.raises(Terminated, match="at step 4"):
        stopped.fit()
    saved = [p.name for p in checkpoint.checkpoints(tmp_path / "run" / "checkpoints")]
    assert saved == ["step_00000004.pt"]  # although checkpoint_every=5
    resumed = make_trainer(tmp_path / "run", resume="auto", **settings)
    assert resumed.fit()["step"] == 6
    for (name, p), q in zip(reference.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name


def test_learning_rate_warms_up_then_follows_the_cosine():
    parameter = nn.Parameter(torch.randn(3))
    cfg = OptimConfig(lr=0.5, warmup_steps=3, min_lr_ratio=0.2)
    optimizer = torch.optim.SGD([parameter], lr=cfg.lr)
    scheduler = build_scheduler(optimizer, cfg, max_steps=10)
    for step in range(10):
        if step < 3:
            expected = 0.5 * (step + 1) / 4
        else:
            progress = (step - 3) / 7
            expected = 0.1 + (0.5 - 0.1) * (1 + math.cos(math.pi * progress)) / 2
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected), step
        optimizer.step()
        scheduler.step()


def test_weight_decay_skips_biases_norms_and_expert_biases():
    model = tiny_model()
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.1))
    decayed = {id(p) for p in optimizer.param_groups[0]["params"]}
    assert optimizer.param_groups[0]["weight_decay"] == 0.1 and optimizer.param_groups[1]["weight_decay"] == 0.0
    for name, parameter in model.named_parameters():
        is_matrix = parameter.ndim >= 3 or (parameter.ndim == 2 and not is_expert_param(parameter))
        assert (id(parameter) in decayed) == is_matrix, name
    experts = model.blocks[0].ffn.experts
    assert id(experts.w1) in decayed and id(experts.b1) not in decayed


def test_checkpoints_are_written_whole_and_pruned(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save({"step": step, "weights": torch.randn(4)}, tmp_path, step, keep=2)
    files = checkpoint.checkpoints(tmp_path / "checkpoints")
    assert [f.name for f in files] == ["step_00000002.pt", "step_00000003.pt"]
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000002.pt", "step_00000002.pt.sha256", "step_00000003.pt", "step_00000003.pt.sha256"]
    assert checkpoint.candidates("auto", tmp_path) == files[::-1]
    assert checkpoint.candidates(str(tmp_path), tmp_path / "elsewhere") == files[::-1]
    assert checkpoint.candidates(str(files[0]), tmp_path) == [files[0]]
    assert checkpoint.load(files[-1])["step"] == 3
    assert checkpoint.candidates("auto", tmp_path / "new_run") == []
    assert checkpoint.find("auto", tmp_path) == files[-1] and checkpoint.find("auto", tmp_path / "new_run") is None
    checkpoint.checksum_path(files[-1]).unlink()  # step 3 no longer counts as complete
    assert checkpoint.find(str(tmp_path), tmp_path / "elsewhere") == files[0]
    with pytest.raises(checkpoint.CheckpointError, match="TrainerConfig.resume="):
        checkpoint.candidates(str(tmp_path / "missing"), tmp_path)


def test_tensorboard_events_hold_every_tag_with_finite_values(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    trainer = make_trainer(tmp_path, tensorboard=True, max_steps=4, eval_every=2)
    trainer.run_config = {"optim": {"lr": 0.003}, "name": "tiny", "model": {"name": "tiny"}}
    trainer.fit()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    layers = [name for name in trainer.moe_layers]
    assert layers == ["blocks.0.ffn", "blocks.1.ffn"]
    expected = {"train/loss", "train/aux_loss", "train/lr", "train/samples_per_sec", "eval/loss", "eval/accuracy"}
    expected |= {f"moe/{layer}/dropped_fraction" for layer in layers}
    assert expected <= scalars
    for tag in expected:
        values = [event.value for event in events.Scalars(tag)]
        assert values and all(math.isfinite(v) for v in values), tag
    assert len(events.Scalars("train/loss")) == 4 and len(events.Scalars("eval/accuracy")) == 2
    tokens_per_step = 8 * (4 + 1) * 2  # batch * (patches + class token) * top_k
    for layer in layers:
        histograms = events.Histograms(f"moe/{layer}/tokens_per_expert")
        assert len(histograms) == 4
        for histogram in histograms:
            assert sum(histogram.histogram_value.bucket) == tokens_per_step
            assert len(histogram.histogram_value.bucket) == 4  # one bar per expert
    content = events.PluginTagToContent("hparams")
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= set(content)
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    assert start.session_start_info.hparams["optim.lr"].number_value == pytest.approx(0.003)
    assert start.session_start_info.hparams["name"].string_value == "tiny"


class RecordsDtype(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.dtypes = model, set()

    def forward(self, images):
        logits = self.model(images)
        self.dtypes.add(logits.dtype)
        return logits


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_runs_under_bf16_autocast(tmp_path):
    from moetrain.config import Device

    model = RecordsDtype(tiny_model())
    trainer = make_trainer(tmp_path, model=model, device=Device.cuda, max_steps=2)
    metrics = trainer.fit()
    assert model.dtypes == {torch.bfloat16}
    assert trainer.optimizer.defaults["fused"]  # one fused AdamW kernel, not the multi-tensor default
    assert next(model.parameters()).device.type == "cuda" and next(model.parameters()).dtype == torch.float32
    assert math.isfinite(metrics["train/loss"]) and metrics["step"] == 2


@pytest.mark.parametrize("max_norm", [float("inf"), 0.5])
def test_gradient_norm_and_clipping_of_one_process(max_norm):
    """SingleProcess.clip_grad_norm_: the global L2 norm of every gradient (a formula over the raw
    values), the gradients scaled to max_norm when above it, and with clipping off (inf) not one
    operation on the gradients (torch's clip_grad_norm_ would multiply each by 1)."""
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

    from moetrain.train.processes import SingleProcess  # noqa: PLC0415

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))
    model(torch.randn(4, 7)).square().sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    want = math.sqrt(sum(float(g.double().square().sum()) for g in before))
    with Ops() as ops:
        norm = SingleProcess().clip_grad_norm_(model, max_norm)
    assert norm.item() == pytest.approx(want, rel=1e-6)
    after = [p.grad for p in model.parameters()]
    if max_norm == float("inf"):
        assert not any("mul" in name for name in ops.names), ops.names
        assert all(torch.equal(a, b) for a, b in zip(after, before))
    else:
        assert want > max_norm  # so the gradients must shrink
        for a, b in zip(after, before):
            torch.testing.assert_close(a, b * (max_norm / want), rtol=1e-5, atol=1e-7)


def test_the_gradient_norm_of_mixed_dtypes_takes_one_foreach_call_per_dtype():
    """bf16 gradients with fp32 ones (the routers'), as bf16 parameters give them: the norm is the
    formula's over the raw values, and each _foreach_norm call gets one dtype (a mixed list sends torch
    down its slow path, one reduction kernel per tensor)."""
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

    from moetrain.train.processes import SingleProcess  # noqa: PLC0415

    class ForeachNorms(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("_foreach_norm"):
                self.calls.append({t.dtype for t in args[0]})
            return func(*args, **(kwargs or {}))

    generator = torch.Generator().manual_seed(3)
    shapes = [((33, 7), torch.bfloat16), ((5,), torch.float32), ((4, 9), torch.bfloat16), ((8, 2), torch.float32),
              ((70,), torch.bfloat16)]
    model = nn.Module()
    model.params = nn.ParameterList([nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape, dtype in shapes])
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
    want = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    with ForeachNorms() as mode:
        norm = SingleProcess().clip_grad_norm_(model, float("inf"))
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(want, rel=1e-6)
    assert sorted(map(sorted, mode.calls), key=str) == [[torch.bfloat16], [torch.float32]]


@pytest.mark.parametrize("mode", [None, "reduce_overhead", "max_autotune", "max_autotune_no_cudagraphs"])
def test_compile_mode_reaches_torch_compile(tmp_path, monkeypatch, mode):
    """trainer.compile_mode is handed to torch.compile by torch's own name for it, for the model and
    the loss alike; null passes no mode (torch's default). torch.compile is replaced by a recorder
    that returns its function, so the run itself is eager and its loss the eager run's."""
    from moetrain.config import CompileMode

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    compile_mode = None if mode is None else CompileMode[mode]
    trained = make_trainer(tmp_path / "compiled", compile=True, compile_mode=compile_mode).fit()
    want = {} if mode is None else {"mode": {"reduce_overhead": "reduce-overhead", "max_autotune": "max-autotune",
                                             "max_autotune_no_cudagraphs": "max-autotune-no-cudagraphs"}[mode]}
    assert calls[:2] == [want, want]  # the model, then the loss
    eager = make_trainer(tmp_path / "eager").fit()
    assert trained["train/loss"] == eager["train/loss"]


@pytest.mark.parametrize("mode", [None, "reduce_overhead", "max_autotune"])
def test_tuned_reductions_reach_torch_compile_with_the_modes_options(tmp_path, monkeypatch, mode):
    """trainer.compile_tuned_reductions hands torch.compile inductor's triton.multi_kernel, with the
    options of the mode asked for (torch.compile takes a mode or options, not both), written out
    here as torch documents the modes: CUDA graphs for reduce-overhead, autotuning for max-autotune."""
    from moetrain.config import CompileMode

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    make_trainer(tmp_path, compile=True, compile_mode=None if mode is None else CompileMode[mode],
                 compile_tuned_reductions=True).fit()
    mode_options = {None: {}, "reduce_overhead": {"triton.cudagraphs": True},
                    "max_autotune": {"max_autotune": True, "triton.cudagraphs": True,
                                     "coordinate_descent_tuning": True}}
    want = {"options": {**mode_options[mode], "triton.multi_kernel": 1, "use_static_cuda_launcher": False}}
    assert calls[:2] == [want, want]  # the model, then the loss


_TUNED_CHILD = """
import sys, torch
from torch._inductor.utils import run_and_get_code
from moetrain.train.trainer import _compile_kwargs

def rms_norm(x, w):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w

torch.manual_seed(int(sys.argv[1]))
x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
out, code = run_and_get_code(torch.compile(rms_norm, **_compile_kwargs(None, True)), x, w)
torch.testing.assert_close(out, rms_norm(x, w), atol=2e-2, rtol=2e-2)
print("multi_kernel" in "".join(code))
"""


@pytest.mark.cuda
def test_tuned_reductions_compile_again_from_a_warm_cache(tmp_path):
    """A second run compiles from inductor's cache, which the first one filled: with tuned reductions
    (two kernels for a norm's row, one picked by timing) that second run must compile and compute the
    norm as the first did, not fail in loading the cached kernels."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    runs = [subprocess.run([sys.executable, "-c", _TUNED_CHILD, str(seed)], env=env, capture_output=True, text=True,
                           timeout=300) for seed in (0, 1)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    assert runs[0].stdout.split()[-1] == "True"  # the norm compiled as a tuned pair: the case at stake


def test_tuned_reductions_without_compile_are_refused(tmp_path):
    from moetrain.config import SettingError

    with pytest.raises(SettingError, match="compile_tuned_reductions=true applies only with TrainerConfig.compile="):
        make_trainer(tmp_path, compile_tuned_reductions=True)


def test_a_compile_mode_without_compile_is_refused(tmp_path):
    from moetrain.config import CompileMode, SettingError

    with pytest.raises(SettingError, match="compile_mode='reduce_overhead' applies only with TrainerConfig.compile=true"):
        make_trainer(tmp_path, compile_mode=CompileMode.reduce_overhead)


def _train_lines(run_dir) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line for line in lines if "train/loss" in line}


@pytest.mark.parametrize("decided", list(DECIDED))
def test_each_window_rate_counts_its_own_steps_only(tmp_path, monkeypatch, decided):
    """train/samples_per_sec of a logged window is its samples over its steps' own time: evaluation,
    checkpoints and the profiler's report between steps are not training time, and the profiled steps
    (which the profiler's own work stretches) are left out of the rate; a window of profiled steps
    only logs its loss and no rate at all. A fake clock: a step takes 2 s, a profiled one 5 s, a pause
    100 s; every rate must then be 8 samples / 2 s."""
    import types

    import moetrain.train.trainer as trainer_module

    clock = [0.0]
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    trainer = make_trainer(tmp_path, max_steps=12, eval_every=4, checkpoint_every=5, profile_at=6, **DECIDED[decided])
    assert trainer.device_flags == (decided == "on the device")
    trainer.logger_cfg.log_every = 3
    step, evaluate, save, anatomy = trainer._train_step, trainer.evaluate, trainer.save_checkpoint, trainer._write_anatomy

    def train_step():
        clock[0] += 5.0 if 6 <= trainer.step <= 8 else 2.0
        return step()

    def paused(fn):
        def call(*args, **kwargs):
            clock[0] += 100.0
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(trainer, "_train_step", train_step)
    monkeypatch.setattr(trainer, "evaluate", paused(evaluate))
    monkeypatch.setattr(trainer, "save_checkpoint", paused(save))
    monkeypatch.setattr(trainer, "_write_anatomy", paused(anatomy))
    trainer.fit()
    lines = _train_lines(tmp_path)
    assert sorted(lines) == [3, 6, 9, 12]
    assert (tmp_path / "anatomy.md").is_file()  # steps 6-8 were profiled
    for at in (3, 6, 9, 12):  # 6: steps 4-5 timed, 6 profiled; 9: step 9 timed, 7-8 profiled
        assert lines[at]["train/samples_per_sec"] == pytest.approx(8 / 2.0), at
        assert math.isfinite(lines[at]["train/loss"])


def test_a_window_of_profiled_steps_only_logs_no_rate(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=5, profile_at=2)  # log_every=1: steps 2-4 are windows of their own
    trainer.fit()
    lines = _train_lines(tmp_path)
    assert sorted(lines) == [1, 2, 3, 4, 5]
    for at in (2, 3, 4):
        assert "train/samples_per_sec" not in lines[at] and math.isfinite(lines[at]["train/loss"])
    assert lines[1]["train/samples_per_sec"] > 0 and lines[5]["train/samples_per_sec"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_pause_is_not_training_time_and_its_drained_steps_are(tmp_path, monkeypatch):
    """The host runs ahead of the GPU: the work queued before an evaluation drains while the host
    evaluates, and the step after it starts on an idle GPU. Each step here also sleeps 50 ms on the
    GPU and each evaluation 0.5 s on the host: every window's time per step must be the steps' own
    (the sleep's and the tiny model's few ms), not shortened by the drained work nor lengthened by the pause."""
    import time

    from moetrain.config import Device

    def sleep_ms(cycles: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    sleep_ms(10**8)  # loads the sleep kernel (its first launch would be timed too) and lifts the clocks
    cycles = int(10**8 * 50 / sleep_ms(10**8))  # the GPU's cycles in 50 ms
    slept = sleep_ms(cycles) / 1e3
    trainer = make_trainer(tmp_path, device=Device.cuda, max_steps=12, eval_every=3)
    trainer.logger_cfg.log_every = 3
    step, evaluate = trainer._train_step, trainer.evaluate

    def train_step():
        torch.cuda._sleep(cycles)
        return step()

    def evaluate_slowly():
        time.sleep(0.5)
        return evaluate()

    monkeypatch.setattr(trainer, "_train_step", train_step)
    monkeypatch.setattr(trainer, "evaluate", evaluate_slowly)
    trainer.fit()
    assert trainer.device_flags  # the host reads each step a step late: the case at stake
    lines = _train_lines(tmp_path)
    for at in (6, 9, 12):  # (step 1's window holds the warm-up)
        per_step = 8 / lines[at]["train/samples_per_sec"]
        assert 0.9 * slept < per_step < slept + 0.025, (at, per_step, slept)
