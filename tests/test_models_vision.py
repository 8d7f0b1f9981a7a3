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
