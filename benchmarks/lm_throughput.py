"""Training throughput of a language-model preset: tokens/s and model FLOPs utilisation (MFU).

    python benchmarks/lm_throughput.py --preset moe_1b5 --batch-size 8 --seq-len 2048 --steps 20
    python benchmarks/lm_throughput.py --preset moe_1b5 --batch-size 16 --compile --profile

Each step is forward + backward + AdamW on random tokens (no data loading). The step time is the
median over the timed steps after warm-up, measured with CUDA events on a GPU. MFU is
tokens/s x flops_per_token(model, seq_len) / the device's dense bf16 peak (989 TFLOP/s on H100
and H200 SXM), the convention of PaLM; it prints as null where the peak
of the device is unknown (CPUs). The result is one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch
import torch.nn.functional as F

from moetrain.timing import peak_bf16_flops, profile_table
from moetrain.models.lm import MoETransformerLM, flops_per_token, parameter_counts
from moetrain.models.presets import PRESETS, build_lm
from moetrain.moe import moe_layers, recompute, set_activation_checkpointing, update_router_biases
from moetrain.precision.recipes import FP8_WGRADS, PRECISIONS

def model_flops_utilization(tokens_per_second: float, model: MoETransformerLM, seq_len: int, device) -> float | None:
    peak = peak_bf16_flops(device)
    return None if peak is None else tokens_per_second * flops_per_token(model, seq_len) / peak


def next_token_loss(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each position's logits against the next token, in fp32."""
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), tokens_BT[:, 1:].flatten())


def training_step(model: MoETransformerLM, optimizer: torch.optim.Optimizer, tokens_BT: torch.Tensor,
                  loss_fn=next_token_loss, autocast: bool = False) -> torch.Tensor:
    """One step on tokens_BT [B, T + 1]: forward, next-token loss + the MoE layers' aux losses
    (under bf16 autocast if asked: fp32 weights, as the trainer's precision=bf16 runs), backward,
    optimizer step, router biases; returns the loss."""
    with torch.autocast(tokens_BT.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits_BTV = model(tokens_BT[:, :-1])
        loss = loss_fn(logits_BTV, tokens_BT)
        loss = loss + sum(layer.aux_loss for layer in moe_layers(model))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    update_router_biases(model)
    return loss


def measure(model: MoETransformerLM, batch_size: int, seq_len: int, steps: int, warmup: int, lr: float = 1e-4,
            loss_fn=next_token_loss, autocast: bool = False) -> dict:
    device = model.embed.weight.device
    on_gpu = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=on_gpu)
    vocab_size = model.config.vocab_size
    seconds = []
    for step in range(warmup + steps):
        tokens_BT = torch.randint(0, vocab_size, (batch_size, seq_len + 1), device=device)
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            started = time.perf_counter()
        loss = training_step(model, optimizer, tokens_BT, loss_fn, autocast)
        if on_gpu:
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            elapsed = time.perf_counter() - started
        if step >= warmup:
            seconds.append(elapsed)
    step_seconds = statistics.median(seconds)
    tokens_per_second = batch_size * seq_len / step_seconds
    total, active = parameter_counts(model)
    return {
        "total_params": total,
        "active_params": active,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "step_ms": step_seconds * 1e3,
        "tokens_per_s": tokens_per_second,
        "model_tflops_per_token": flops_per_token(model, seq_len) / 1e12,
        "achieved_tflops": tokens_per_second * flops_per_token(model, seq_len) / 1e12,
        "mfu": model_flops_utilization(tokens_per_second, model, seq_len, device),
        "loss": loss.item(),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="moe_1b5", choices=sorted(PRESETS))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="weights and activations; routers stay float32")
    parser.add_argument("--autocast", action="store_true",
                        help="fp32 weights and AdamW state, bf16 compute under autocast: what the command trains "
                             "with (trainer.precision=bf16); default: bf16 weights and state")
    parser.add_argument("--impl", default="kernel", choices=["kernel", "torch"], help="MoE dispatch path")
    parser.add_argument("--precision", default="bf16", choices=list(PRECISIONS),
                        help="of the routed experts' GEMMs: fp8 runs those of the forward and the input gradient "
                             "in FP8 with row-wise scales, fp8_block with DeepSeek-V3's 1x128 / 128x128 block scales")
    parser.add_argument("--fp8-wgrad", default=None, choices=list(FP8_WGRADS),
                        help="with --precision fp8 | fp8_block: the experts' weight-gradient GEMM (MoELayer.fp8_wgrad; "
                             "default bf16)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each transformer block and the loss")
    parser.add_argument("--activation-checkpointing", default="none", choices=list(recompute.MODES),
                        help="recompute in the backward: selective (attention and the experts' hidden "
                             "activations, never the routing) or full (each block)")
    parser.add_argument("--profile", action="store_true",
                        help="also print the kernels of three steps as run (compiled too), most time first, and "
                             "any host syncs in a step")
    args = parser.parse_args(argv)
    if args.autocast and args.dtype != "bfloat16":
        parser.error("--autocast keeps fp32 weights and computes in bf16: leave out --dtype float32")
    if args.fp8_wgrad is not None and args.precision == "bf16":
        parser.error(f"--fp8-wgrad {args.fp8_wgrad} applies with --precision fp8 or fp8_block only")
    args.fp8_wgrad = args.fp8_wgrad or "bf16"
    if args.compile and args.activation_checkpointing == "full":
        parser.error("--activation-checkpointing full cannot be compiled (torch.compile does not trace the routing "
                     "replay of recomputed MoE blocks); use selective, or leave out --compile")

    moe_kwargs = {**PRESETS[args.preset].moe_kwargs, "impl": args.impl}
    with torch.device(args.device):
        model = build_lm(args.preset, max_seq_len=args.seq_len, moe_kwargs=moe_kwargs)
    model.to(torch.float32 if args.autocast else getattr(torch, args.dtype))
    for layer in moe_layers(model):
        layer.gate.float()
        layer.precision = args.precision
        layer.fp8_wgrad = args.fp8_wgrad
    model.reset_rotary()
    set_activation_checkpointing(model, args.activation_checkpointing)
    if args.compile:
        for block in model.blocks:
            block.compile()
    loss_fn = torch.compile(next_token_loss) if args.compile else next_token_loss
    result = {"preset": args.preset, "device": str(args.device), "dtype": args.dtype, "impl": args.impl,
              "compile": args.compile, "precision": args.precision,
              **({"fp8_wgrad": args.fp8_wgrad} if args.precision != "bf16" else {}),
              "activation_checkpointing": args.activation_checkpointing, "autocast": args.autocast,
              "param_dtype": str(model.embed.weight.dtype).removeprefix("torch."),
              **measure(model, args.batch_size, args.seq_len, args.steps, args.warmup, loss_fn=loss_fn,
                        autocast=args.autocast)}
    if result["device"].startswith("cuda"):
        result["device_name"] = torch.cuda.get_device_name()
        result["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.profile:  # one batch and optimizer for the steps it takes
        device = torch.device(args.device)
        tokens_BT = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len + 1), device=device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    print(json.dumps(result))
    if args.profile:
        print(profile_table(lambda: training_step(model, optimizer, tokens_BT, loss_fn, args.autocast), device))
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # shows the expert GEMM backend chosen
    main()
