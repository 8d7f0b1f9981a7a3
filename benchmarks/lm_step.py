"""One language-model training step, moetrain against transformers, side by side in one process.

    python benchmarks/lm_step.py                                  # moe_1b5, batch 16 x 2048, on a GPU
    python benchmarks/lm_step.py --variants moetrain,moetrain:fp8,transformers:blocks --steps 10
    python benchmarks/lm_step.py --optimizer adamw                # bf16 AdamW state instead of fp32 masters

The same model twice: moetrain's `build_lm(PRESET)` and transformers' `Qwen3MoeForCausalLM` of the
same sizes (the preset must be a softmax top-k, renormalised, dropless SwiGLU MoE without shared
experts, as moe_1b5 is), bf16 parameters, SDPA attention, transformers' `grouped_mm` experts. Both
train on the same random token batches with the same loss (next-token cross-entropy in fp32 plus the
balance loss at the preset's weight) and the same optimizer:

  --optimizer master   moetrain.train.optim.MasterWeightAdamW: fp32 master weights and moments (the
                       arrangement `trainer.param_dtype=bfloat16` trains with; the default)
  --optimizer master-bf16
                       the same with its moments stored in bf16 (optim.moment_dtype=bfloat16)
  --optimizer adamw    torch's fused AdamW on the bf16 parameters (bf16 moments)

A variant is SYSTEM[:COMPILE][:PRECISION][:LOSS]: SYSTEM moetrain or transformers; COMPILE model (the whole
model and the loss, as the trainer compiles them; the default), blocks (each transformer block /
decoder layer and the loss) or none; PRECISION bf16 (default), fp8 (moetrain's expert GEMMs in FP8,
as trainer.precision=fp8) or fp8_linears (the blocks' dense linears in FP8 too, as
trainer.fp8_linears=true); LOSS, moetrain only: fused (the default, as trainer.fused_loss=true: the
model's forward with targets, the head and the loss chunk by chunk, no logits kept) or logits (the
logits, then the compiled loss, as transformers is measured). moetrain runs under bf16 autocast, as
the trainer does.

Each variant is timed alone (its model built, warmed up, timed, freed): the step time is the median
of CUDA-event timings after warm-up; tokens/s = batch x seq_len / step time; MFU = tokens/s x the
preset's training FLOPs per token / 989 TFLOP/s (moetrain.timing.peak_bf16_flops); peak GiB is the
step's allocator peak. Without transformers installed, its variants are skipped with one line.
The last line printed is a Markdown table; --json writes every figure. A variant that fails is a
row of the table and makes the command exit 1.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import sys

import torch
import torch.nn.functional as F

from moetrain.models.lm import flops_per_token
from moetrain.models.presets import PRESETS, build_lm
from moetrain.moe import moe_layers, set_parameter_dtype, set_training_precision, update_router_biases
from moetrain.timing import peak_bf16_flops, step_times_ms
from moetrain.train.optim import MasterWeightAdamW


def next_token_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())


def transformers_config(preset: str, seq_len: int):
    """Qwen3MoeConfig of the preset's sizes (refuses presets Qwen3-MoE cannot express)."""
    from transformers import Qwen3MoeConfig

    c = PRESETS[preset]
    moe = c.moe_kwargs
    if (c.attention != "gqa" and c.attention != "mha") or c.num_shared_experts or moe.get("gate") != "top" \
            or moe.get("capacity_factor") != 0 or not moe.get("gate_kwargs", {}).get("normalize"):
        raise SystemExit(f"lm_step: preset {preset} is not a Qwen3-MoE-shaped model (softmax top-k renormalised, "
                         "dropless, no shared experts); use --preset moe_1b5")
    return Qwen3MoeConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, num_hidden_layers=c.depth, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads or c.num_heads, head_dim=c.head_dim or c.dim // c.num_heads,
        intermediate_size=c.expert_hidden_size, moe_intermediate_size=c.expert_hidden_size,
        num_experts=c.num_experts, num_experts_per_tok=moe["top_k"], norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=seq_len, rms_norm_eps=c.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta}, rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_embeddings, attention_bias=False, router_aux_loss_coef=moe["balance_loss_weight"],
        output_router_logits=True, use_cache=False,
    )


def build(system: str, compile_mode: str, precision: str, fused: bool, preset: str, seq_len: int, device):
    """(model, forward(tokens, targets) -> (logits or None, loss or None, aux loss), autocast context
    factory): the loss comes from the model when fused, else the logits."""
    if system == "moetrain":
        with torch.device(device):
            model = build_lm(preset, max_seq_len=seq_len)
        set_parameter_dtype(model, torch.bfloat16)
        set_training_precision(model, "bf16" if precision == "bf16" else "fp8", fp8_linears=precision == "fp8_linears")
        layers = moe_layers(model)
        if compile_mode == "blocks":
            for block in model.blocks:
                block.compile()
        forward_model = torch.compile(model) if compile_mode == "model" else model

        def forward(tokens_BT, targets_BT):
            out = forward_model(tokens_BT, targets=targets_BT) if fused else forward_model(tokens_BT)
            aux = sum(layer.aux_loss for layer in layers)
            return (None, out, aux) if fused else (out, None, aux)

        return model, forward, (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(transformers_config(preset, seq_len), dtype=torch.bfloat16,
                                             attn_implementation="sdpa", experts_implementation="grouped_mm").to(device)
    if compile_mode == "blocks":
        for layer in model.model.layers:
            layer.compile()
    forward_model = torch.compile(model) if compile_mode == "model" else model
    coefficient = model.config.router_aux_loss_coef

    def forward(tokens_BT, targets_BT):
        out = forward_model(input_ids=tokens_BT)
        return out.logits, None, coefficient * out.aux_loss

    return model, forward, contextlib.nullcontext


def measure(variant: str, args, device, batches) -> dict:
    parts = variant.split(":")
    system, compile_mode, precision = parts[0], (parts[1:2] or ["model"])[0], (parts[2:3] or ["bf16"])[0]
    loss_kind = (parts[3:4] or ["fused" if system == "moetrain" else "logits"])[0]
    if system not in ("moetrain", "transformers") or compile_mode not in ("model", "blocks", "none") \
            or precision not in ("bf16", "fp8", "fp8_linears") or loss_kind not in ("fused", "logits") or len(parts) > 4 \
            or (system == "transformers" and (precision, loss_kind) != ("bf16", "logits")):
        raise SystemExit(f"lm_step: unknown variant {variant!r}: SYSTEM[:COMPILE][:PRECISION][:LOSS] with SYSTEM "
                         "moetrain|transformers, COMPILE model|blocks|none, PRECISION bf16|fp8|fp8_linears, LOSS "
                         "fused|logits (fp8, fp8_linears and fused: moetrain only)")
    torch.manual_seed(0)
    model, forward, autocast = build(system, compile_mode, precision, loss_kind == "fused", args.preset, args.seq_len,
                                     device)
    params = [p for p in model.parameters() if p.requires_grad]
    if args.optimizer in ("master", "master-bf16"):
        moments = torch.bfloat16 if args.optimizer == "master-bf16" else torch.float32
        optimizer = MasterWeightAdamW(params, lr=1e-4, weight_decay=0.1, moment_dtype=moments)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
    loss_fn = next_token_loss if compile_mode == "none" else torch.compile(next_token_loss)
    position = [0]

    def step():
        tokens_BT = batches[position[0] % len(batches)]
        position[0] += 1
        with autocast():
            logits_BTV, loss, aux = forward(tokens_BT[:, :-1], tokens_BT[:, 1:])
            loss = (loss if logits_BTV is None else loss_fn(logits_BTV, tokens_BT[:, 1:])) + aux
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if system == "moetrain":
            update_router_biases(model)

    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    times = sorted(step_times_ms(step, device, warmup=args.warmup, steps=args.steps))
    step_ms = times[len(times) // 2]
    tokens_per_s = args.batch_size * args.seq_len / step_ms * 1e3
    peak = peak_bf16_flops(device)
    result = {"variant": f"{system}:{compile_mode}:{precision}:{loss_kind}", "optimizer": args.optimizer,
              "step_ms": step_ms,
              "step_ms_range": [times[0], times[-1]], "tokens_per_s": tokens_per_s,
              "mfu": None if peak is None else tokens_per_s * args.flops_per_token / peak,
              "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else None}
    del model, forward, optimizer, step
    _free(device)
    return result


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="moe_1b5")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--optimizer", default="master", choices=["master", "master-bf16", "adamw"])
    parser.add_argument("--variants", default="transformers:blocks,transformers:model,moetrain:model,moetrain:model:fp8")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to try the script on a tiny preset")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("lm_step: no CUDA GPU here (it times bf16 training steps); --device cpu tries it on a "
                         "tiny preset")
    with torch.device("meta"):
        args.flops_per_token = flops_per_token(build_lm(args.preset, max_seq_len=args.seq_len), args.seq_len)
    variants = args.variants.split(",")
    if importlib.util.find_spec("transformers") is None:
        print("lm_step: transformers is not installed: its variants are skipped (pip install transformers)")
        variants = [v for v in variants if not v.startswith("transformers")]
    generator = torch.Generator(device).manual_seed(0)
    batches = [torch.randint(0, PRESETS[args.preset].vocab_size, (args.batch_size, args.seq_len + 1), device=device,
                             generator=generator) for _ in range(4)]
    results = []
    for variant in variants:
        try:
            result = measure(variant, args, device, batches)
        except Exception as error:  # one failing variant must not hide the others' figures
            result = {"variant": variant, "error": f"{type(error).__name__}: {str(error)[:300]}"}
            _free(device)
        print(json.dumps(result), flush=True)
        results.append(result)
    baseline = next((r for r in results if r["variant"].startswith("transformers") and "error" not in r), None)
    best_baseline = max((r for r in results if r["variant"].startswith("transformers") and "error" not in r),
                        key=lambda r: r["tokens_per_s"], default=baseline)
    print(f"\n{args.preset}, batch {args.batch_size} x {args.seq_len}, optimizer {args.optimizer}, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}"
          + (f", transformers {__import__('transformers').__version__}" if best_baseline else ""))
    print("| variant | step ms | tokens/s | MFU | peak GiB | vs best transformers |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | failed: {r['error'][:80]} | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / best_baseline['tokens_per_s']:.2f}x" if best_baseline else "-"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        print(f"| {r['variant']} | {r['step_ms']:.1f} | {r['tokens_per_s'] / 1e3:.1f}k | {mfu} | {peak} "
              f"| {ratio} |")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2)
    return results


if __name__ == "__main__":
    figures = main()
    sys.exit(1 if not figures or any("error" in result for result in figures) else 0)  # a failed variant fails the run
