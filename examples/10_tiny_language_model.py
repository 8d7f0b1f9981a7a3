"""A tiny DeepSeek-V3-style MoE language model from a preset, trained from scratch with a plain
loop, then generating greedily.

    python examples/10_tiny_language_model.py

build_lm("deepseek_v3_tiny") keeps the architecture's distinctive parts at CPU size: multi-head
latent attention, a dense first block, fine-grained routed experts plus a shared expert, and the
sigmoid gate with aux-loss-free bias balancing (so update_router_biases runs after each step).
The toy language: every sequence counts upwards by its own stride, modulo the vocabulary, so the
next token follows from the previous two.
"""

import torch
import torch.nn.functional as F

from moetrain.models import build_lm, parameter_counts
from moetrain.moe import moe_layers, update_router_biases


def counting_batch(batch: int, length: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    start_B1 = torch.randint(vocab, (batch, 1), generator=generator)
    stride_B1 = torch.randint(1, 4, (batch, 1), generator=generator)
    return (start_B1 + stride_B1 * torch.arange(length)) % vocab


def counting_batch_from(prompt_BT: torch.Tensor, length: int, vocab: int) -> torch.Tensor:
    """The true continuation of each prompt: same start, same stride."""
    stride_B1 = (prompt_BT[:, 1:2] - prompt_BT[:, :1]) % vocab
    return (prompt_BT[:, :1] + stride_B1 * torch.arange(length, device=prompt_BT.device)) % vocab


@torch.no_grad()
def generate(model, prompt_BT: torch.Tensor, new_tokens: int) -> torch.Tensor:
    tokens_BT = prompt_BT
    for _ in range(new_tokens):
        next_B1 = model(tokens_BT)[:, -1].argmax(-1, keepdim=True)
        tokens_BT = torch.cat([tokens_BT, next_B1], dim=1)
    return tokens_BT


def main(steps=100, batch=32, seq_len=24, vocab=64, lr=3e-3):
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_lm("deepseek_v3_tiny", vocab_size=vocab).to(device)
    total, active = parameter_counts(model)
    print(f"deepseek_v3_tiny: {total / 1e6:.2f}M parameters, {active / 1e6:.2f}M active per token, "
          f"{len(moe_layers(model))} MoE layers")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1)

    losses = []
    for step in range(steps):
        tokens_BT = counting_batch(batch, seq_len + 1, vocab, generator).to(device)
        logits_BTV = model(tokens_BT[:, :-1])
        loss = F.cross_entropy(logits_BTV.flatten(0, 1), tokens_BT[:, 1:].flatten())
        aux = sum(layer.aux_loss for layer in moe_layers(model))
        optimizer.zero_grad(set_to_none=True)
        (loss + aux).backward()
        optimizer.step()
        update_router_biases(model)  # the sigmoid gates' load-balancing bias
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}")

    model.eval()
    prompts_BT = counting_batch(4, 6, vocab, generator).to(device)
    out_BT = generate(model, prompts_BT, new_tokens=8)
    expected_BT = counting_batch_from(prompts_BT, 14, vocab)
    correct = (out_BT[:, 6:] == expected_BT[:, 6:]).float().mean().item()
    for prompt, out in zip(prompts_BT.tolist(), out_BT[:, 6:].tolist()):
        print(f"prompt {prompt} -> {out}")
    print(f"continuations correct: {correct:.0%}")
    return {"first_loss": losses[0], "last_loss": sum(losses[-10:]) / 10, "generated_correct": correct,
            "total_params": total, "active_params": active}


if __name__ == "__main__":
    main()
