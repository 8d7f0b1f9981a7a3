"""The decoder MoE language model and its presets: published parameter counts, hand-counted
parameter formulas, causality, gradients, FLOPs, and learning a task with a known loss floor."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_no_host_sync

from moetrain.data.text import synthetic_lm
from moetrain.models import PRESETS, build_lm, flops_per_token, parameter_counts
from moetrain.moe import is_expert_param, moe_layers, update_router_biases

# (total, active) as published, and the relative tolerance. Model cards round to two or three
# significant figures. switch_base and gshard_600b are encoder-decoder models built here
# decoder-only without cross-attention (docs/models.md), hence their wider tolerance.
PUBLISHED = {
    "deepseek_moe_16b": (16.4e9, 2.8e9, 0.02),  # DeepSeekMoE paper / model card
    "deepseek_v3": (671e9, 37e9, 0.02),  # DeepSeek-V3 technical report (MTP module excluded)
    "qwen3_moe_30b_a3b": (30.5e9, 3.3e9, 0.02),  # Qwen3-30B-A3B model card
    "kimi_k2": (1.04e12, 32e9, 0.03),  # Kimi-K2 model card / technical report
    "switch_base": (7.4e9, 0.2e9, 0.03),  # Switch Transformers, Switch-Base 128 experts; FLOP-matched T5-Base
    "gshard_600b": (600e9, None, 0.05),  # GShard MoE(2048E, 36L)
}


def meta_model(name, **overrides):
    with torch.device("meta"):
        return build_lm(name, **overrides)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_full_size_presets_match_published_parameter_counts(name):
    total, active = parameter_counts(meta_model(name))
    published_total, published_active, tolerance = PUBLISHED[name]
    assert total == pytest.approx(published_total, rel=tolerance)
    if published_active is not None:
        assert active == pytest.approx(published_active, rel=tolerance)


def test_deepseek_v3_count_by_hand():
    """Every DeepSeek-V3 tensor counted from the architecture description, not from the modules."""
    V, D, L, dense_layers, N = 129280, 7168, 61, 3, 128
    q_rank, kv_rank, nope, rope, v = 1536, 512, 128, 64, 128
    E, k, H, dense_H = 256, 8, 2048, 18432
    attention = D * q_rank + q_rank + q_rank * N * (nope + rope) + D * (kv_rank + rope) + kv_rank \
        + kv_rank * N * (nope + v) + N * v * D
    expert = 3 * D * H
    moe = E * expert + expert + E * D  # routed, one shared, router (its bias is a buffer)
    norms = 2 * D
    total = 2 * V * D + D + L * (attention + norms) + dense_layers * 3 * D * dense_H + (L - dense_layers) * moe
    active = total - (L - dense_layers) * (E - k) * expert
    assert parameter_counts(meta_model("deepseek_v3")) == (total, active)


def test_qwen3_count_by_hand():
    V, D, L, N, K, Hd, E, k, H = 151936, 2048, 48, 32, 4, 128, 128, 8, 768
    attention = D * N * Hd + 2 * D * K * Hd + N * Hd * D + 2 * Hd
    total = 2 * V * D + D + L * (attention + 2 * D + E * D + E * 3 * D * H)
    active = total - L * (E - k) * 3 * D * H
    assert parameter_counts(meta_model("qwen3_moe_30b_a3b")) == (total, active)


def test_flops_per_token_by_hand():
    model = meta_model("moe_1b5")
    _, active = parameter_counts(model)
    c = model.config
    attention = 6 * c.depth * 2048 * c.num_heads * 2 * c.head_dim
    assert flops_per_token(model, 2048) == 6 * (active - c.vocab_size * c.dim) + attention


TINY = [name for name in PRESETS if name.endswith("_tiny")]


@pytest.mark.parametrize("name", TINY)
def test_tiny_presets_are_causal_and_train_every_part(name):
    torch.manual_seed(0)
    # Dropless: under a capacity limit, whether a token keeps its expert depends on the whole
    # batch, later positions included (a known property of capacity-based routing).
    model = build_lm(name, vocab_size=64, max_seq_len=16, moe_kwargs={**PRESETS[name].moe_kwargs, "capacity_factor": 0})
    tokens = torch.randint(0, 64, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 64) and torch.isfinite(logits).all()
    # Causality, checked from the outside: changing the last 6 tokens leaves earlier logits alone.
    changed = tokens.clone()
    changed[:, 10:] = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(changed)[:, :10], logits[:, :10].detach(), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()) + sum(l.aux_loss for l in moe_layers(model))
    loss.backward()
    layers = moe_layers(model)
    assert layers and all(layer.gate.weight_ED.grad.abs().sum() > 0 for layer in layers)
    experts = [p for p in model.parameters() if is_expert_param(p)]
    assert experts and all(p.grad is not None and p.grad.abs().sum() > 0 for p in experts)
    assert model.embed.weight.grad.abs().sum() > 0


def test_tied_embeddings_share_one_tensor():
    model = build_lm("switch_tiny")
    assert model.lm_head.weight is model.embed.weight
    assert build_lm("qwen3_moe_tiny").lm_head.weight is not build_lm("qwen3_moe_tiny").embed.weight


def test_first_dense_and_moe_every_place_the_experts():
    assert [b.is_moe for b in build_lm("deepseek_v3_tiny").blocks] == [False, True, True]
    assert [b.is_moe for b in build_lm("switch_tiny").blocks] == [False, True, False, True]
    assert [b.is_moe for b in build_lm("qwen3_moe_tiny", depth=2).blocks] == [True, True]


@pytest.mark.parametrize("name", ["qwen3_moe_tiny", "deepseek_v3_tiny"])
def test_loss_approaches_the_floor_of_a_learnable_task(name):
    """synthetic_lm's best possible loss is ln(2); a model that learns gets near it quickly."""
    torch.manual_seed(0)
    data = synthetic_lm(vocab_size=32, seq_len=32, train_size=1024, eval_size=64, seed=1)
    model = build_lm(name, vocab_size=32, max_seq_len=32, dim=32, depth=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, targets = data.train_set.tensors
    for step in range(30):
        batch = slice(32 * step, 32 * step + 32)
        loss = F.cross_entropy(model(inputs[batch]).flatten(0, 1), targets[batch].flatten())
        (loss + sum(layer.aux_loss for layer in moe_layers(model))).backward()
        optimizer.step()
        optimizer.zero_grad()
        update_router_biases(model)
    eval_inputs, eval_targets = data.eval_set.tensors
    with torch.no_grad():
        eval_loss = F.cross_entropy(model(eval_inputs).flatten(0, 1), eval_targets.flatten()).item()
    assert eval_loss < math.log(2) + 0.35 < math.log(32)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"preset": "qwen3"}, "preset must be one of"),
        ({"preset": "qwen3_moe_tiny", "num_expert": 4}, r"unknown LM setting\(s\) \['num_expert'\]"),
        ({"preset": "qwen3_moe_tiny", "attention": "linear"}, "attention must be one of"),
        ({"preset": "qwen3_moe_tiny", "moe_kwargs": {"topk": 2}}, "moe_kwargs has unknown key"),
        ({"preset": "deepseek_v3_tiny", "rope_scaling": {"type": "ntk"}}, "rope_scaling must be None or a 'yarn'"),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_lm(**kwargs)


def test_sequence_longer_than_the_rotary_tables_is_refused():
    model = build_lm("qwen3_moe_tiny", max_seq_len=8)
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_throughput_metrics(monkeypatch):
    from benchmarks import lm_throughput as throughput
    from moetrain.train import metrics as train_metrics

    model = build_lm("qwen3_moe_tiny", max_seq_len=32)
    assert train_metrics.training_throughput(model, 10.0, 32, "cpu") == {"tokens_per_sec": 320.0}  # no known peak
    result = throughput.measure(model, batch_size=2, seq_len=32, steps=2, warmup=1)
    assert result["tokens_per_s"] == pytest.approx(64 / (result["step_ms"] / 1e3))
    assert result["mfu"] is None and math.isfinite(result["loss"])
    monkeypatch.setattr(train_metrics, "peak_bf16_flops", lambda device: 1e12)
    metrics = train_metrics.training_throughput(model, 10.0, 32, "cuda", world_size=2)
    assert metrics["mfu"] == pytest.approx(160.0 * flops_per_token(model, 32) / 1e12)


def test_throughput_profile_lists_the_step_s_operators(capsys):
    """--profile prints the operators of three training steps (on a CPU the host's), with the
    optimizer's among them: the profiled call is the whole step, not the forward alone."""
    from benchmarks import lm_throughput as throughput

    throughput.main(["--preset", "qwen3_moe_tiny", "--batch-size", "1", "--seq-len", "16", "--steps", "1",
                     "--warmup", "0", "--device", "cpu", "--dtype", "float32", "--profile"])
    printed = capsys.readouterr().out
    table = printed.split("\n", 1)[1]  # after the JSON line
    assert "Self CPU time total" in table and "Optimizer.step#AdamW.step" in table, table[-3000:]


def test_throughput_autocast_keeps_fp32_weights_and_computes_in_bf16():
    """--autocast (the command's precision=bf16): the step computes in bf16 (its loss is the fp32
    loss of the same weights up to bf16 rounding, not equal to it) while the weights and AdamW's
    moments it updates stay fp32."""
    from benchmarks import lm_throughput as throughput

    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = build_lm("qwen3_moe_tiny", max_seq_len=16)
    torch.manual_seed(0)
    same = build_lm("qwen3_moe_tiny", max_seq_len=16)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = throughput.training_step(model, optimizer, tokens, autocast=True).item()
    with torch.no_grad():
        full = throughput.next_token_loss(same(tokens[:, :-1]), tokens).item()
        full += sum(layer.aux_loss for layer in moe_layers(same)).item()
    assert loss != full and abs(loss - full) < 0.02 * abs(full)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(state["exp_avg"].dtype == torch.float32 for state in optimizer.state.values())


def test_qk_norm_under_autocast_stays_16_bit_on_the_fused_kernel():
    """Under bf16 autocast the q/k RMSNorm (bf16 input from its projection, fp32 weight) multiplies
    by its weight in bf16 as autocast does a Linear's: bf16 out, torch's fused kernel (no dtype
    warning), the reference formula within one bf16 rounding, and a gradient for the fp32 weight.
    Outside autocast, and for fp32 input under autocast, it is nn.RMSNorm bit for bit."""
    import warnings  # noqa: PLC0415

    from moetrain.models.layers import RMSNorm  # noqa: PLC0415

    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it cannot take the fused kernel
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = norm(x)
    assert y.dtype == torch.bfloat16
    xf = x.float()
    want = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * norm.weight.detach().bfloat16().float()
    torch.testing.assert_close(y.float(), want, rtol=2**-7, atol=1e-6)
    (grad_w,) = torch.autograd.grad(y.float().sum(), [norm.weight])
    assert grad_w.dtype == torch.float32 and grad_w.abs().sum() > 0

    plain = torch.nn.RMSNorm(64, eps=1e-6)
    plain.load_state_dict(norm.state_dict())
    x32 = torch.randn(3, 5, 64)
    assert torch.equal(norm(x32), plain(x32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 input, fp32 weight, no autocast: torch's unfused path, as before
        assert torch.equal(norm(x), plain(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(norm(x32), plain(x32))


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["qwen3_moe_tiny", "deepseek_v3_tiny"])
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16 weights", "fp32 weights under autocast"])
def test_a_training_step_never_waits_for_the_gpu(name, autocast):
    """Forward, loss and backward of a dropless tiny LM queue on the GPU without one host sync (the
    trainer's single sync per step comes after them): torch's sync debug mode turns any into an error."""
    torch.manual_seed(0)
    model = build_lm(name, vocab_size=256, max_seq_len=64, moe_kwargs={**PRESETS[name].moe_kwargs, "capacity_factor": 0})
    model = model.cuda() if autocast else model.cuda().bfloat16()
    for layer in moe_layers(model):
        layer.gate.float()  # routers stay fp32, as the trainer keeps them
    tokens = torch.randint(0, 256, (4, 64), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
            loss = loss + sum(layer.aux_loss for layer in moe_layers(model))
        loss.backward()

    assert_no_host_sync(step)
