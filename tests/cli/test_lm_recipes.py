"""LM recipes and model/data options through the real CLI: every tiny LM recipe trains a few steps
and reports a validation perplexity; every LM model option composes and builds (full sizes on the
meta device, with the model's own routing)."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import hydra
import pytest
import torch
from hydra.utils import instantiate

from moetrain.cli import checked, register_configs
from moetrain.models import MoETransformerLM, parameter_counts
from moetrain.models.routing_settings import layer_kwargs
from moetrain.moe import moe_layers

TINY_RECIPES = ["deepseek_moe_lm", "qwen3_moe_lm", "kimi_k2_lm"]


def test_tiny_lm_recipes_train_and_report_perplexity(tmp_path):
    command = [
        sys.executable, "-m", "moetrain", "-m", "+recipe=" + ",".join(TINY_RECIPES),
        "trainer.max_steps=3", "trainer.eval_batches=1", "trainer.progress_bar=false",
        "data.train_size=64", "data.eval_size=16", "logger=none",
        f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=${hydra.job.num}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    for job in range(len(TINY_RECIPES)):
        metrics = json.loads((tmp_path / str(job) / "metrics.json").read_text())
        assert metrics["step"] == 3
        assert metrics["eval/perplexity"] == pytest.approx(math.exp(metrics["eval/loss"]))
        assert metrics["train/tokens_per_sec"] == pytest.approx(64 * metrics["train/samples_per_sec"])  # seq_len 64
        assert "train/mfu" not in metrics  # a CPU has no known peak
        # Three steps from a random start: the loss is still near ln(vocab), far from nonsense.
        assert 0.5 * math.log(256) < metrics["eval/loss"] < 1.5 * math.log(256)


def test_h200_lm_recipe_runs_scaled_down_on_cpu(tmp_path):
    """The single-H200 recipe as it is (gate, optimizer, data task), with the model shrunk and
    the device switched (and compilation off) so it fits a CPU test."""
    shrink = ["+model.dim=64", "+model.depth=2", "+model.num_heads=4", "+model.num_kv_heads=2", "+model.head_dim=16",
              "+model.expert_hidden_size=64", "model.vocab_size=512", "data.vocab_size=512", "data.seq_len=32",
              "data.train_size=64", "data.eval_size=16", "data.batch_size=4", "data.eval_batch_size=4"]
    command = [sys.executable, "-m", "moetrain", "+recipe=moe_1b5_h200_lm", *shrink, "trainer.max_steps=3",
               "trainer.eval_batches=1", "trainer.device=cpu", "trainer.precision=fp32", "trainer.compile=false",
               "trainer.progress_bar=false",
               "logger=none", f"hydra.run.dir={tmp_path}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["step"] == 3 and math.isfinite(metrics["eval/perplexity"])


def test_the_fp8_h200_recipe_is_the_h200_recipe_with_the_speed_settings_only():
    """moe_1b5_h200_fp8_lm composes moe_1b5_h200_lm (its model, data, optimizer, schedule and trainer
    settings) and changes exactly the settings it names: nothing else of the base recipe moves."""
    from omegaconf import OmegaConf

    def flat(node, prefix=""):
        if isinstance(node, dict):
            return {k: v for key, value in node.items() for k, v in flat(value, f"{prefix}{key}.").items()}
        return {prefix[:-1]: node}

    def composed(recipe):
        register_configs()
        with hydra.initialize_config_module(config_module="moetrain.conf", version_base="1.3"):
            return flat(OmegaConf.to_container(hydra.compose(config_name="config", overrides=[f"+recipe={recipe}"]),
                                             enum_to_str=True))

    base, fast = composed("moe_1b5_h200_lm"), composed("moe_1b5_h200_fp8_lm")
    compose(["+recipe=moe_1b5_h200_fp8_lm"])  # and it passes the CLI's checks
    changed = {key: (base.get(key), fast.get(key)) for key in base.keys() | fast.keys() if base.get(key) != fast.get(key)}
    assert changed == {
        "name": ("moe_1b5_h200_lm", "moe_1b5_h200_fp8_lm"),
        "optim.moment_dtype": ("float32", "bfloat16"),
        "trainer.param_dtype": ("float32", "bfloat16"),
        "trainer.precision": ("bf16", "fp8"),
        "trainer.fp8_linears": (False, True),
        "trainer.compile_mode": (None, "reduce_overhead"),
        "trainer.compile_tuned_reductions": (False, True),
    }
    assert base["model.preset"] == "moe_1b5" and base["trainer.compile"] is True


def compose(overrides):
    register_configs()
    with hydra.initialize_config_module(config_module="moetrain.conf", version_base="1.3"):
        return checked(hydra.compose(config_name="config", overrides=overrides))


@pytest.mark.parametrize(
    "overrides, expected_gate",
    [
        (["+recipe=moe_1b5_h200_lm"], "TopKGate"),
        (["+recipe=kimi_k2_lm", "model=kimi_k2"], "SigmoidGate"),
        (["+recipe=kimi_k2_lm", "model=deepseek_v3"], "SigmoidGate"),
        (["+recipe=qwen3_moe_lm", "model=qwen3_moe_30b_a3b"], "TopKGate"),
        (["+recipe=deepseek_moe_lm", "model=deepseek_moe_16b"], "TopKGate"),
        (["+recipe=qwen3_moe_lm", "model=switch_base", "gate=switch"], "TopKGate"),
        (["+recipe=qwen3_moe_lm", "model=gshard_600b"], "TopKGate"),
        (["+recipe=qwen3_moe_lm", "model=switch_tiny", "gate=switch"], "TopKGate"),
        (["+recipe=qwen3_moe_lm", "model=gshard_tiny", "gate=gshard"], "TopKGate"),
        (["+recipe=qwen3_moe_lm", "model=deepseek_v3_tiny", "gate=cosine"], "CosineGate"),
    ],
)
def test_lm_options_compose_and_build(overrides, expected_gate):
    config = compose(overrides)
    # As moetrain.cli builds it: the data fixes what the model config leaves open.
    data_inputs = {"vocab_size": config.data["vocab_size"], "max_seq_len": config.data["seq_len"]}
    model_inputs = {key: value for key, value in data_inputs.items() if key not in config.model}
    with torch.device("meta"):
        model = instantiate(config.model, **model_inputs, moe_kwargs=layer_kwargs(dataclasses.asdict(config.gate)), _convert_="all")
    assert isinstance(model, MoETransformerLM)
    layers = moe_layers(model)
    assert {type(layer.gate).__name__ for layer in layers} == {expected_gate}
    assert all(layer.top_k == config.gate.top_k for layer in layers)
    total, active = parameter_counts(model)
    assert 0 < active < total
