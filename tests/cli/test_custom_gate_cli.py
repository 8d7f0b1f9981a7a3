"""User code from the command line, through config only: a gate class and an experts class
written in THIS file are trained by the `moetrain` command (gate._target_ with +gate.kwargs, and a
model._target_ builder that swaps the experts). Also `moetrain --version` and the help listing.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_RUN, TINY_SYNTHETIC

import moetrain
from moetrain import cli
from moetrain.config import ConfigError
from moetrain.moe import EXPERTS, GATES, Experts, Gate, GateOutput, moe_layers
from moetrain.models import VisionMoE
from moetrain.ops.grouped import expert_matmul


class ShiftedRoundRobinGate(Gate):
    """Token t goes to experts (t + first_expert + j) % E for j < top_k, weights 1/top_k. Its
    buffers record the constructor argument and the training calls, so the checkpoint shows that
    the command built and ran this gate."""

    def __init__(self, model_dim: int, num_experts: int, first_expert: int = 0):
        super().__init__(model_dim, num_experts)
        self.register_buffer("first_expert", torch.tensor(first_expert))
        self.register_buffer("training_calls", torch.tensor(0))

    def forward(self, x_TD: torch.Tensor, top_k: int) -> GateOutput:
        tokens = x_TD.size(0)
        if self.training:
            self.training_calls += 1
        offset_TK = torch.arange(tokens, device=x_TD.device)[:, None] + torch.arange(top_k, device=x_TD.device)
        idx_TK = (offset_TK + self.first_expert) % self.num_experts
        logits_TE = torch.zeros(tokens, self.num_experts, device=x_TD.device)
        probs_TE = torch.full_like(logits_TE, 1.0 / self.num_experts)
        weight_TK = torch.full((tokens, top_k), 1.0 / top_k, device=x_TD.device)
        return GateOutput(logits_TE, probs_TE, idx_TK, weight_TK)


class BiasFreeExperts(Experts):
    """act(x @ w_in) @ w_out per expert, no biases."""

    def __init__(self, num_experts: int, model_dim: int, hidden_size: int, activation: str = "gelu"):
        super().__init__(num_experts, model_dim, hidden_size)
        self.w_in_EDH = torch.nn.Parameter(torch.randn(num_experts, model_dim, hidden_size) * model_dim**-0.5)
        self.w_out_EHD = torch.nn.Parameter(torch.randn(num_experts, hidden_size, model_dim) * hidden_size**-0.5)
        for param in self.parameters():
            param.moe_expert = True

    def forward(self, x_RD, counts_E, capacity):
        h_RH = torch.nn.functional.gelu(expert_matmul(x_RD, self.w_in_EDH, counts_E, capacity))
        return expert_matmul(h_RH, self.w_out_EHD, counts_E, capacity)


def vision_moe_with_bias_free_experts(**kwargs) -> VisionMoE:
    """A model builder for model._target_: the preset's VisionMoE with every layer's experts swapped."""
    model = VisionMoE(**kwargs)
    for layer in moe_layers(model):
        layer.experts = BiasFreeExperts(layer.num_experts, layer.model_dim, layer.experts.hidden_size)
    return model


def run_moetrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # This file's folder on the path: how a user makes their own module importable (and tests/, for
    # the conftest this file imports).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                   str(Path(__file__).parent.parent),
                                                                   os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "moetrain", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


SHORT_RUN = ["+recipe=quickstart", *TINY_RUN, *TINY_SYNTHETIC]


def test_custom_gate_and_experts_from_config_only(tmp_path):
    proc = run_moetrain(*SHORT_RUN, "gate._target_=test_custom_gate_cli.ShiftedRoundRobinGate",
                        "+gate.kwargs.first_expert=3",
                        "model._target_=test_custom_gate_cli.vision_moe_with_bias_free_experts",
                        f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (checkpoint,) = (tmp_path / "run" / "checkpoints").glob("step_*.pt")
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    weights = state["model"]
    gate_buffers = sorted(key for key in weights if key.endswith("gate.first_expert"))
    layers = len(gate_buffers)
    assert layers >= 1
    for key in gate_buffers:
        assert int(weights[key]) == 3  # +gate.kwargs.first_expert=3 reached the constructor
        # Every training forward went through this gate: 3 steps of one micro-batch each.
        assert int(weights[key.replace("first_expert", "training_calls")]) == 3
    assert not any(key.endswith("weight_ED") for key in weights)  # no built-in router was built
    assert sum(key.endswith("experts.w_in_EDH") for key in weights) == layers
    assert not any(key.endswith("experts.w1") for key in weights)
    assert state["config"]["gate"]["_target_"] == "test_custom_gate_cli.ShiftedRoundRobinGate"


@pytest.mark.parametrize("overrides, expected", [
    (["gate._target_=test_custom_gate_cli.NoSuchGate"], "gate._target_=test_custom_gate_cli.NoSuchGate cannot be imported"),
    (["gate._target_=test_custom_gate_cli.BiasFreeExperts"], "is not a moetrain.moe.Gate subclass"),
    (["+gate.kwargs.first_expert=3"], "set gate._target_=your_module.YourGate"),
])
def test_bad_gate_config_is_refused_while_composing(overrides, expected):
    # The command's own check of a command line, in this process (each case would otherwise cost
    # an interpreter start); it raises the one-line error the command prints with exit code 2.
    cli.register_configs()
    with pytest.raises(ConfigError, match=re.escape(expected)):
        cli.check_command_line(["+recipe=quickstart", *overrides], multirun=False)


def test_version(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["moetrain", "--version"])
    cli.main()
    assert capsys.readouterr().out.startswith(f"moetrain {moetrain.__version__} (torch ")


def test_help_lists_gates_experts_models_datasets_recipes(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["moetrain", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 0
    listed = {}  # the first line starting "NAME:" (the composed config printed below repeats names)
    for line in capsys.readouterr().out.splitlines():
        listed.setdefault(line.split(":")[0], line)
    assert all(name in listed["gate.type"] for name in GATES)
    assert all(name in listed["model.expert"] for name in EXPERTS)
    assert "gate._target_" in listed["gate.type"]
    for group, name in (("model", "vit_tiny"), ("data", "synthetic"), ("recipe", "quickstart"), ("gate", "gshard")):
        assert name in listed[group], group
