"""`moetrain mode=eval quant=...`: a trained quickstart run evaluated as trained and with quantized
experts, the exported quantized checkpoint loaded back, the command's one-line errors, and
trainer.compile."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_RUN, TINY_SYNTHETIC
from test_cli import expect_one_line_error, run_in_process

from moetrain import cli
from moetrain.moe import MoELayer
from moetrain.quant import QuantizedExperts, QuantPolicy, load_quantized, quantize_model
from moetrain.train import checkpoint

# Enough steps and eval images that the model is past chance and the accuracy change means something.
RUN = [
    "+recipe=quickstart", *TINY_RUN, *TINY_SYNTHETIC, "trainer.max_steps=25", "trainer.eval_every=0",
    "trainer.eval_batches=0", "data.eval_size=64", "data.eval_batch_size=32", "data.train_size=256", "logger=none",
]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A quickstart run trained through the command; returns (working dir, run dir)."""
    cwd = tmp_path_factory.mktemp("quant_cli")
    with pytest.MonkeyPatch.context() as monkeypatch:
        run_in_process(RUN, monkeypatch, cwd)
    (run_dir,) = (cwd / "runs").iterdir()
    return cwd, run_dir


def test_eval_mode_quantizes_reports_and_exports(trained_run, compose, monkeypatch, tmp_path):
    cwd, run_dir = trained_run
    trained = json.loads((run_dir / "metrics.json").read_text())
    export = tmp_path / "model.mxfp4.pt"
    eval_dir = tmp_path / "eval_run"
    run_in_process([*RUN, "mode=eval", "quant=mxfp4", f"trainer.resume={run_dir}", f"quant.export={export}",
                    f"hydra.run.dir={eval_dir}"], monkeypatch, cwd)
    metrics = json.loads((eval_dir / "metrics.json").read_text())

    # The unquantized numbers are the training run's own final evaluation (same weights, same set).
    assert metrics["eval/loss"] == pytest.approx(trained["eval/loss"], rel=1e-5)
    assert metrics["eval/accuracy"] == trained["eval/accuracy"]
    # MXFP4 experts change the loss a little, not the model's skill; memory shrinks about 5x vs fp32.
    assert metrics["quant/eval/loss"] != metrics["eval/loss"]
    assert abs(metrics["quant/change/loss"]) < 0.05 * metrics["eval/loss"]
    assert abs(metrics["quant/eval/accuracy"] - metrics["eval/accuracy"]) <= 0.1
    assert metrics["quant/change/accuracy"] == pytest.approx(metrics["quant/eval/accuracy"] - metrics["eval/accuracy"])
    assert metrics["quant/expert_bytes"] < metrics["expert_bytes"] / 4

    # The exported file in a freshly built model gives the logits of the trained model quantized here.
    config = cli.checked(compose([*RUN, "mode=eval", "quant=mxfp4", f"trainer.resume={run_dir}"]))
    data, loaded = cli.build(config)
    plan = load_quantized(loaded, str(export))
    assert plan == [["mxfp4"] * 4] * len(plan) and all(isinstance(m.experts, QuantizedExperts)
                                                      for m in loaded.modules() if isinstance(m, MoELayer))
    reference = cli.build_model(config, data)
    reference.load_state_dict(checkpoint.load(checkpoint.find(str(run_dir), run_dir))["model"])
    quantize_model(reference, QuantPolicy("mxfp4"))
    images = torch.randn(8, *data.eval_set[0][0].shape)
    loaded.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(images), reference(images), rtol=0, atol=0)


def test_eval_mode_mixed_precision_calibrates(trained_run, monkeypatch, tmp_path):
    cwd, run_dir = trained_run
    eval_dir = tmp_path / "eval_run"
    run_in_process([*RUN, "mode=eval", "quant=mixed", "quant.calibration_batches=2", f"trainer.resume={run_dir}",
                    f"hydra.run.dir={eval_dir}"], monkeypatch, cwd)
    metrics = json.loads((eval_dir / "metrics.json").read_text())
    # One of each layer's 4 experts keeps FP8 (9.5 bits/weight), three take MXFP4 (~4.25 + padding):
    # between the all-MXFP4 and all-FP8 sizes.
    assert metrics["expert_bytes"] / 8 < metrics["quant/expert_bytes"] < metrics["expert_bytes"] / 3
    assert abs(metrics["quant/eval/accuracy"] - metrics["eval/accuracy"]) <= 0.1


@pytest.mark.parametrize("argv, message", [
    (["mode=eval"], "pass trainer.resume=RUN_DIR"),
    (["mode=eval", "quant=mxfp4"], "pass trainer.resume=RUN_DIR"),
    (["mode=eval", "quant=mxfp5", "trainer.resume=x"], "did you mean mxfp4?"),
    (["mode=eval", "quant.format=int4", "trainer.resume=x"], "quant.format must be one of"),
    (["mode=eval", "quant=mixed", "quant.calibration_batches=0", "trainer.resume=x"], "quant.calibration_batches"),
    (["quant=fp8"], "quant applies to mode=eval"),
    (["mode=test"], "bad value for mode"),
])
def test_eval_mistakes_exit_2_with_one_line(argv, message, monkeypatch, capsys, tmp_path):
    expect_one_line_error(argv, message, monkeypatch, capsys, tmp_path)


def test_compile_wraps_the_forward_and_keeps_plain_checkpoint_keys(compose, tmp_path):
    """trainer.compile=true: training calls the compiled wrapper, checkpoints hold the plain module's
    keys. (Running compiled steps takes minutes on a 2-core CPU, so this test does not run them.)"""
    cfg = compose([*RUN, "trainer.compile=true"])
    config = cli.checked(cfg)
    data, model = cli.build(config)
    trainer = cli.Trainer(model, data, trainer=config.trainer, optim=config.optim, logger=config.logger,
                          run_dir=tmp_path, seed=0, run_config={})
    assert isinstance(trainer.forward, torch._dynamo.eval_frame.OptimizedModule)
    assert trainer.forward._orig_mod is model
    assert list(trainer.state_dict()["model"]) == list(model.state_dict())
    assert not any(key.startswith("_orig_mod") for key in trainer.state_dict()["model"])
