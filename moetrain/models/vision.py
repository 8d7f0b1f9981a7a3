"""ViT-style image classifier whose transformer FFNs are MoE layers.

images [B, C, H, W] -> non-overlapping patches (a strided convolution) -> tokens [B, P, D]
(+ a class token) + learned position embeddings -> pre-norm transformer blocks (an MoELayer FFN
every `moe_every` blocks, a dense FFN otherwise) -> final norm -> class token or mean over
patches -> linear head -> logits [B, num_classes].
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.models.layers import (
    Attention,
    TransformerBlock,
    check_moe_kwargs,
    make_norm,
    moe_block_indices,
)
from moetrain.moe import DenseFeedForward, MoELayer

POOLS = ("cls", "mean")


class VisionMoE(nn.Module):
    def __init__(
        self,
        image_size: int,
        in_channels: int,
        patch_size: int,
        num_classes: int,
        dim: int,
        depth: int,
        num_heads: int,
        num_experts: int,
        expert_hidden_size: int,
        moe_every: int = 1,
        expert: str = "ffn",
        activation: str = "gelu",
        num_shared_experts: int = 0,
        moe_kwargs: dict | None = None,
        dropout: float = 0.0,
        pool: str = "cls",
        norm: str = "layernorm",
        dense_hidden_size: int | None = None,
    ):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size ({image_size}) must be divisible by patch_size ({patch_size})")
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        moe_kwargs = check_moe_kwargs(moe_kwargs)
        self.pool = pool
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if pool == "cls" else None
        num_positions = num_patches + (1 if pool == "cls" else 0)
        self.pos_embed = nn.Parameter(torch.randn(1, num_positions, dim) * 0.02)
        self.dropout = nn.Dropout(dropout)

        moe_blocks = set(moe_block_indices(depth, moe_every))
        blocks = []
        for i in range(depth):
            if i in moe_blocks:
                ffn = MoELayer(
                    model_dim=dim,
                    num_experts=num_experts,
                    hidden_size=expert_hidden_size,
                    activation=activation,
                    expert=expert,
                    num_shared_experts=num_shared_experts,
                    **moe_kwargs,
                )
            else:
                # A dense block gets the same FFN kind as the experts ("swiglu" stays gated).
                ffn = DenseFeedForward(dim, dense_hidden_size or expert_hidden_size, expert, activation)
            attention = Attention(dim, num_heads, bias=True, dropout=dropout)
            blocks.append(TransformerBlock(dim, attention, ffn, norm=norm, dropout=dropout))
        self.blocks = nn.ModuleList(blocks)
        self.norm = make_norm(norm, dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        x_BDhw = self.patch_embed(images_BCHW)
        x_BPD = x_BDhw.flatten(2).transpose(1, 2)
        if self.cls_token is not None:
            x_BPD = torch.cat([self.cls_token.expand(x_BPD.shape[0], -1, -1), x_BPD], dim=1)
        x_BPD = self.dropout(x_BPD + self.pos_embed)
        for block in self.blocks:
            x_BPD = block(x_BPD)
        x_BPD = self.norm(x_BPD)
        pooled_BD = x_BPD[:, 0] if self.pool == "cls" else x_BPD.mean(dim=1)
        return self.head(pooled_BD)
