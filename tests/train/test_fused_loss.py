"""trainer.fused_loss: the fused LM head + loss trains a language model to the weights that the
logits and F.cross_entropy give, also with gradient accumulation (SGD: Adam would magnify the
rounding of near-zero gradients), and the model's forward with targets (and packed documents)
returns the loss of its logits with the same gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import Device, LoggerConfig, OptimConfig, OptimizerName, TrainerConfig
from moetrain.data.base import DataModule
from moetrain.data.text import PackedSequences
from moetrain.models import build_lm
from moetrain.models.presets import PRESETS
from moetrain.train import Trainer


def tiny_lm(seed: int):
    torch.manual_seed(seed)
    return build_lm("qwen3_moe_tiny", vocab_size=64, max_seq_len=16,
                    moe_kwargs={**PRESETS["qwen3_moe_tiny"].moe_kwargs, "capacity_factor": 0})


def train(tmp_path, fused: bool, seed: int, **trainer_settings):
    generator = torch.Generator().manual_seed(seed)
    stream = torch.randint(64, (600,), generator=generator).numpy()
    ends = torch.arange(10, 601, 11).numpy()
    data = DataModule("language_modeling", PackedSequences(stream[:500], 16, ends[ends <= 500]),
                      PackedSequences(stream[500:], 16, ends[ends > 500] - 500), batch_size=2, eval_batch_size=2,
                      num_workers=0, model_inputs={})
    model = tiny_lm(seed)
    trainer = Trainer(model, data, trainer=TrainerConfig(max_steps=3, eval_every=0, eval_batches=1, checkpoint_every=0,
                                                         progress_bar=False, device=Device.cpu, fused_loss=fused,
                                                         **trainer_settings),
                      optim=OptimConfig(name=OptimizerName.sgd, lr=0.5), logger=LoggerConfig(tensorboard=False, log_every=1),
                      run_dir=tmp_path / ("fused" if fused else "unfused"), seed=seed, run_config={})
    trainer.fit()
    return model, trainer


@pytest.mark.parametrize("settings", [{}, {"grad_accum_steps": 2}])
def test_fused_and_unfused_losses_train_to_the_same_weights(tmp_path, settings):
    seed = int(torch.randint(1000, ()))
    fused, fused_trainer = train(tmp_path, True, seed, **settings)
    unfused, unfused_trainer = train(tmp_path, False, seed, **settings)
    assert fused_trainer.fused_loss and not unfused_trainer.fused_loss
    moved = False
    for (name, a), b, start in zip(fused.state_dict().items(), unfused.state_dict().values(),
                                   tiny_lm(seed).state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
        moved |= not torch.equal(a, start)
    assert moved  # the steps did change the weights


def test_forward_with_targets_is_the_loss_of_the_logits_with_its_gradients():
    model = tiny_lm(int(torch.randint(1000, ())))
    tokens_BT = torch.randint(64, (3, 16))
    targets_BT = tokens_BT.roll(-1, dims=1)
    targets_BT[:, -1] = -100
    documents_BT = torch.arange(16).div(5, rounding_mode="floor").expand(3, 16)
    loss = model(tokens_BT, document_ids=documents_BT, targets=targets_BT)
    loss.backward()
    fused_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(tokens_BT, document_ids=documents_BT)
    reference = F.cross_entropy(logits.flatten(0, 1), targets_BT.flatten(), ignore_index=-100)
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    for fused, (name, param) in zip(fused_grads, model.named_parameters()):
        torch.testing.assert_close(fused, param.grad, rtol=1e-4, atol=1e-6, msg=name)
