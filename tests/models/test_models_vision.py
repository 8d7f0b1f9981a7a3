"""The ViT-style MoE image classifier: shapes, MoE placement, learning, gradients, bad input."""

import pytest
import torch
import torch.nn.functional as F

from moetrain.models import VisionMoE
from moetrain.moe import MoELayer, is_expert_param, moe_layers


def tiny(**overrides):
    kwargs = dict(
        image_size=8, in_channels=1, patch_size=4, num_classes=4, dim=32, depth=2, num_heads=4,
        num_experts=4, expert_hidden_size=64, moe_kwargs={"top_k": 2, "capacity_factor": 0},
    )
    kwargs.update(overrides)
    return VisionMoE(**kwargs)


def prototype_images(n: int, prototypes_KCHW: torch.Tensor, generator: torch.Generator):
    """Class c is prototype c plus noise: learnable, and a fresh batch tests generalisation."""
    labels_B = torch.randint(0, prototypes_KCHW.shape[0], (n,), generator=generator)
    return prototypes_KCHW[labels_B] + 0.5 * torch.randn(n, 1, 8, 8, generator=generator), labels_B


@pytest.mark.parametrize("pool", ["cls", "mean"])
@pytest.mark.parametrize("expert", ["ffn", "swiglu"])
def test_logits_shape_and_moe_placement(pool, expert):
    torch.manual_seed(0)
    model = tiny(pool=pool, expert=expert, depth=4, moe_every=2, in_channels=3, num_shared_experts=1)
    logits = model(torch.randn(5, 3, 8, 8))
    assert logits.shape == (5, 4) and torch.isfinite(logits).all()
    # moe_every=2: blocks 1 and 3 route through experts, 0 and 2 are dense.
    assert [block.is_moe for block in model.blocks] == [False, True, False, True]
    assert len(moe_layers(model)) == 2
    for layer in moe_layers(model):
        assert layer.stats.tokens_per_expert.sum().item() == 5 * (4 + (pool == "cls")) * 2


def reference_vit(model, images):
    """The ViT forward from its definition (Dosovitskiy et al. 2021, pre-norm blocks), in float64:
    patches cut by hand, LayerNorm and multi-head attention from their formulas, dense FFNs as
    fc2(gelu(fc1 x)), MoE FFNs by the naive token loop of tests/moe/test_moe_layer.py."""
    from moe.test_moe_layer import naive_moe  # tests/moe/

    def layer_norm(x, norm):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias

    def attention(x, attn):
        tokens, heads, head_dim = x.size(0), attn.num_heads, attn.head_dim
        q = (x @ attn.q_proj.weight.t() + attn.q_proj.bias).view(tokens, heads, head_dim)
        k = (x @ attn.k_proj.weight.t() + attn.k_proj.bias).view(tokens, heads, head_dim)
        v = (x @ attn.v_proj.weight.t() + attn.v_proj.bias).view(tokens, heads, head_dim)
        out = torch.empty(tokens, heads, head_dim, dtype=x.dtype)
        for h in range(heads):
            scores = q[:, h] @ k[:, h].t() / head_dim**0.5
            out[:, h] = torch.softmax(scores, -1) @ v[:, h]
        return out.reshape(tokens, -1) @ attn.o_proj.weight.t() + attn.o_proj.bias

    conv = model.patch_embed
    size = conv.kernel_size[0]
    embedded = []
    for image in images:
        side = image.size(-1) // size
        patches = [image[:, i * size : (i + 1) * size, j * size : (j + 1) * size].reshape(-1)
                   for i in range(side) for j in range(side)]  # row-major, as the patch grid reads
        x = torch.stack(patches) @ conv.weight.reshape(conv.out_channels, -1).t() + conv.bias
        if model.cls_token is not None:
            x = torch.cat([model.cls_token[0], x])
        embedded.append(x + model.pos_embed[0])
    x_BPD = torch.stack(embedded)
    for block in model.blocks:
        x_BPD = x_BPD + torch.stack([attention(layer_norm(x, block.attn_norm), block.attn) for x in x_BPD])
        h_BPD = layer_norm(x_BPD, block.ffn_norm)
        if block.is_moe:  # the experts' capacity is shared by every token of the batch
            x_BPD = x_BPD + naive_moe(block.ffn, h_BPD, block.ffn.top_k, block.ffn.capacity_factor)[0]
        else:
            x_BPD = x_BPD + block.ffn.fc2(F.gelu(block.ffn.fc1(h_BPD)))
    x_BPD = layer_norm(x_BPD, model.norm)
    pooled_BD = x_BPD[:, 0] if model.pool == "cls" else x_BPD.mean(1)
    return pooled_BD @ model.head.weight.t() + model.head.bias


@pytest.mark.parametrize("pool", ["cls", "mean"])
@torch.no_grad()
def test_logits_match_the_vit_definition(pool):
    torch.manual_seed(4)
    model = tiny(pool=pool, depth=3, moe_every=2, in_channels=3, num_shared_experts=1,
                 moe_kwargs={"top_k": 2, "capacity_factor": 1.0}).double()
    with torch.no_grad():
        for block in model.blocks:  # non-zero norm and expert biases, so each one must be in place
            for norm in (block.attn_norm, block.ffn_norm):
                norm.weight.normal_(1.0, 0.2)
                norm.bias.normal_(0.0, 0.2)
            if block.is_moe:
                block.ffn.experts.b1.normal_()
                block.ffn.experts.b2.normal_()
        if model.cls_token is not None:
            model.cls_token.normal_()
    images = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(model(images), reference_vit(model, images))


def test_mean_pool_is_permutation_invariant_over_patches_without_position_embedding():
    # With the position embedding zeroed and mean pooling, the model cannot tell patch order:
    # swapping two patches of the image leaves the logits unchanged (an independent property of
    # attention + mean pooling; a bug in the patch flattening or pooling would break it).
    torch.manual_seed(1)
    model = tiny(pool="mean").eval()
    with torch.no_grad():
        model.pos_embed.zero_()
    image = torch.randn(2, 1, 8, 8)
    swapped = image.clone()
    swapped[:, :, :4, :4], swapped[:, :, 4:, 4:] = image[:, :, 4:, 4:], image[:, :, :4, :4]
    torch.testing.assert_close(model(swapped), model(image), rtol=1e-5, atol=1e-5)


def test_training_reduces_loss_and_generalises():
    torch.manual_seed(2)
    generator = torch.Generator().manual_seed(3)
    prototypes = torch.randn(4, 1, 8, 8, generator=generator)
    model = tiny()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        images, labels = prototype_images(64, prototypes, generator)
        loss = F.cross_entropy(model(images), labels)
        total = loss + 0.01 * sum(layer.aux_loss for layer in moe_layers(model))
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]
    test_images, test_labels = prototype_images(256, prototypes, generator)
    with torch.no_grad():
        accuracy = (model(test_images).argmax(-1) == test_labels).float().mean().item()
    assert accuracy > 0.9


def test_gradients_reach_experts_router_and_embeddings():
    torch.manual_seed(4)
    model = tiny(num_shared_experts=1)
    images, labels = prototype_images(16, torch.randn(4, 1, 8, 8), torch.Generator().manual_seed(5))
    loss = F.cross_entropy(model(images), labels) + sum(layer.aux_loss for layer in moe_layers(model))
    loss.backward()
    layer = moe_layers(model)[0]
    expert_params = [p for p in model.parameters() if is_expert_param(p)]
    assert expert_params and all(p.grad is not None and p.grad.abs().sum() > 0 for p in expert_params)
    assert layer.gate.weight_ED.grad.abs().sum() > 0
    for param in (model.patch_embed.weight, model.pos_embed, model.cls_token, model.head.weight):
        assert param.grad.abs().sum() > 0
    assert isinstance(model.blocks[0].ffn, MoELayer)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"image_size": 10}, "image_size"),
        ({"pool": "max"}, "pool must be one of"),
        ({"moe_kwargs": {"topk": 2}}, "moe_kwargs has unknown key"),
        ({"moe_every": 0}, "moe_every"),
        ({"expert": "mlp"}, "expert"),
    ],
)
def test_bad_arguments_name_the_argument(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)
