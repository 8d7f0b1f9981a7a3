"""HF safetensors loading: tiny random checkpoints in the Qwen3-MoE, Mixtral, DeepSeek-V3 and
Kimi-K2 layouts are loaded into MoETransformerLM and its logits are compared with an independent
implementation of each architecture, written here on the raw HF tensors (explicit per-token expert
loop, explicit causal softmax attention, pairwise rotary formulas)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from moetrain.models import CheckpointError, load_hf_checkpoint
from moetrain.models.safetensors_format import SafetensorsFile, save_file
from moetrain.moe import is_expert_param


# --- writing tiny checkpoints -------------------------------------------------------------------


def random_linear(gen, out_features, in_features):
    return torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)


def random_norm(gen, size):
    return 1.0 + 0.1 * torch.randn(size, generator=gen)


def swiglu_weights(gen, prefix, dim, hidden, names=("gate_proj", "up_proj", "down_proj")):
    gate, up, down = names
    return {
        f"{prefix}.{gate}.weight": random_linear(gen, hidden, dim),
        f"{prefix}.{up}.weight": random_linear(gen, hidden, dim),
        f"{prefix}.{down}.weight": random_linear(gen, dim, hidden),
    }


def qwen3_checkpoint(gen):
    config = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
                  intermediate_size=48, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1000.0,
                  max_position_embeddings=64, tie_word_embeddings=True, decoder_sparse_step=1, mlp_only_layers=[],
                  hidden_act="silu", torch_dtype="float32")
    D, N, K, Hd = 32, 4, 2, 16
    w = {"model.embed_tokens.weight": torch.randn(64, D, generator=gen), "model.norm.weight": random_norm(gen, D)}
    for i in range(2):
        p = f"model.layers.{i}"
        w.update({
            f"{p}.input_layernorm.weight": random_norm(gen, D),
            f"{p}.post_attention_layernorm.weight": random_norm(gen, D),
            f"{p}.self_attn.q_proj.weight": random_linear(gen, N * Hd, D),
            f"{p}.self_attn.k_proj.weight": random_linear(gen, K * Hd, D),
            f"{p}.self_attn.v_proj.weight": random_linear(gen, K * Hd, D),
            f"{p}.self_attn.o_proj.weight": random_linear(gen, D, N * Hd),
            f"{p}.self_attn.q_norm.weight": random_norm(gen, Hd),
            f"{p}.self_attn.k_norm.weight": random_norm(gen, Hd),
            f"{p}.mlp.gate.weight": random_linear(gen, 8, D),
        })
        for e in range(8):
            w.update(swiglu_weights(gen, f"{p}.mlp.experts.{e}", D, 16))
    return config, w


def mixtral_checkpoint(gen):
    config = dict(model_type="mixtral", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                  rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=64, tie_word_embeddings=False,
                  sliding_window=None, hidden_act="silu", torch_dtype="float32")
    D, Hd = 32, 8
    w = {"model.embed_tokens.weight": torch.randn(64, D, generator=gen), "model.norm.weight": random_norm(gen, D),
         "lm_head.weight": random_linear(gen, 64, D)}
    for i in range(2):
        p = f"model.layers.{i}"
        w.update({
            f"{p}.input_layernorm.weight": random_norm(gen, D),
            f"{p}.post_attention_layernorm.weight": random_norm(gen, D),
            f"{p}.self_attn.q_proj.weight": random_linear(gen, 4 * Hd, D),
            f"{p}.self_attn.k_proj.weight": random_linear(gen, 2 * Hd, D),
            f"{p}.self_attn.v_proj.weight": random_linear(gen, 2 * Hd, D),
            f"{p}.self_attn.o_proj.weight": random_linear(gen, D, 4 * Hd),
            f"{p}.block_sparse_moe.gate.weight": random_linear(gen, 4, D),
        })
        for e in range(4):
            w.update(swiglu_weights(gen, f"{p}.block_sparse_moe.experts.{e}", D, 24, names=("w1", "w3", "w2")))
    return config, w


def deepseek_checkpoint(gen, model_type="deepseek_v3", q_lora_rank=16, n_group=4, topk_group=2):
    config = dict(model_type=model_type, vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                  q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                  intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
                  num_experts_per_tok=3, first_k_dense_replace=1, moe_layer_freq=1, n_group=n_group,
                  topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid",
                  topk_method="noaux_tc", rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
                  rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                  tie_word_embeddings=False, num_nextn_predict_layers=1, hidden_act="silu", torch_dtype="float32",
                  quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
    D, N = 32, 4
    w = {"model.embed_tokens.weight": torch.randn(64, D, generator=gen), "model.norm.weight": random_norm(gen, D),
         "lm_head.weight": random_linear(gen, 64, D)}
    for i in range(3):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        w.update({
            f"{p}.input_layernorm.weight": random_norm(gen, D),
            f"{p}.post_attention_layernorm.weight": random_norm(gen, D),
            f"{a}.kv_a_proj_with_mqa.weight": random_linear(gen, 16 + 4, D),
            f"{a}.kv_a_layernorm.weight": random_norm(gen, 16),
            f"{a}.kv_b_proj.weight": random_linear(gen, N * (8 + 8), 16),
            f"{a}.o_proj.weight": random_linear(gen, D, N * 8),
        })
        if q_lora_rank:
            w.update({f"{a}.q_a_proj.weight": random_linear(gen, q_lora_rank, D),
                      f"{a}.q_a_layernorm.weight": random_norm(gen, q_lora_rank),
                      f"{a}.q_b_proj.weight": random_linear(gen, N * 12, q_lora_rank)})
        else:
            w[f"{a}.q_proj.weight"] = random_linear(gen, N * 12, D)
        if i == 0:
            w.update(swiglu_weights(gen, f"{p}.mlp", D, 48))
        else:
            w[f"{p}.mlp.gate.weight"] = random_linear(gen, 8, D)
            w[f"{p}.mlp.gate.e_score_correction_bias"] = 0.1 * torch.randn(8, generator=gen)
            w.update(swiglu_weights(gen, f"{p}.mlp.shared_experts", D, 16))
            for e in range(8):
                w.update(swiglu_weights(gen, f"{p}.mlp.experts.{e}", D, 16))
    # The multi-token-prediction layer that DeepSeek-V3 ships after the last layer: skipped on load.
    w["model.layers.3.eh_proj.weight"] = random_linear(gen, D, 2 * D)
    return config, w


def write_checkpoint(directory, config, weights, fp8_names=()):
    """Two shards; the tensors named in fp8_names are stored as blockwise FP8 with scales."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    stored = dict(weights)
    for name in fp8_names:
        block = config["quantization_config"]["weight_block_size"]
        weight = weights[name]
        blocks = weight.unflatten(0, (-1, block[0])).unflatten(2, (-1, block[1]))
        scale_inv = blocks.abs().amax(dim=(1, 3)) / 448.0  # float8_e4m3 max
        expanded = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        stored[name] = (weight / expanded).to(torch.float8_e4m3fn)
        stored[name[: -len("weight")] + "weight_scale_inv"] = scale_inv
        # What the reference must use: the values the FP8 checkpoint really holds.
        weights[name] = stored[name].float() * expanded
    names = sorted(stored)
    save_file({n: stored[n] for n in names[::2]}, directory / "model-00001-of-00002.safetensors")
    save_file({n: stored[n] for n in names[1::2]}, directory / "model-00002-of-00002.safetensors")


# --- the independent reference ------------------------------------------------------------------


def rms_norm(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate_halves(x_THd, angles_TR):
    """Rotary in the half-split layout: dimension j pairs with j + d/2."""
    half = x_THd.shape[-1] // 2
    cos, sin = angles_TR.cos()[:, None], angles_TR.sin()[:, None]
    x1, x2 = x_THd[..., :half], x_THd[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotate_pairs(x_THd, angles_TR):
    """Rotary in the interleaved layout of DeepSeek checkpoints: dimension 2j pairs with 2j + 1."""
    cos, sin = angles_TR.cos()[:, None], angles_TR.sin()[:, None]
    x1, x2 = x_THd[..., 0::2], x_THd[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def yarn_frequencies(rotary_dim, theta, scaling):
    """YaRN per its paper/DeepSeek code: blend interpolated and original frequencies per pair."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    pairs = rotary_dim // 2
    frequencies = [theta ** (-2 * j / rotary_dim) for j in range(pairs)]

    def pair_at(turns):
        return rotary_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_at(scaling["beta_fast"])), 0)
    high = min(math.ceil(pair_at(scaling["beta_slow"])), rotary_dim - 1)
    blended = []
    for j, f in enumerate(frequencies):
        ramp = min(max((j - low) / (high - low if high != low else 0.001), 0.0), 1.0)
        blended.append(f / factor * ramp + f * (1 - ramp))
    return torch.tensor(blended, dtype=torch.float64)


def causal_attention(q_TNd, k_TNd, v_TNd, scale):
    T = q_TNd.shape[0]
    scores_NTT = torch.einsum("qnd,knd->nqk", q_TNd, k_TNd) * scale
    scores_NTT = scores_NTT.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("nqk,knd->qnd", scores_NTT.softmax(-1), v_TNd).reshape(T, -1)


def swiglu(x, gate, up, down):
    return (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


def route(config, logits_E, bias_E):
    """(experts, weights) for one token, per architecture."""
    k = config["num_experts_per_tok"]
    if config["model_type"] == "mixtral":
        top = logits_E.topk(k)
        return top.indices.tolist(), top.values.softmax(-1).tolist()
    if config["model_type"] == "qwen3_moe":
        probs = logits_E.softmax(-1)
        top = probs.topk(k)
        weights = top.values / top.values.sum() if config["norm_topk_prob"] else top.values
        return top.indices.tolist(), weights.tolist()
    scores = logits_E.sigmoid()
    choice = scores + bias_E
    group_size = len(scores) // config["n_group"]
    group_scores = [sorted(choice[g * group_size:(g + 1) * group_size].tolist())[-2:] for g in range(config["n_group"])]
    kept_groups = sorted(range(config["n_group"]), key=lambda g: -sum(group_scores[g]))[: config["topk_group"]]
    eligible = [e for e in range(len(scores)) if e // group_size in kept_groups]
    chosen = sorted(eligible, key=lambda e: -choice[e].item())[:k]
    weights = scores[chosen]
    weights = weights / weights.sum() * config["routed_scaling_factor"]
    return chosen, weights.tolist()


def reference_logits(config, w, tokens_T):
    kind = config["model_type"]
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    T = len(tokens_T)
    positions = torch.arange(T, dtype=torch.float64)
    x = w["model.embed_tokens.weight"][tokens_T]
    N = config["num_attention_heads"]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        h = rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
        if kind in ("deepseek_v3", "kimi_k2"):
            nope, rope, vd = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
            if config["q_lora_rank"]:
                q = rms_norm(h @ w[f"{a}.q_a_proj.weight"].t(), w[f"{a}.q_a_layernorm.weight"], eps) @ w[f"{a}.q_b_proj.weight"].t()
            else:
                q = h @ w[f"{a}.q_proj.weight"].t()
            q = q.view(T, N, nope + rope)
            kv_a = h @ w[f"{a}.kv_a_proj_with_mqa.weight"].t()
            latent, k_rope = kv_a[:, : config["kv_lora_rank"]], kv_a[:, config["kv_lora_rank"]:]
            kv = (rms_norm(latent, w[f"{a}.kv_a_layernorm.weight"], eps) @ w[f"{a}.kv_b_proj.weight"].t()).view(T, N, nope + vd)
            scaling = config["rope_scaling"]
            angles = torch.outer(positions, yarn_frequencies(rope, theta, scaling)).float()
            q_rope = rotate_pairs(q[..., nope:], angles)
            k_rope = rotate_pairs(k_rope[:, None, :], angles).expand(T, N, rope)
            mscale = 0.1 * scaling["mscale_all_dim"] * math.log(scaling["factor"]) + 1.0
            scale = (nope + rope) ** -0.5 * mscale * mscale
            attn = causal_attention(torch.cat([q[..., :nope], q_rope], -1), torch.cat([kv[..., :nope], k_rope], -1),
                                    kv[..., nope:], scale)
        else:
            K = config["num_key_value_heads"]
            Hd = config.get("head_dim") or config["hidden_size"] // N
            q = (h @ w[f"{a}.q_proj.weight"].t()).view(T, N, Hd)
            k = (h @ w[f"{a}.k_proj.weight"].t()).view(T, K, Hd)
            v = (h @ w[f"{a}.v_proj.weight"].t()).view(T, K, Hd)
            if kind == "qwen3_moe":
                q, k = rms_norm(q, w[f"{a}.q_norm.weight"], eps), rms_norm(k, w[f"{a}.k_norm.weight"], eps)
            frequencies = torch.tensor([theta ** (-2 * j / Hd) for j in range(Hd // 2)], dtype=torch.float64)
            angles = torch.outer(positions, frequencies).float()
            q, k = rotate_halves(q, angles), rotate_halves(k, angles)
            # Grouped-query: query head n reads key/value head n // (N / K).
            k, v = k.repeat_interleave(N // K, dim=1), v.repeat_interleave(N // K, dim=1)
            attn = causal_attention(q, k, v, Hd**-0.5)
        x = x + attn @ w[f"{a}.o_proj.weight"].t()

        h = rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        if f"{p}.mlp.gate_proj.weight" in w:  # a dense layer
            ffn = swiglu(h, w[f"{p}.mlp.gate_proj.weight"], w[f"{p}.mlp.up_proj.weight"], w[f"{p}.mlp.down_proj.weight"])
        else:
            moe = f"{p}.block_sparse_moe" if kind == "mixtral" else f"{p}.mlp"
            names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            logits = h @ w[f"{moe}.gate.weight"].t()
            bias = w.get(f"{moe}.gate.e_score_correction_bias")
            ffn = torch.zeros_like(h)
            for t in range(T):
                experts, weights = route(config, logits[t], bias)
                for e, weight in zip(experts, weights):
                    ffn[t] += weight * swiglu(h[t], *(w[f"{moe}.experts.{e}.{n}.weight"] for n in names))
            if f"{moe}.shared_experts.gate_proj.weight" in w:
                ffn = ffn + swiglu(h, *(w[f"{moe}.shared_experts.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")))
        x = x + ffn
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if config["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.t()


# --- tests --------------------------------------------------------------------------------------

CHECKPOINTS = {
    "qwen3_moe": (qwen3_checkpoint, ()),
    "mixtral": (mixtral_checkpoint, ()),
    "deepseek_v3": (deepseek_checkpoint, ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight")),
    # Kimi-K2 is DeepSeek-V3's architecture; one routing group, and (to cover that branch) no query bottleneck.
    "kimi_k2": (lambda gen: deepseek_checkpoint(gen, "kimi_k2", q_lora_rank=None, n_group=1, topk_group=1), ()),
}


@pytest.mark.parametrize("model_type", list(CHECKPOINTS))
def test_loaded_logits_match_independent_implementation(tmp_path, model_type):
    make, fp8_names = CHECKPOINTS[model_type]
    gen = torch.Generator().manual_seed(sum(map(ord, model_type)))
    config, weights = make(gen)
    write_checkpoint(tmp_path, config, weights, fp8_names)
    model = load_hf_checkpoint(tmp_path)
    tokens = torch.randint(0, config["vocab_size"], (2, 12), generator=gen)
    with torch.no_grad():
        logits = model(tokens)
    for b in range(2):
        torch.testing.assert_close(logits[b], reference_logits(config, weights, tokens[b]), rtol=1e-4, atol=1e-4)
    assert any(is_expert_param(p) for p in model.parameters())  # loading keeps the expert tags


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    gen = torch.Generator().manual_seed(0)
    config, weights = qwen3_checkpoint(gen)
    del weights["model.layers.1.mlp.experts.5.up_proj.weight"]
    weights["model.layers.0.mlp.shared_expert_gate.weight"] = torch.randn(1, 32, generator=gen)
    write_checkpoint(tmp_path, config, weights)
    with pytest.raises(CheckpointError) as error:
        load_hf_checkpoint(tmp_path)
    message = str(error.value)
    assert "1 missing tensor(s): model.layers.1.mlp.experts.5.up_proj.weight" in message
    assert "1 unexpected tensor(s): model.layers.0.mlp.shared_expert_gate.weight" in message


def test_shape_mismatch_and_bad_config_are_named(tmp_path):
    gen = torch.Generator().manual_seed(1)
    config, weights = mixtral_checkpoint(gen)
    weights["model.norm.weight"] = torch.ones(31)
    write_checkpoint(tmp_path / "shape", config, weights)
    with pytest.raises(CheckpointError, match=r"model.norm.weight give norm.weight shape \(31,\)"):
        load_hf_checkpoint(tmp_path / "shape")
    write_checkpoint(tmp_path / "type", dict(config, model_type="llama"), weights)
    with pytest.raises(CheckpointError, match="model_type must be one of"):
        load_hf_checkpoint(tmp_path / "type")


def test_safetensors_round_trip_every_dtype(tmp_path):
    gen = torch.Generator().manual_seed(2)
    tensors = {
        "f32": torch.randn(3, 5, generator=gen),
        "bf16": torch.randn(7, generator=gen).bfloat16(),
        "f16": torch.randn(2, 2, 2, generator=gen).half(),
        "i64": torch.randint(-9, 9, (4,), generator=gen),
        "u8": torch.randint(0, 255, (6,), generator=gen, dtype=torch.uint8),
        "bool": torch.rand(5, generator=gen) > 0.5,
        "fp8": torch.randn(4, 4, generator=gen).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
    }
    save_file(tensors, tmp_path / "t.safetensors", metadata={"format": "pt"})
    opened = SafetensorsFile(tmp_path / "t.safetensors")
    assert sorted(opened.names()) == sorted(tensors) and opened.metadata == {"format": "pt"}
    for name, tensor in tensors.items():
        loaded = opened.get(name)
        assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape
        assert torch.equal(loaded.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
    # The header follows the published layout: little-endian u64 size, then JSON.
    raw = (tmp_path / "t.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert header["f32"] == {"dtype": "F32", "shape": [3, 5], "data_offsets": header["f32"]["data_offsets"]}
    begin, end = header["f32"]["data_offsets"]
    data = raw[8 + int.from_bytes(raw[:8], "little") + begin : 8 + int.from_bytes(raw[:8], "little") + end]
    assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32).view(3, 5), tensors["f32"])


@pytest.mark.parametrize(
    "preset, model_type, overrides",
    [
        ("qwen3_moe_tiny", "qwen3_moe", {}),
        ("deepseek_v3_tiny", "deepseek_v3", {}),
        ("kimi_k2_tiny", "kimi_k2", {}),
        ("qwen3_moe_tiny", "mixtral", {"qk_norm": False}),
    ],
)
def test_saved_checkpoints_load_back_to_the_same_logits(tmp_path, preset, model_type, overrides):
    from moetrain.models import PRESETS, build_lm, save_hf_checkpoint
    from moetrain.moe import moe_layers

    torch.manual_seed(5)
    model = build_lm(preset, vocab_size=64, max_seq_len=32, **overrides).eval()
    with torch.no_grad():
        for layer in moe_layers(model):  # a balancing bias that is not zero, for the sigmoid gates
            if hasattr(layer.gate, "expert_bias"):
                layer.gate.expert_bias.copy_(0.05 * torch.randn(layer.num_experts))
    save_hf_checkpoint(model, tmp_path, model_type, max_shard_bytes=100_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {p.name for p in shards}
    loaded = load_hf_checkpoint(tmp_path)
    tokens = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens), rtol=1e-5, atol=1e-5)
    assert PRESETS[preset].moe_kwargs["top_k"] == loaded.config.moe_kwargs["top_k"]


def test_saving_a_model_that_does_not_fit_the_architecture_is_refused(tmp_path):
    from moetrain.models import build_lm, save_hf_checkpoint

    with pytest.raises(CheckpointError, match="does not fit qwen3_moe: expert='ffn'"):
        save_hf_checkpoint(build_lm("switch_tiny"), tmp_path, "qwen3_moe")
