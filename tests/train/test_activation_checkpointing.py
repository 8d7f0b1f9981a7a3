"""Activation checkpointing (moetrain.moe.recompute) changes no number: a model trained a few steps
with trainer.activation_checkpointing=selective or full gives bit-identical losses, gradients, aux
losses, routing statistics and router biases to the same model without it (fp32, CPU), with router
jitter, dropout and a sigmoid gate whose bias moves; the routing is built once per forward (never
again in the recomputation), and checkpointing really keeps fewer activations."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F

from moetrain.models.lm import LMConfig, MoETransformerLM
from moetrain.moe import layer as moe_layer_module
from moetrain.moe import moe_layers, set_activation_checkpointing, update_router_biases
from moetrain.moe import Experts, MoELayer
from moetrain.moe.experts import mark_expert
from moetrain.ops.grouped import expert_matmul

GATES = {
    "top+jitter, padded": dict(gate="top", gate_kwargs={"jitter_eps": 0.2}, capacity_factor=1.0),
    "sigmoid+bias, dropless": dict(gate="sigmoid", gate_kwargs={"bias_update_rate": 0.05}, capacity_factor=0.0,
                                   balance_loss="sequence",
                                   z_loss_weight=0.01),
}
STEPS = 3


def make_model(moe_kwargs: dict, expert: str) -> MoETransformerLM:
    torch.manual_seed(0)
    config = LMConfig(vocab_size=24, dim=16, depth=2, num_heads=2, num_experts=4, expert_hidden_size=12,
                      expert=expert, activation="silu" if expert == "swiglu" else "relu", num_shared_experts=1,
                      dropout=0.1, max_seq_len=16, moe_kwargs={**moe_kwargs, "top_k": 2, "impl": "torch"})
    return MoETransformerLM(config)


def train(model: MoETransformerLM, mode: str) -> list[dict]:
    set_activation_checkpointing(model, mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    history = []
    for step in range(STEPS):
        tokens = torch.randint(0, 24, (3, 9), generator=data)
        torch.manual_seed(100 + step)  # jitter and dropout draw from the global generator
        logits = model(tokens[:, :-1])
        task = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        aux = sum(layer.aux_loss for layer in moe_layers(model))
        (task + aux).backward()
        history.append({
            "loss": task.detach().clone(), "aux": [layer.aux_loss.detach().clone() for layer in moe_layers(model)],
            "grads": {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None},
            "stats": [(layer.stats.tokens_per_expert.clone(), layer.stats.kept_per_expert.clone(),
                       layer.stats.balance_loss.clone(), layer.stats.router_logits.clone())
                      for layer in moe_layers(model)],
            # The sigmoid gate's load counted since the last bias update (once, not again when recomputed).
            "buffers before update": {name: b.clone() for name, b in model.named_buffers()},
        })
        optimizer.step()
        optimizer.zero_grad()
        update_router_biases(model)
        history[-1]["buffers"] = {name: b.clone() for name, b in model.named_buffers()}
    return history


def assert_identical(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and torch.equal(a, b), f"{where}: differs by {(a.float() - b.float()).abs().max()}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}.{key}")
    else:
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{index}]")


@pytest.mark.parametrize("expert", ["ffn", "swiglu"])
@pytest.mark.parametrize("gate", list(GATES))
def test_checkpointing_changes_no_number(gate, expert):
    model = make_model(GATES[gate], expert)
    reference = train(copy.deepcopy(model), "none")
    for mode in ("selective", "full"):
        assert_identical(train(copy.deepcopy(model), mode), reference, mode)
    if gate.startswith("sigmoid"):  # the bias comparison is not vacuous: it moved, and by one count per step
        bias = reference[-1]["buffers"]["blocks.0.ffn.gate.expert_bias"]
        assert bias.abs().sum() > 0 and bias.abs().max() <= STEPS * 0.05 + 1e-6


def _saved_bytes_and_plans(model, mode, monkeypatch) -> tuple[int, int]:
    """Bytes the forward keeps for backward, and routing plans built in forward + backward."""
    set_activation_checkpointing(model, mode)
    plans = []
    real = moe_layer_module.make_plan
    monkeypatch.setattr(moe_layer_module, "make_plan", lambda *a, **k: plans.append(1) or real(*a, **k))
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    tokens = torch.randint(0, 24, (4, 16), generator=torch.Generator().manual_seed(2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(tokens)
    recorded = sum(saved)
    (logits.square().mean() + sum(layer.aux_loss for layer in moe_layers(model))).backward()
    return recorded, len(plans)


def test_checkpointing_keeps_less_and_routes_once(monkeypatch):
    model = make_model(GATES["sigmoid+bias, dropless"], "swiglu")
    kept = {}
    for mode in ("none", "selective", "full"):
        kept[mode], plans = _saved_bytes_and_plans(copy.deepcopy(model), mode, monkeypatch)
        assert plans == 2, (mode, plans)  # one plan per MoE layer: the recomputation replays it
    assert kept["full"] < kept["selective"] < kept["none"], kept


def test_selective_runs_the_closing_gemms_once(monkeypatch):
    """selective recomputes attention up to its output projection and the experts' hidden part
    (first GEMM and activation); the GEMMs that close them run once, their inputs kept."""
    model = make_model(GATES["sigmoid+bias, dropless"], "swiglu")
    set_activation_checkpointing(model, "selective")
    calls = collections.Counter()

    def counted(name, function):
        def run(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return run

    for block in model.blocks:
        for name in ("q_proj", "o_proj"):
            getattr(block.attn, name).register_forward_hook(lambda *args, name=name: calls.update([name]))
        for part in ("hidden", "project"):
            monkeypatch.setattr(block.ffn.experts, part, counted(part, getattr(block.ffn.experts, part)))
    tokens = torch.randint(0, 24, (2, 8), generator=torch.Generator().manual_seed(3))
    logits = model(tokens)
    blocks = len(model.blocks)
    assert calls == {"q_proj": blocks, "o_proj": blocks, "hidden": blocks, "project": blocks}
    (logits.square().mean() + sum(layer.aux_loss for layer in moe_layers(model))).backward()
    assert calls == {"q_proj": 2 * blocks, "o_proj": blocks, "hidden": 2 * blocks, "project": blocks}


class WholeExperts(Experts):
    """Custom experts with their own forward (a tanh MLP): recomputed whole."""

    def __init__(self, num_experts, model_dim, hidden_size, activation="relu"):
        super().__init__(num_experts, model_dim, hidden_size)
        self.w_in = mark_expert(torch.nn.Parameter(torch.randn(num_experts, model_dim, hidden_size) * 0.3))
        self.w_out = mark_expert(torch.nn.Parameter(torch.randn(num_experts, hidden_size, model_dim) * 0.3))

    def forward(self, x_RD, counts_E, capacity):
        h_RH = torch.tanh(expert_matmul(x_RD, self.w_in, counts_E, capacity))
        return expert_matmul(h_RH, self.w_out, counts_E, capacity)


class SplitExperts(WholeExperts):
    """The same experts written as hidden + project: only the hidden part is recomputed."""

    forward = Experts.forward

    def hidden(self, x_RD, counts_E, capacity):
        return torch.tanh(expert_matmul(x_RD, self.w_in, counts_E, capacity))

    def project(self, h_RH, counts_E, capacity):
        return expert_matmul(h_RH, self.w_out, counts_E, capacity)


@pytest.mark.parametrize("experts", [WholeExperts, SplitExperts])
def test_custom_experts_recompute_bit_identically(experts):
    """Custom experts under selective: with their own forward (recomputed whole) or as hidden +
    project (the hidden part alone); either way the same numbers as without checkpointing."""
    torch.manual_seed(4)
    layer = MoELayer(model_dim=8, num_experts=3, hidden_size=6, top_k=2, capacity_factor=0.0, expert=experts,
                     impl="torch")
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(5))
    runs = {}
    for mode in ("none", "selective"):
        model = copy.deepcopy(layer)
        set_activation_checkpointing(model, mode)
        inputs = x.clone().requires_grad_()
        (model(inputs).square().sum() + model.aux_loss).backward()
        runs[mode] = [inputs.grad] + [p.grad for p in model.parameters()]
    assert_identical(runs["selective"], runs["none"], experts.__name__)


def test_bad_mode_and_model_without_blocks_are_refused():
    model = make_model(GATES["top+jitter, padded"], "ffn")
    with pytest.raises(ValueError, match=r"activation_checkpointing must be one of \['none', 'selective', 'full'\]"):
        set_activation_checkpointing(model, "partial")
    with pytest.raises(ValueError, match="full recomputes transformer blocks and this model has none"):
        set_activation_checkpointing(moe_layers(model)[0], "full")


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_trainer_setting_trains_bit_identically(tmp_path, mode):
    """trainer.activation_checkpointing through the Trainer: the ViT of test_resume (jitter, dropout)."""
    from test_resume import tiny_trainer

    from moetrain.config import ActivationCheckpointing

    for name in ("none", mode):
        (tmp_path / name).mkdir()
    plain = tiny_trainer(tmp_path / "none", max_steps=3)
    plain.fit()
    recomputed = tiny_trainer(tmp_path / mode, max_steps=3, activation_checkpointing=ActivationCheckpointing(mode))
    assert all(block.activation_checkpointing == mode for block in recomputed.model.blocks)
    recomputed.fit()
    assert recomputed.metrics["train/loss"] == plain.metrics["train/loss"]
    assert_identical(recomputed.model.state_dict(), plain.model.state_dict(), mode)
