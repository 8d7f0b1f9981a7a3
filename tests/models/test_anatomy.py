"""moetrain.models.anatomy: every part of an LM step is found and counted as the model is built,
and timing the parts leaves the model's weights and gradients as they were."""

import torch

from moetrain.models.anatomy import PARTS, step_anatomy
from moetrain.models.presets import build_lm
from moetrain.moe import MoELayer


def test_anatomy_counts_every_part_and_leaves_the_model_unchanged():
    torch.manual_seed(torch.seed() % 2**31)
    model = build_lm("deepseek_v3_tiny", max_seq_len=16)  # dense first block, MoE with shared experts
    tokens = torch.randint(0, model.config.vocab_size, (2, 17))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    timed = []

    def time_ms(step):
        step()
        timed.append(step)
        return 1.0  # every part "takes" 1 ms per module: the counts alone decide the table

    parts = step_anatomy(model, tokens, optimizer, 100.0, time_ms)
    assert list(parts) == list(PARTS)
    depth = len(model.blocks)
    moe = sum(isinstance(m, MoELayer) for m in model.modules())
    assert moe >= 1 and depth - moe >= 1
    expected = {"attention": depth, "norms": 2 * depth + 1, "dense FFN": depth - moe, "router": moe,
                "expert GEMMs": moe, "shared experts": moe, "routing": moe, "head": 1, "loss": 1, "optimizer": 1}
    assert {k: parts[k]["count"] for k in expected} == expected
    # router, experts and shared experts are timed inside the MoE layer too: routing is what is left.
    assert parts["routing"]["ms"] == 0.0 and parts["attention"]["ms"] == depth
    assert abs(sum(p["ms"] for p in parts.values()) - 100.0) < 1e-9
    assert len(timed) == 10  # 7 module kinds, the MoE layer whole, the loss and the optimizer step
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.grad is None
