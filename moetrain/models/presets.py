"""Architecture presets: published MoE language models at full size, and tiny CPU variants.

    from moetrain.models import build_lm
    model = build_lm("qwen3_moe_tiny")                         # trains on a laptop
    with torch.device("meta"):
        model = build_lm("deepseek_v3")                        # 671B parameters, no memory used
    python -m moetrain.models                                  # table of total / active parameters

Full-size presets follow the published configs (HF config.json / papers). Differences, stated
once here and in docs/models.md:
- switch_base and gshard_600b were encoder-decoder translation/span-corruption models; they are
  built here as decoder-only stacks with the same width, depth (encoder + decoder layers), expert
  count and MoE placement (every other FFN). Cross-attention and T5's relative position bias are
  left out (RoPE instead), so their totals are within a few percent of the published figures.
- deepseek_v3 / kimi_k2 use multi-head latent attention as published; the multi-token-prediction
  module of DeepSeek-V3 (14B, not part of its 671B) is not built.
"""

from __future__ import annotations

from moetrain.models.layers import merge_moe_kwargs
from moetrain.models.lm import LMConfig, MoETransformerLM

# DeepSeek-V3 and Kimi-K2 extend their 4K pre-training context with YaRN.
_DEEPSEEK_V3_YARN = {
    "type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
}
_KIMI_K2_YARN = {
    "type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
    "beta_fast": 1, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
}

PRESETS: dict[str, LMConfig] = {
    # Switch Transformer, Switch-Base with 128 experts (Fedus et al. 2021): top-1, every other FFN.
    "switch_base": LMConfig(
        vocab_size=32128, dim=768, depth=24, num_heads=12, num_experts=128, expert_hidden_size=3072,
        expert="ffn", activation="relu", moe_every=2, tie_embeddings=True,
        moe_kwargs={"gate": "top", "top_k": 1, "capacity_factor": 1.0, "balance_loss_weight": 0.01},
    ),
    # GShard MoE(2048E, 36L) (Lepikhin et al. 2020): top-2 with the two weights renormalised, every
    # other FFN, expert capacity 2N/E (capacity_factor 1.0: the factor multiplies k * N/E).
    "gshard_600b": LMConfig(
        vocab_size=64000, dim=1024, depth=36, num_heads=16, num_experts=2048, expert_hidden_size=8192,
        expert="ffn", activation="relu", moe_every=2, tie_embeddings=True,
        moe_kwargs={"gate": "top", "top_k": 2, "capacity_factor": 1.0, "balance_loss_weight": 0.01,
                    "gate_kwargs": {"normalize": True}},
    ),
    # DeepSeekMoE 16B (Dai et al. 2024): 64 fine-grained experts, 2 shared, top-6, layer 0 dense.
    "deepseek_moe_16b": LMConfig(
        vocab_size=102400, dim=2048, depth=28, num_heads=16, num_experts=64, expert_hidden_size=1408,
        dense_hidden_size=10944, num_shared_experts=2, first_dense=1, max_seq_len=4096,
        moe_kwargs={"gate": "top", "top_k": 6, "capacity_factor": 0, "balance_loss_weight": 0.001},
    ),
    # DeepSeek-V3 (671B / 37B active): MLA, 256 experts + 1 shared, sigmoid gate with aux-loss-free
    # bias, 8 groups of which 4 are eligible, routed scaling 2.5, first 3 layers dense.
    "deepseek_v3": LMConfig(
        vocab_size=129280, dim=7168, depth=61, num_heads=128, attention="mla", q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=256, expert_hidden_size=2048, dense_hidden_size=18432, num_shared_experts=1,
        first_dense=3, rope_scaling=_DEEPSEEK_V3_YARN, max_seq_len=4096,
        moe_kwargs={"gate": "sigmoid", "top_k": 8, "capacity_factor": 0, "balance_loss_weight": 0.0001,
                    "gate_kwargs": {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5}},
    ),
    # Qwen3-30B-A3B: 128 experts, top-8 renormalised, GQA 32/4 with per-head q/k RMSNorm.
    "qwen3_moe_30b_a3b": LMConfig(
        vocab_size=151936, dim=2048, depth=48, num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True,
        num_experts=128, expert_hidden_size=768, dense_hidden_size=6144, rope_theta=1_000_000.0,
        max_seq_len=4096,
        moe_kwargs={"gate": "top", "top_k": 8, "capacity_factor": 0, "balance_loss_weight": 0.001,
                    "gate_kwargs": {"normalize": True}},
    ),
    # Kimi-K2 (1T / 32B active): DeepSeek-V3 layout with 384 experts, 64 heads, one group, 1 dense layer.
    "kimi_k2": LMConfig(
        vocab_size=163840, dim=7168, depth=61, num_heads=64, attention="mla", q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=384, expert_hidden_size=2048, dense_hidden_size=18432, num_shared_experts=1,
        first_dense=1, rope_theta=50000.0, rope_scaling=_KIMI_K2_YARN, max_seq_len=4096,
        moe_kwargs={"gate": "sigmoid", "top_k": 8, "capacity_factor": 0, "balance_loss_weight": 0.0001,
                    "gate_kwargs": {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827}},
    ),
    # Sized for one H200 (~1.5B total, ~0.5B active): few wide experts keep the expert GEMMs large;
    # Qwen3's routing (top-2 of 8 here).
    "moe_1b5": LMConfig(
        vocab_size=32768, dim=2048, depth=12, num_heads=16, num_kv_heads=4, head_dim=128, qk_norm=True,
        num_experts=8, expert_hidden_size=2048, rope_theta=1_000_000.0, max_seq_len=2048,
        moe_kwargs={"gate": "top", "top_k": 2, "capacity_factor": 0, "balance_loss_weight": 0.001,
                    "gate_kwargs": {"normalize": True}},
    ),
}

# Tiny variants keep each architecture's distinctive parts (gate, shared experts, dense layers,
# MLA, GQA, q/k norm, tying) at CPU size; the vocabulary fits the byte-level tokenizer.
_TINY = dict(vocab_size=512, dim=64, num_heads=4, max_seq_len=256)
PRESETS.update({
    "switch_tiny": PRESETS["switch_base"].replace(**_TINY, depth=4, num_experts=8, expert_hidden_size=128),
    "gshard_tiny": PRESETS["gshard_600b"].replace(**_TINY, depth=4, num_experts=8, expert_hidden_size=128),
    "deepseek_moe_tiny": PRESETS["deepseek_moe_16b"].replace(
        **_TINY, depth=3, num_experts=16, expert_hidden_size=32, dense_hidden_size=128,
        moe_kwargs={**PRESETS["deepseek_moe_16b"].moe_kwargs, "top_k": 4},
    ),
    "deepseek_v3_tiny": PRESETS["deepseek_v3"].replace(
        **_TINY, depth=3, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, num_experts=16, expert_hidden_size=32, dense_hidden_size=128, first_dense=1,
        moe_kwargs={**PRESETS["deepseek_v3"].moe_kwargs, "top_k": 4,
                    "gate_kwargs": {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}},
    ),
    "qwen3_moe_tiny": PRESETS["qwen3_moe_30b_a3b"].replace(
        **_TINY, depth=3, num_kv_heads=2, head_dim=16, num_experts=16, expert_hidden_size=32,
        moe_kwargs={**PRESETS["qwen3_moe_30b_a3b"].moe_kwargs, "top_k": 4},
    ),
    "kimi_k2_tiny": PRESETS["kimi_k2"].replace(
        **_TINY, depth=3, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, num_experts=24, expert_hidden_size=32, dense_hidden_size=128,
        moe_kwargs={**PRESETS["kimi_k2"].moe_kwargs, "top_k": 4},
    ),
})


def build_lm(preset: str | None = None, **overrides) -> MoETransformerLM:
    """A language model from a preset name, with any LMConfig field overridden; without a preset,
    the overrides are the whole config. `moe_kwargs` changes the preset's routing key by key
    (build_lm("deepseek_v3_tiny", moe_kwargs={"top_k": 2}) keeps its sigmoid, grouped, scaled gate).
    Build under `torch.device("meta")` to count parameters."""
    if preset is None:
        return MoETransformerLM(LMConfig(**overrides))
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    unknown = sorted(set(overrides) - {f.name for f in LMConfig.__dataclass_fields__.values()})
    if unknown:
        raise ValueError(f"unknown LM setting(s) {unknown}; allowed: {sorted(LMConfig.__dataclass_fields__)}")
    if "moe_kwargs" in overrides:
        overrides["moe_kwargs"] = merge_moe_kwargs(PRESETS[preset].moe_kwargs, overrides["moe_kwargs"])
    return MoETransformerLM(PRESETS[preset].replace(**overrides))

