"""A model routes as its own architecture does: every model option, built through the command with no
recipe and no gate key, gets the published routing of that model (the table below, from the papers
and the Hugging Face config.json files, not from moetrain's presets); gate.KEY=VALUE changes that
key and nothing else; a gate option switches the gate; --cfg job prints the routing that runs; and
`moetrain model=deepseek_v3_tiny` trains with the sigmoid, group-limited gate."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch
import yaml

from moetrain import cli
from moetrain.models.presets import PRESETS
from moetrain.models.routing_settings import layer_kwargs
from moetrain.moe import GATES, MoELayer, moe_layers

# Published routing: gate, top-k, weights renormalised, (groups, groups kept), routed scaling, expert
# capacity per token count T and expert count E (None: dropless).
#   Switch Transformer (Fedus et al. 2021): softmax top-1, the raw probability as weight, capacity factor 1.
#   GShard (Lepikhin et al. 2020): softmax top-2, the two weights renormalised, capacity 2T/E.
#   DeepSeekMoE 16B: softmax top-6 of 64, no renormalisation (norm_topk_prob false), dropless.
#   DeepSeek-V3 config.json: sigmoid, top-8, norm_topk_prob, n_group 8, topk_group 4, scaling 2.5.
#   Qwen3-30B-A3B config.json: softmax top-8 of 128, norm_topk_prob true, dropless.
#   Kimi-K2 config.json: sigmoid, top-8, norm_topk_prob, n_group 1, topk_group 1, scaling 2.827.
# The tiny variants keep the kind, the renormalisation, the scaling and the capacity rule with fewer
# experts: top-4 (top-1 / top-2 for Switch / GShard), DeepSeek-V3's tiny 4 groups of which 2 are kept.
switch_capacity = lambda T, E: math.ceil(T / E)  # noqa: E731  capacity factor 1 per choice
gshard_capacity = lambda T, E: 2 * math.ceil(T / E)  # noqa: E731
PUBLISHED = {
    "switch_base": ("TopKGate", 1, False, None, 1.0, switch_capacity),
    "gshard_600b": ("TopKGate", 2, True, None, 1.0, gshard_capacity),
    "deepseek_moe_16b": ("TopKGate", 6, False, None, 1.0, None),
    "deepseek_v3": ("SigmoidGate", 8, True, (8, 4), 2.5, None),
    "qwen3_moe_30b_a3b": ("TopKGate", 8, True, None, 1.0, None),
    "kimi_k2": ("SigmoidGate", 8, True, (1, 1), 2.827, None),
    "moe_1b5": ("TopKGate", 2, True, None, 1.0, None),  # moetrain's own, with Qwen3's routing
    "switch_tiny": ("TopKGate", 1, False, None, 1.0, switch_capacity),
    "gshard_tiny": ("TopKGate", 2, True, None, 1.0, gshard_capacity),
    "deepseek_moe_tiny": ("TopKGate", 4, False, None, 1.0, None),
    "deepseek_v3_tiny": ("SigmoidGate", 4, True, (4, 2), 2.5, None),
    "qwen3_moe_tiny": ("TopKGate", 4, True, None, 1.0, None),
    "kimi_k2_tiny": ("SigmoidGate", 4, True, (1, 1), 2.827, None),
}
LM_DATA = ["data=synthetic_lm", "data.train_size=64", "data.eval_size=16", "data.seq_len=32"]


def test_the_table_covers_every_preset():
    assert set(PUBLISHED) == set(PRESETS)


def build_through_the_command(compose, overrides: list[str]) -> tuple[object, torch.nn.Module]:
    """The config as `moetrain OVERRIDES` checks it, and the model it builds (full sizes on the meta device)."""
    config = cli.checked(compose(overrides))
    data = cli._build_data(config)
    tiny = config.model.get("preset", "").endswith("_tiny") or "preset" not in config.model
    with torch.device("cpu" if tiny else "meta"):
        return config, cli.build_model(config, data)


def routed_rows(layer: MoELayer, tokens: int) -> int | None:
    """Rows per expert of one forward call: the padded capacity, or None when dropless."""
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(tokens, layer.model_dim))
    return layer.stats.padded_capacity


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_every_preset_routes_as_published_without_a_recipe(compose, preset):
    gate, top_k, normalize, groups, scaling, capacity = PUBLISHED[preset]
    config, model = build_through_the_command(compose, [f"model={preset}", *LM_DATA, "gate.impl=torch"])
    layers = moe_layers(model)
    assert layers
    for layer in layers:
        assert type(layer.gate).__name__ == gate
        assert layer.top_k == top_k
        assert layer.gate.normalize == normalize
        if gate == "SigmoidGate":
            assert (layer.gate.n_group, layer.gate.topk_group) == groups
            assert layer.gate.routed_scaling_factor == scaling
        assert (layer.capacity_factor == 0) == (capacity is None)
    # The printed config says the same (what --cfg job shows).
    assert (config.gate.type, config.gate.top_k) == (gate.replace("TopKGate", "top").replace("SigmoidGate", "sigmoid"),
                                                     top_k)
    if preset.endswith("_tiny"):  # the capacity rule, on a real forward call
        tokens = 37
        want = capacity(tokens, layers[0].num_experts) if capacity else None
        assert routed_rows(layers[0], tokens) == want


@pytest.mark.parametrize("key, value", [("top_k", 2), ("capacity_factor", 1.5), ("n_group", 2),
                                        ("routed_scaling_factor", 1.25), ("balance_loss_weight", 0.5)])
def test_a_gate_key_changes_only_that_key(compose, key, value):
    base = cli.checked(compose(["model=deepseek_v3_tiny", *LM_DATA]))
    changed = cli.checked(compose(["model=deepseek_v3_tiny", *LM_DATA, f"gate.{key}={value}"]))
    before, after = dataclasses.asdict(base.gate), dataclasses.asdict(changed.gate)
    assert after[key] == value and before[key] != value
    assert {k: v for k, v in after.items() if k != key} == {k: v for k, v in before.items() if k != key}
    layer = moe_layers(cli.build_model(changed, cli._build_data(changed)))[0]
    assert getattr(layer, key, getattr(layer.gate, key, None)) == value


def test_a_gate_option_switches_the_gate_and_keeps_the_models_top_k(compose):
    config = cli.checked(compose(["model=deepseek_v3_tiny", *LM_DATA, "gate=top"]))
    layer = moe_layers(cli.build_model(config, cli._build_data(config)))[0]
    assert type(layer.gate).__name__ == "TopKGate" and layer.top_k == 4 and layer.capacity_factor == 0
    assert layer.gate.normalize is False  # the top gate's default: the sigmoid gate's settings are gone


def test_a_setting_of_another_gate_is_refused_in_one_line(compose):
    with pytest.raises(cli.ConfigError, match="gate.n_group applies to gate.type=sigmoid only, not top: remove gate.n_group"):
        cli.checked(compose(["model=deepseek_v3_tiny", *LM_DATA, "gate.type=top"]))


def test_every_registered_gate_setting_is_a_key_that_reaches_the_gate(compose):
    for name, gate_class in GATES.items():
        for setting in dataclasses.fields(gate_class.Settings):
            value = {bool: not setting.default, int: setting.default + 1}.get(type(setting.default),
                                                                             setting.default * 2 + 0.5)
            # Two of four experts' groups, so that a second group may be kept (topk_group <= n_group).
            groups = ["gate.n_group=2"] if "n_group" in GATES[name].Settings.__dataclass_fields__ else []
            config = cli.checked(compose([f"gate={name}", *groups, f"gate.{setting.name}={value}", "gate.impl=torch"]))
            routing = layer_kwargs(dataclasses.asdict(config.gate))
            assert routing["gate"] == name and routing["gate_kwargs"][setting.name] == value
            layer = MoELayer(8, 4, 8, **routing)
            assert type(layer.gate) is gate_class
            if hasattr(layer.gate, setting.name):
                assert getattr(layer.gate, setting.name) == value


def test_cfg_job_prints_the_routing_that_runs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["moetrain", "model=deepseek_v3_tiny", "gate.top_k=2", "--cfg", "job"])
    cli.main()
    gate = yaml.safe_load(capsys.readouterr().out)["gate"]
    assert (gate["type"], gate["top_k"], gate["n_group"], gate["topk_group"], gate["routed_scaling_factor"],
            gate["capacity_factor"]) == ("sigmoid", 2, 4, 2, 2.5, 0.0)


def test_deepseek_v3_tiny_trains_with_its_sigmoid_grouped_gate(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "moetrain", "model=deepseek_v3_tiny", *LM_DATA, "trainer.max_steps=5", "logger=none",
         "trainer.progress_bar=false", "gate.impl=torch", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (checkpoint,) = (run_dir / "checkpoints").glob("step_*.pt")
    state = torch.load(checkpoint, weights_only=False)
    assert state["config"]["gate"]["type"] == "sigmoid" and state["config"]["gate"]["n_group"] == 4
    biases = [value for key, value in state["model"].items() if key.endswith("gate.expert_bias")]
    # The aux-loss-free balancing ran: after 5 steps every bias moved by whole multiples of the rate.
    assert biases and all(bias.abs().max() > 0 for bias in biases)
    for bias in biases:
        steps = bias / 1e-3
        assert torch.allclose(steps, steps.round(), atol=1e-3)
