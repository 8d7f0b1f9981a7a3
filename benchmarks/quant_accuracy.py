"""Accuracy of a small trained MoE language model per expert format (CPU; ~10 CPU-minutes at 300 steps).

    python benchmarks/quant_accuracy.py --steps 400

Trains the qwen3_moe_tiny preset (SwiGLU experts, top-4 of 16) on a synthetic Markov-chain
language (every token has `branching` equally likely successors, so the loss floor is
ln(branching)), then quantizes the routed experts of a copy of the model per format and reports
the eval loss, perplexity, how often the top prediction is a valid successor, and expert memory.
Only the routed experts are quantized; attention, router, embeddings stay fp32.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from moetrain.data.text import synthetic_lm
from moetrain.models import build_lm
from moetrain.quant.export import expert_memory
from moetrain.quant.policy import QuantPolicy, calibrate, quantize_model

POLICIES = {
    "fp32 (trained)": None,
    "bf16": QuantPolicy("bf16"),
    "fp8": QuantPolicy("fp8"),
    "fp8_block": QuantPolicy("fp8_block"),
    "mxfp4": QuantPolicy("mxfp4"),
    "nvfp4": QuantPolicy("nvfp4"),
    "mxfp4, hot 25% fp8": QuantPolicy("mxfp4", hot_format="fp8", hot_fraction=0.25),
    "nvfp4, hot 25% fp8": QuantPolicy("nvfp4", hot_format="fp8", hot_fraction=0.25),
}


@torch.no_grad()
def evaluate(model, batches, successors_VB: torch.Tensor) -> tuple[float, float]:
    """(mean cross-entropy in nats per token, fraction of top-1 predictions that are valid successors)."""
    model.eval()
    loss_sum, valid, count = 0.0, 0, 0
    for tokens_BT, targets_BT in batches:
        logits_BTV = model(tokens_BT)
        loss_sum += F.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten(), reduction="sum").item()
        predicted_BT = logits_BTV.argmax(-1)
        valid += (successors_VB[tokens_BT] == predicted_BT.unsqueeze(-1)).any(-1).sum().item()
        count += targets_BT.numel()
    return loss_sum / count, valid / count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--branching", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    data = synthetic_lm(vocab_size=256, seq_len=64, branching=args.branching, train_size=8192, eval_size=256,
                        seed=args.seed, batch_size=32, eval_batch_size=128)
    # The chain's successor table, recovered from the data, scores "valid next token" accuracy.
    tokens, targets = data.train_set.tensors
    successors_VB = torch.full((256, args.branching), -1, dtype=torch.long)
    for v in range(256):
        seen = targets[tokens == v].unique()
        successors_VB[v, : seen.numel()] = seen
    model = build_lm("qwen3_moe_tiny", vocab_size=256, max_seq_len=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    train = torch.utils.data.DataLoader(data.train_set, batch_size=32, shuffle=True, drop_last=True)
    started, step = time.time(), 0
    model.train()
    while step < args.steps:
        for tokens_BT, targets_BT in train:
            logits = model(tokens_BT)
            aux = sum(m.aux_loss for m in model.modules() if hasattr(m, "aux_loss") and m.aux_loss is not None)
            loss = F.cross_entropy(logits.flatten(0, 1), targets_BT.flatten()) + aux
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.steps:
                break
    eval_batches = list(torch.utils.data.DataLoader(data.eval_set, batch_size=128))
    calibration = [tokens_BT for tokens_BT, _ in list(train)[:8]]
    print(f"trained qwen3_moe_tiny for {args.steps} steps in {time.time() - started:.0f} s; "
          f"loss floor ln({args.branching}) = {math.log(args.branching):.4f}")
    print(f"{'experts':<22}{'eval loss':>10}{'ppl':>8}{'valid top-1':>12}{'expert MiB':>11}{'bits/w':>8}")
    for name, policy in POLICIES.items():
        quantized = build_lm("qwen3_moe_tiny", vocab_size=256, max_seq_len=64)
        quantized.load_state_dict(model.state_dict())
        if policy is not None:
            counts = calibrate(quantized, calibration) if policy.needs_calibration else None
            quantize_model(quantized, policy, counts)
        loss, valid = evaluate(quantized, eval_batches, successors_VB)
        memory = expert_memory(quantized)
        size = sum(m.bytes for m in memory.values())
        bits = 8 * size / sum(m.elements for m in memory.values())
        print(f"{name:<22}{loss:>10.4f}{math.exp(loss):>8.3f}{valid:>12.4f}{size / 2**20:>11.3f}{bits:>8.2f}")


if __name__ == "__main__":
    main()
