"""Packed documents keep to themselves (data.document_mask=true): each document's logits in a packed
row equal that document run alone, with rotary positions restarting at each document, on every
attention kind (multi-head, grouped-query, latent) and with activation checkpointing; the masks
and positions against naive loops; flex attention on CUDA against the CPU reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import Device, LoggerConfig, OptimConfig, TrainerConfig
from moetrain.data.base import DataModule
from moetrain.data.text import PackedSequences
from moetrain.models import build_lm
from moetrain.models.layers import document_mask, document_positions
from moetrain.models.presets import PRESETS
from moetrain.moe import set_activation_checkpointing
from moetrain.train import Trainer

PRESET_NAMES = ["qwen3_moe_tiny", "deepseek_v3_tiny", "kimi_k2_tiny", "switch_tiny"]


def tiny_lm(name: str, vocab_size: int = 64, seed: int = 0):
    torch.manual_seed(seed)
    # Dropless: under a capacity limit whether a token keeps its expert depends on the whole batch.
    return build_lm(name, vocab_size=vocab_size, max_seq_len=32, moe_kwargs={**PRESETS[name].moe_kwargs,
                                                                           "capacity_factor": 0})


def packed_row(lengths: list[int], vocab_size: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens_1T = torch.randint(vocab_size, (1, sum(lengths)), generator=generator)
    documents_1T = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    return tokens_1T, documents_1T


def test_positions_and_mask_match_naive_loops():
    documents_BT = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3, 3]])
    expected_positions = [[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 0, 1, 2, 3, 4, 0, 0, 1]]
    assert document_positions(documents_BT).tolist() == expected_positions
    mask_B1TS = document_mask(documents_BT, causal=True, flex=False)
    for b in range(2):
        for q in range(9):
            for k in range(9):
                allowed = documents_BT[b, q] == documents_BT[b, k] and k <= q
                assert bool(mask_B1TS[b, 0, q, k]) == allowed


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_each_packed_document_gives_its_logits_alone(name):
    model = tiny_lm(name).eval()
    lengths = [5, 11, 1, 8, 7]
    tokens_1T, documents_1T = packed_row(lengths)
    with torch.no_grad():
        packed_1TV = model(tokens_1T, document_ids=documents_1T)
        alone_1TV = torch.cat([model(piece[None]) for piece in tokens_1T[0].split(lengths)], dim=1)
        unmasked_1TV = model(tokens_1T)
    torch.testing.assert_close(packed_1TV, alone_1TV, rtol=1e-5, atol=1e-5)
    # What must differ: without the mask, every document after the first sees the ones before it.
    assert torch.allclose(unmasked_1TV[:, :5], alone_1TV[:, :5], atol=1e-5)
    assert not torch.allclose(unmasked_1TV[:, 5:], alone_1TV[:, 5:], atol=1e-3)


@pytest.mark.parametrize("name", ["qwen3_moe_tiny", "deepseek_v3_tiny"])
def test_rotary_positions_restart_at_each_document(name):
    """The choice, pinned directly: rotary attention depends on relative positions only, so the
    logits of a masked document agree (to rounding) whether positions restart or run on; what the
    attention gets are the tables of each position within its own document."""
    model = tiny_lm(name).eval()
    lengths = [5, 11, 1, 8]
    tokens_1T, documents_1T = packed_row(lengths)
    seen = []
    hook = model.blocks[0].attn.register_forward_hook(lambda module, args, output: seen.append(args[1]))
    with torch.no_grad():
        model(tokens_1T, document_ids=documents_1T)
    hook.remove()
    cos, sin = seen[0]
    within = [position for length in lengths for position in range(length)]
    assert torch.equal(cos[0, 0], model.rotary_cos[within]) and torch.equal(sin[0, 0], model.rotary_sin[within])


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_gradients_through_the_mask_equal_separate_documents(mode):
    lengths = [6, 10]
    tokens_1T, documents_1T = packed_row(lengths, seed=3)
    targets_1T = tokens_1T.roll(-1, 1)
    packed, alone = tiny_lm("qwen3_moe_tiny"), tiny_lm("qwen3_moe_tiny")
    set_activation_checkpointing(packed, mode)
    F.cross_entropy(packed(tokens_1T, document_ids=documents_1T)[0], targets_1T[0], reduction="sum").backward()
    logits = [alone(piece[None])[0] for piece in tokens_1T[0].split(lengths)]
    F.cross_entropy(torch.cat(logits), targets_1T[0], reduction="sum").backward()
    for (name, p), q in zip(packed.named_parameters(), alone.parameters()):
        if p.grad is not None or q.grad is not None:
            # float32 sums in another order: agreement to ~1e-6 of the gradient's scale
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5 * float(q.grad.abs().max()), msg=name)


def test_the_trainer_passes_document_ids_to_the_model(tmp_path):
    stream = torch.randint(64, (400,)).numpy()
    ends = torch.arange(7, 401, 9).numpy()  # documents of 9 tokens
    data = DataModule("language_modeling", PackedSequences(stream[:300], 16, ends[ends <= 300]),
                      PackedSequences(stream[300:], 16, ends[ends > 300] - 300), batch_size=2, eval_batch_size=2,
                      num_workers=0, model_inputs={})
    model = tiny_lm("qwen3_moe_tiny")
    seen = []
    forward = model.forward

    def recording(tokens_BT, document_ids=None):
        seen.append(None if document_ids is None else document_ids.clone())
        return forward(tokens_BT, document_ids=document_ids)

    model.forward = recording
    trainer = Trainer(model, data, trainer=TrainerConfig(max_steps=2, eval_every=0, eval_batches=1, checkpoint_every=0,
                                                         progress_bar=False, device=Device.cpu),
                      optim=OptimConfig(), logger=LoggerConfig(tensorboard=False), run_dir=tmp_path, seed=0,
                      run_config={})
    trainer.fit()
    assert len(seen) == 3 and all(ids is not None and ids.shape == (2, 16) for ids in seen)  # 2 steps, 1 eval batch
    assert all(bool((ids[:, 1:] - ids[:, :-1] >= 0).all()) and ids[:, 0].eq(0).all() for ids in seen)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["qwen3_moe_tiny", "deepseek_v3_tiny"])
def test_flex_attention_matches_the_cpu_reference(name):
    model = tiny_lm(name).eval()
    tokens_1T, documents_1T = packed_row([9, 4, 13, 6])
    tokens_BT, documents_BT = tokens_1T.repeat(2, 1), documents_1T.repeat(2, 1)
    with torch.no_grad():
        reference = model(tokens_BT, document_ids=documents_BT)
        flex = model.cuda()(tokens_BT.cuda(), document_ids=documents_BT.cuda()).cpu()
    torch.testing.assert_close(flex, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_a_compiled_model_with_document_ids_matches_eager():
    model = tiny_lm("qwen3_moe_tiny").cuda().eval()
    tokens_1T, documents_1T = packed_row([9, 4, 13, 6])
    tokens_BT, documents_BT = tokens_1T.repeat(2, 1).cuda(), documents_1T.repeat(2, 1).cuda()
    with torch.no_grad():
        eager = model(tokens_BT, document_ids=documents_BT)
        compiled = torch.compile(model)(tokens_BT, document_ids=documents_BT)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_a_compiled_training_step_with_document_ids_has_the_eager_gradients():
    eager_model = tiny_lm("qwen3_moe_tiny").cuda()
    compiled_model = tiny_lm("qwen3_moe_tiny").cuda()
    tokens_1T, documents_1T = packed_row([9, 4, 13, 6])
    tokens_BT, documents_BT = tokens_1T.repeat(2, 1).cuda(), documents_1T.repeat(2, 1).cuda()
    targets_BT = tokens_BT.roll(-1, dims=1)
    for model in (eager_model, torch.compile(compiled_model)):
        F.cross_entropy(model(tokens_BT, document_ids=documents_BT).flatten(0, 1), targets_BT.flatten()).backward()
    for (name, eager), compiled in zip(eager_model.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(compiled.grad, eager.grad, rtol=1e-4, atol=1e-5, msg=name)
