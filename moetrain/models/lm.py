"""Decoder-only MoE language model (DeepSeekMoE / DeepSeek-V3 / Kimi-K2 / Qwen3-MoE / Mixtral layout).

tokens [B, T] -> embedding -> depth x pre-norm blocks (causal attention with RoPE, then a dense
SwiGLU/FFN or an MoELayer) -> final RMSNorm -> lm_head -> logits [B, T, vocab_size].

Which blocks are MoE: the first `first_dense` blocks are dense, after that the last block of every
group of `moe_every` (moe_every=1: all of them). Attention is standard multi-head attention with
optional grouped-query heads (num_kv_heads) and q/k norms (Qwen3), or multi-head latent attention
(attention="mla", DeepSeek-V3 / Kimi-K2).

Packed documents: with `document_ids` [B, T] (the document of each position, as data=text
data.document_mask=true gives them), a position attends only to earlier positions of its own
document, and rotary positions restart at 0 where each document starts, so each document's
logits are those of that document run alone, position for position (rotary attention depends on
relative positions only, so positions that ran on would change them by rounding alone; restarting
gives every document exactly the tables it gets alone, as Hugging Face's per-document position_ids do).

Shape letters as in moetrain/models/layers.py, plus V vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from moetrain.models.layers import (
    Attention,
    LatentAttention,
    TransformerBlock,
    check_moe_kwargs,
    init_normal_,
    make_norm,
    document_mask,
    document_positions,
    moe_block_indices,
    rotary_tables,
    yarn_scaling,
)
from moetrain.moe import DenseFeedForward, MoELayer, is_expert_param
from moetrain.ops.graph import outside_the_graph
from moetrain.ops.linear_cross_entropy import linear_cross_entropy

ATTENTIONS = ("mha", "mla")


@dataclass
class LMConfig:
    vocab_size: int
    dim: int
    depth: int
    num_heads: int
    num_experts: int
    expert_hidden_size: int
    dense_hidden_size: int | None = None  # FFN width of dense blocks; None: expert_hidden_size
    # Attention: "mha" covers multi-head, grouped-query (num_kv_heads < num_heads) and multi-query.
    attention: str = "mha"
    num_kv_heads: int | None = None
    head_dim: int | None = None
    qk_norm: bool = False
    attention_bias: bool = False
    # Multi-head latent attention (attention="mla"); q_lora_rank None: queries without bottleneck.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"type": "yarn", "factor", "original_max_position_embeddings", ...}
    max_seq_len: int = 2048
    norm_eps: float = 1e-6
    # Feed-forward: experts and dense blocks share the kind ("swiglu" or "ffn") and activation.
    expert: str = "swiglu"
    activation: str = "silu"
    num_shared_experts: int = 0
    moe_every: int = 1
    first_dense: int = 0
    moe_kwargs: dict = field(default_factory=dict)  # forwarded to every MoELayer (gate, top_k, ...)
    tie_embeddings: bool = False
    dropout: float = 0.0

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.rope_scaling is not None and self.rope_scaling.get("type", self.rope_scaling.get("rope_type")) != "yarn":
            raise ValueError(f"rope_scaling must be None or a 'yarn' dict, got {self.rope_scaling!r}")
        self.moe_kwargs = check_moe_kwargs(self.moe_kwargs)

    def replace(self, **overrides) -> LMConfig:
        return dataclasses.replace(self, **overrides)


class MoETransformerLM(nn.Module):
    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.dropout = nn.Dropout(c.dropout)
        moe_blocks = set(moe_block_indices(c.depth, c.moe_every, c.first_dense))
        self.blocks = nn.ModuleList(
            TransformerBlock(c.dim, self._attention(), self._ffn(i in moe_blocks), "rmsnorm", c.norm_eps, c.dropout)
            for i in range(c.depth)
        )
        self.norm = make_norm("rmsnorm", c.dim, c.norm_eps)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)
        if self.embed.weight.device.type != "meta":  # nothing to initialise when only counting
            init_normal_(self)
        self.tie_weights()
        self.reset_rotary()

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the config ties them (again after
        module.to_empty(), which allocates each parameter separately)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def reset_rotary(self) -> None:
        """(Re)compute the rotary cos/sin tables on the embedding's device, in float32. They derive
        from the config, so they are not saved in checkpoints."""
        c = self.config
        rotary_dim = c.qk_rope_head_dim if c.attention == "mla" else (c.head_dim or c.dim // c.num_heads)
        frequency_map, table_factor = None, 1.0
        if c.rope_scaling is not None:
            frequency_map, table_factor, _ = yarn_scaling(c.rope_scaling, rotary_dim, c.rope_theta)
        cos_TR, sin_TR = rotary_tables(rotary_dim, c.max_seq_len, c.rope_theta, self.embed.weight.device, frequency_map)
        self.register_buffer("rotary_cos", cos_TR * table_factor, persistent=False)
        self.register_buffer("rotary_sin", sin_TR * table_factor, persistent=False)

    def _attention(self) -> nn.Module:
        c = self.config
        if c.attention == "mla":
            qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
            softmax_scale = qk_head_dim**-0.5
            if c.rope_scaling is not None:
                softmax_scale *= yarn_scaling(c.rope_scaling, c.qk_rope_head_dim, c.rope_theta)[2]
            return LatentAttention(
                c.dim, c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
                c.v_head_dim, c.norm_eps, softmax_scale, c.dropout,
            )
        return Attention(
            c.dim, c.num_heads, c.num_kv_heads, c.head_dim, bias=c.attention_bias, qk_norm=c.qk_norm,
            norm_eps=c.norm_eps, causal=True, dropout=c.dropout,
        )

    def _ffn(self, is_moe: bool) -> nn.Module:
        c = self.config
        if not is_moe:
            return DenseFeedForward(c.dim, c.dense_hidden_size or c.expert_hidden_size, c.expert, c.activation)
        return MoELayer(
            model_dim=c.dim,
            num_experts=c.num_experts,
            hidden_size=c.expert_hidden_size,
            activation=c.activation,
            expert=c.expert,
            num_shared_experts=c.num_shared_experts,
            **c.moe_kwargs,
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at this sequence length (module function flops_per_token); the
        trainer reads it to report MFU without knowing the model class."""
        return flops_per_token(self, seq_len)

    def forward(self, tokens_BT: torch.Tensor, document_ids: torch.Tensor | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V]; document_ids [B, T]: keep attention and positions inside each document.
        With targets [B, T] (-100: not scored) the mean next-token cross-entropy instead, the head and
        the loss fused chunk by chunk (moetrain.ops.linear_cross_entropy: no logits are kept)."""
        T = tokens_BT.shape[1]
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}")
        mask = None
        if document_ids is None:
            rotary = (self.rotary_cos[:T], self.rotary_sin[:T])
        else:
            if document_ids.shape != tokens_BT.shape:
                raise ValueError(f"document_ids {tuple(document_ids.shape)} must have the tokens' shape "
                                 f"{tuple(tokens_BT.shape)}")
            positions_B1T = document_positions(document_ids)[:, None]
            rotary = (self.rotary_cos[positions_B1T], self.rotary_sin[positions_B1T])
            # Attention dropout needs the boolean mask: flex attention has none.
            dropout = self.training and self.config.dropout > 0
            mask = document_mask(document_ids, causal=True, flex=document_ids.is_cuda and not dropout)
        x_BTD = self.dropout(self.embed(tokens_BT))
        for block in self.blocks:
            x_BTD = block(x_BTD, rotary) if mask is None else block(x_BTD, rotary, mask)
        if targets is None:
            return self.lm_head(self.norm(x_BTD))
        # Inside a compiled model the fused loss runs outside the graph (its own kernel is compiled
        # apart): the graph ends at the final norm. Always outside: where dynamo falls back on
        # running this frame eagerly (a graph break in the loop over blocks), it would otherwise
        # compile the loss's frames, and torch 2.11 fails to trace its addmm(out_dtype=float32).
        return outside_the_graph(linear_cross_entropy)(self.norm(x_BTD), self.lm_head.weight, targets)


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(total, active per token) parameters. Active counts each MoE layer's routed experts at
    top_k / num_experts of their size; everything else (shared experts, router, embeddings, head)
    counts in full, which is how the model cards count. Tied weights count once."""
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
        routed = sum(p.numel() for p in layer.experts.parameters() if is_expert_param(p))
        inactive += routed - routed * layer.top_k // layer.num_experts
    return total, total - inactive


def flops_per_token(model: MoETransformerLM, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM-style: 6 x active matmul parameters
    (the input embedding is a lookup, not a matmul, unless tied to the head) plus the attention
    score and value products, 6 x layers x seq_len x heads x (qk head dim + v head dim)."""
    c = model.config
    _, active = parameter_counts(model)
    if not c.tie_embeddings:
        active -= model.embed.weight.numel()
    if c.attention == "mla":
        qk_dim, v_dim = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    else:
        qk_dim = v_dim = c.head_dim or c.dim // c.num_heads
    return 6.0 * active + 6.0 * c.depth * seq_len * c.num_heads * (qk_dim + v_dim)
