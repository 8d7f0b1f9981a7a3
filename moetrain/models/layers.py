"""Transformer building blocks shared by the image classifier and the decoder language model.

Shape letters: B batch, T sequence (tokens or patches), D model width, N attention heads,
K key/value heads (grouped-query attention: N is a multiple of K), Hd head width, R rotary width,
S key positions.

Packed documents (a language model's `document_ids`): `document_mask` lets a query see only the
keys of its own document (and, causal, not after itself). On CUDA it is a flex-attention BlockMask
(torch.nn.attention.flex_attention, compiled once: blocks no document reaches are skipped); on a
CPU, or with attention dropout, a boolean [B, 1, T, S] mask for scaled_dot_product_attention, the
reference the flex path is tested against.

A block is pre-norm: x + attention(norm(x)), then x + ffn(norm(x)). The feed-forward network is an
MoELayer (routed experts, optionally shared experts) or a dense FFN; which one is decided by the
model, so the same block serves ViT-style classifiers and DeepSeek/Qwen-style language models.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.moe import MoELayer, recompute
from moetrain.ops.graph import outside_the_graph

NORMS = ("rmsnorm", "layernorm")

# The dict a model forwards to every MoELayer (`moe_kwargs`) holds MoELayer's arguments except these,
# which are arguments of the model itself.
MODEL_ARGUMENTS = ("model_dim", "num_experts", "hidden_size", "activation", "expert", "num_shared_experts")
MOE_KWARGS = tuple(name for name in inspect.signature(MoELayer).parameters if name not in MODEL_ARGUMENTS)


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm that, under autocast, multiplies by its weight in the autocast dtype, as autocast
    does a Linear's weight. Activations already in that dtype (q and k after their projections, MLA's
    compressed q and kv) then take torch's fused kernel and stay 16-bit; with the fp32 weight they took
    the unfused path, with a dtype-mismatch warning, and came out fp32. Outside autocast, and for fp32
    activations (the residual stream under autocast), it is nn.RMSNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        device = x.device.type
        if (weight is not None and x.dtype != weight.dtype and torch.is_autocast_enabled(device)
                and x.dtype == torch.get_autocast_dtype(device)):
            weight = weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


def make_norm(kind: str, dim: int, eps: float = 1e-6) -> nn.Module:
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")


def check_moe_kwargs(moe_kwargs: dict | None) -> dict:
    moe_kwargs = dict(moe_kwargs or {})
    unknown = sorted(set(moe_kwargs) - set(MOE_KWARGS))
    if unknown:
        raise ValueError(f"moe_kwargs has unknown key(s) {unknown}; allowed keys: {list(MOE_KWARGS)}")
    return moe_kwargs


def merge_moe_kwargs(base: dict, overrides: dict | None) -> dict:
    """`base` (a preset's routing) with `overrides` applied key by key. The gate's own settings
    (gate_kwargs) merge too while the gate stays the same; a different gate drops base's."""
    overrides = check_moe_kwargs(overrides)
    merged = {**base, **overrides}
    kept = base.get("gate_kwargs") or {} if merged.get("gate") == base.get("gate") else {}
    merged["gate_kwargs"] = {**kept, **(overrides.get("gate_kwargs") or {})}
    return merged


def rotary_tables(
    head_dim: int, max_positions: int, theta: float, device=None, inverse_frequency_scale=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim] in the "rotate half" layout (HF Llama/Qwen).

    `inverse_frequency_scale` (a callable on the inverse frequencies) lets context-extension
    schemes such as YaRN rescale the frequencies without another code path.
    """
    inv_freq_R = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    if inverse_frequency_scale is not None:
        inv_freq_R = inverse_frequency_scale(inv_freq_R)
    angles_TR = torch.outer(torch.arange(max_positions, dtype=torch.float64, device=device), inv_freq_R)
    angles_THd = torch.cat([angles_TR, angles_TR], dim=-1)
    return angles_THd.cos().float(), angles_THd.sin().float()


def yarn_scaling(rope_scaling: dict, rotary_dim: int, theta: float):
    """YaRN context extension (DeepSeek-V3, Kimi-K2): returns (inverse-frequency map, factor on
    cos/sin, factor on the softmax scale).

    Frequencies that turn more than beta_fast times over the original context keep their value,
    those turning fewer than beta_slow times are divided by `factor`, and a linear ramp blends the
    two in between; "mscale" terms compensate the attention entropy (DeepSeek's convention).
    """
    factor = float(rope_scaling["factor"])
    original_context = rope_scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = rope_scaling.get("beta_fast", 32), rope_scaling.get("beta_slow", 1)

    def mscale(scale: float, coefficient: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0

    def dimension_turning(turns: float) -> float:
        # The rotary pair index whose frequency makes `turns` full turns over the original context.
        return rotary_dim * math.log(original_context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dimension_turning(beta_fast)), 0)
    high = min(math.ceil(dimension_turning(beta_slow)), rotary_dim - 1)

    def scale_inverse_frequency(inv_freq_R: torch.Tensor) -> torch.Tensor:
        ramp_R = ((torch.arange(inv_freq_R.numel(), dtype=inv_freq_R.dtype, device=inv_freq_R.device) - low)
                  / max(high - low, 1e-3)).clamp(0, 1)
        return inv_freq_R / factor * ramp_R + inv_freq_R * (1 - ramp_R)

    coefficient, coefficient_all = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if coefficient and coefficient_all:
        table_factor = mscale(factor, coefficient) / mscale(factor, coefficient_all)
    else:
        table_factor = mscale(factor)
    softmax_factor = mscale(factor, coefficient_all) ** 2 if coefficient_all else 1.0
    return scale_inverse_frequency, table_factor, softmax_factor


def document_positions(document_ids_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] int64: each position's index within its document (documents are contiguous runs of
    one id), so that rotary positions restart at 0 where a document starts."""
    T = document_ids_BT.shape[1]
    index_BT = torch.arange(T, device=document_ids_BT.device).expand_as(document_ids_BT)
    starts_BT = torch.ones_like(document_ids_BT, dtype=torch.bool)
    starts_BT[:, 1:] = document_ids_BT[:, 1:] != document_ids_BT[:, :-1]
    first_BT = torch.where(starts_BT, index_BT, torch.zeros_like(index_BT)).cummax(dim=1).values
    return index_BT - first_BT


_compiled_flex_attention = None


def _flex_attention():
    """flex_attention, compiled on first use (uncompiled it materialises every score)."""
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention


def _flex_call(q_BNTHd, k_BKSHd, v_BKSHd, mask, scale, gqa):
    return _flex_attention()(q_BNTHd, k_BKSHd, v_BKSHd, block_mask=mask, scale=scale, enable_gqa=gqa)


def _block_mask(document_ids_BT: torch.Tensor, causal: bool):
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = document_ids_BT.shape

    def same_document(b, h, q_index, kv_index):
        inside = document_ids_BT[b, q_index] == document_ids_BT[b, kv_index]
        return inside & (q_index >= kv_index) if causal else inside

    return create_block_mask(same_document, B, None, T, T, device=document_ids_BT.device)


def document_mask(document_ids_BT: torch.Tensor, causal: bool = True, flex: bool | None = None):
    """The attention mask that keeps each query inside its document (module doc): a flex-attention
    BlockMask when flex (default: on CUDA), else a boolean [B, 1, T, S] mask (True: attend)."""
    T = document_ids_BT.shape[1]
    if flex is None:
        flex = document_ids_BT.is_cuda
    if flex:
        # Built eagerly, once per forward, also inside a compiled model. (torch.compiler.disable is
        # applied here, not as a decorator: it imports dynamo, which every command would then load.)
        return torch.compiler.disable(_block_mask)(document_ids_BT, causal)
    mask_BTS = document_ids_BT[:, :, None] == document_ids_BT[:, None, :]
    if causal:
        mask_BTS &= torch.ones(T, T, dtype=torch.bool, device=document_ids_BT.device).tril()
    return mask_BTS[:, None]


def attend(q_BNTHd, k_BKSHd, v_BKSHd, mask=None, causal: bool = False, dropout: float = 0.0,
           scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v over the keys `mask` allows (None: all, or the causal ones); mask
    as document_mask makes it. Grouped-query heads when K < N."""
    gqa = k_BKSHd.shape[1] != q_BNTHd.shape[1]
    if mask is not None and not isinstance(mask, torch.Tensor):  # a flex-attention BlockMask
        if dropout:
            raise ValueError("flex attention has no dropout: build the mask with document_mask(..., flex=False)")
        # Inside a compiled model, flex attention traced into the model's graph returned wrong values
        # for a document mask (torch 2.11, H200), while the kernel compiled apart matches the
        # reference: the model's graph breaks around the call, which runs that kernel.
        return outside_the_graph(_flex_call)(q_BNTHd, k_BKSHd, v_BKSHd, mask, scale, gqa)
    return F.scaled_dot_product_attention(q_BNTHd, k_BKSHd, v_BKSHd, attn_mask=mask, dropout_p=dropout,
                                          is_causal=causal and mask is None, scale=scale, enable_gqa=gqa)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by the cos/sin tables ("rotate half" layout), which broadcast against x: [..., Hd]
    with the positions where x has them."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Multi-head attention with optional grouped-query heads, rotary embedding and per-head
    q/k RMSNorm (Qwen3), computed by torch's scaled_dot_product_attention."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        causal: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads}) when head_dim is unset")
            head_dim = dim // num_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.causal, self.dropout = causal, dropout
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None

    def forward(self, x_BTD: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask=None) -> torch.Tensor:
        return self.o_proj(self.mix(x_BTD, rotary, mask))

    def mix(self, x_BTD: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
            mask=None) -> torch.Tensor:
        """Attention before the output projection -> [B, T, num_heads * head_dim]. rotary: cos/sin
        [T, Hd], or [B, 1, T, Hd] for per-sequence positions; mask: as document_mask makes it."""
        # The norms and the rotation run on the projections' own [B, T, heads, Hd] layout; attention
        # takes [B, heads, T, Hd] views of it. (Computed on the views, a compiled block ran one more
        # kernel a layer in the forward, and stored q's and k's gradients transposed.)
        B, T, _ = x_BTD.shape
        q_BTNHd = self.q_proj(x_BTD).view(B, T, self.num_heads, self.head_dim)
        k_BTKHd = self.k_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        v_BTKHd = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_BTNHd, k_BTKHd = self.q_norm(q_BTNHd), self.k_norm(k_BTKHd)
        if rotary is not None:
            # [T, Hd] -> [T, 1, Hd]; per-sequence [B, 1, T, Hd] -> [B, T, 1, Hd]
            cos, sin = (table.unsqueeze(-2) if table.dim() == 2 else table.transpose(1, 2) for table in rotary)
            q_BTNHd, k_BTKHd = apply_rotary(q_BTNHd, cos, sin), apply_rotary(k_BTKHd, cos, sin)
        o_BNTHd = attend(q_BTNHd.transpose(1, 2), k_BTKHd.transpose(1, 2), v_BTKHd.transpose(1, 2), mask, self.causal,
                         self.dropout if self.training else 0.0)
        return o_BNTHd.transpose(1, 2).reshape(B, T, -1)


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2).

    Keys and values are rebuilt per head from a shared low-rank latent (kv_lora_rank) plus one
    rotary key shared by all heads; queries optionally go through their own low-rank bottleneck.
    Each query/key head is [no-rotary part (nope) | rotary part (rope)]; values have v_head_dim.
    The rotary part uses the interleaved pair layout of the DeepSeek checkpoints.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        norm_eps: float = 1e-6,
        softmax_scale: float | None = None,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = num_heads, q_lora_rank, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.softmax_scale = softmax_scale if softmax_scale is not None else qk_head_dim**-0.5
        self.dropout = dropout
        if q_lora_rank is None:
            self.q_proj = nn.Linear(dim, num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(q_lora_rank, eps=norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk_head_dim, bias=False)
        self.kv_a_proj = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(kv_lora_rank, eps=norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, dim, bias=False)

    @staticmethod
    def _deinterleave(x: torch.Tensor) -> torch.Tensor:
        # Checkpoint pairs (x0, x1), (x2, x3), ... -> halves (x0, x2, ..., x1, x3, ...), so the
        # "rotate half" tables apply.
        return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)

    def forward(self, x_BTD: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], mask=None) -> torch.Tensor:
        return self.o_proj(self.mix(x_BTD, rotary, mask))

    def mix(self, x_BTD: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], mask=None) -> torch.Tensor:
        """Attention before the output projection -> [B, T, num_heads * v_head_dim]."""
        B, T, _ = x_BTD.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_BTD)))
        q_BNTHd = q.view(B, T, self.num_heads, -1).transpose(1, 2)
        q_nope, q_rope = q_BNTHd.split([self.nope_dim, self.rope_dim], dim=-1)

        latent_BTL, k_rope_BTR = self.kv_a_proj(x_BTD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_BNTHd = self.kv_b_proj(self.kv_a_norm(latent_BTL)).view(B, T, self.num_heads, -1).transpose(1, 2)
        k_nope, v_BNTHd = kv_BNTHd.split([self.nope_dim, self.v_head_dim], dim=-1)

        cos_TR, sin_TR = rotary
        q_rope = apply_rotary(self._deinterleave(q_rope), cos_TR, sin_TR)
        k_rope_B1TR = apply_rotary(self._deinterleave(k_rope_BTR.unsqueeze(1)), cos_TR, sin_TR)
        q_BNTHd = torch.cat([q_nope, q_rope], dim=-1)
        k_BNTHd = torch.cat([k_nope, k_rope_B1TR.expand(-1, self.num_heads, -1, -1)], dim=-1)
        o_BNTHd = attend(q_BNTHd, k_BNTHd, v_BNTHd, mask, True, self.dropout if self.training else 0.0,
                         self.softmax_scale)
        return o_BNTHd.transpose(1, 2).reshape(B, T, -1)


class TransformerBlock(recompute.CheckpointedBlock):
    """Pre-norm residual block: x + attention(norm(x)), then x + ffn(norm(x)).

    activation_checkpointing (moetrain.moe.recompute): "full" recomputes the whole block in
    backward, "selective" its attention but the output projection (the MoE layer recomputes its
    experts' hidden activations itself)."""

    def __init__(self, dim: int, attention: nn.Module, ffn: nn.Module, norm: str = "rmsnorm", norm_eps: float = 1e-6, dropout: float = 0.0):
        super().__init__()
        self.attn_norm = make_norm(norm, dim, norm_eps)
        self.attn = attention
        self.ffn_norm = make_norm(norm, dim, norm_eps)
        self.ffn = ffn
        self.dropout = nn.Dropout(dropout)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoELayer)

    def forward(self, x_BTD: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask=None) -> torch.Tensor:
        """mask: the attention mask of packed documents (document_mask), or None."""
        if self.activation_checkpointing == "full" and torch.is_grad_enabled():
            return recompute.checkpoint_block(self._forward, x_BTD, rotary, mask)
        return self._forward(x_BTD, rotary, mask)

    def _attention(self, x_BTD: torch.Tensor, rotary, mask=None) -> torch.Tensor:
        if mask is None:  # the call an attention module without a mask argument takes
            return self.attn(self.attn_norm(x_BTD), rotary)
        return self.attn(self.attn_norm(x_BTD), rotary, mask)

    def _mix(self, x_BTD: torch.Tensor, rotary, mask=None) -> torch.Tensor:
        return self.attn.mix(self.attn_norm(x_BTD), rotary, mask)

    def _recomputed_attention(self, x_BTD: torch.Tensor, rotary, mask=None) -> torch.Tensor:
        """Attention whose activations are recomputed in backward, all but the output projection's
        (its input is kept: the GEMM would be recomputed for an output the backward never reads).
        An attention module without mix/o_proj is recomputed whole."""
        if isinstance(self.attn, (Attention, LatentAttention)):
            return self.attn.o_proj(recompute.checkpoint_call(self._mix, x_BTD, rotary, mask))
        return recompute.checkpoint_call(self._attention, x_BTD, rotary, mask)

    def _forward(self, x_BTD: torch.Tensor, rotary, mask=None) -> torch.Tensor:
        if self.activation_checkpointing == "selective" and torch.is_grad_enabled():
            attended_BTD = self._recomputed_attention(x_BTD, rotary, mask)
        else:
            attended_BTD = self._attention(x_BTD, rotary, mask)
        x_BTD = x_BTD + self.dropout(attended_BTD)
        return x_BTD + self.dropout(self.ffn(self.ffn_norm(x_BTD)))


def init_normal_(model: nn.Module, std: float = 0.02) -> None:
    """GPT-style initialisation of the linear and embedding weights the model owns (biases to 0);
    MoE layers keep their own initialisation."""
    moe_owned = {id(sub) for layer in model.modules() if isinstance(layer, MoELayer) for sub in layer.modules()}
    for sub in model.modules():
        if id(sub) in moe_owned or not isinstance(sub, (nn.Linear, nn.Embedding)):
            continue
        nn.init.normal_(sub.weight, std=std)
        if getattr(sub, "bias", None) is not None:
            nn.init.zeros_(sub.bias)


def moe_block_indices(depth: int, moe_every: int, first_dense: int = 0) -> list[int]:
    """Blocks whose FFN is an MoELayer: after the first `first_dense` blocks, the last block of
    every group of `moe_every` (moe_every=2 gives blocks 1, 3, 5, ... as in Switch and GShard)."""
    if moe_every < 1:
        raise ValueError(f"moe_every must be >= 1, got {moe_every}")
    if not 0 <= first_dense <= depth:
        raise ValueError(f"first_dense must be in [0, depth={depth}], got {first_dense}")
    return [i for i in range(first_dense, depth) if (i - first_dense) % moe_every == moe_every - 1]

