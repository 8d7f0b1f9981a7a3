"""Evaluation of a model, or of a loaded run on its own evaluation set or another data config,
optionally with quantized routed experts; a progress bar that advances once per batch.

    from moetrain import load_run
    from moetrain.evaluate import evaluate_run
    run = load_run("runs/...")
    evaluate_run(run)                                               # its own evaluation set
    evaluate_run(run, data={**run.config["data"], "path": "other_corpus/"})   # another data config
    evaluate_run(run, quant="mxfp4")                                # MXFP4 experts (moetrain.quant)

Metrics, over every scored target (targets of -100 are not scored), as the trainer defines them:
  eval/loss            mean cross-entropy in nats
  eval/accuracy        fraction of targets whose largest logit is the target
  eval/perplexity      exp(eval/loss), language modelling only
  eval/bits_per_byte   text (a run with a tokenizer) only: the total cross-entropy in nats of the
                       targets that are text, over the total UTF-8 bytes of that text (each target
                       token's bytes, Tokenizer.byte_lengths), divided by ln 2. Special tokens (the
                       end-of-text token between documents) are not text: they count in neither sum.
                       For the byte-level tokenizer every text token is one byte.
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from itertools import islice

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from moetrain.data.base import DataModule, forward_batch, unpack_batch
from moetrain.ops.linear_cross_entropy import IGNORE_INDEX  # the trainer's: targets that are not scored
from moetrain.quant import QuantPolicy, calibrate, expert_memory, quantize_model
from moetrain.run import Run, RunError, build_data

PERPLEXITY_LOSS_CAP = 50.0  # exp() of a larger loss overflows to a useless number
PRECISIONS = ("auto", "bf16", "fp32")  # auto: bf16 autocast on CUDA, fp32 on a CPU (the trainer's rule)


@torch.no_grad()
def evaluate(model: nn.Module, loader, task: str, token_bytes: torch.Tensor | None = None, max_batches: int = 0,
             progress: bool = True, precision: str = "auto", desc: str = "eval") -> dict:
    """Metrics of `model` over `loader`'s (inputs, targets) batches (see the module doc); the first
    max_batches only when > 0. token_bytes [V]: the UTF-8 bytes each token id stands for (0: not
    text), which adds bits per byte. The bar advances per batch and shows the running loss."""
    if precision not in PRECISIONS:
        raise RunError(f"precision must be one of {'|'.join(PRECISIONS)}, got {precision!r}")
    device = next(model.parameters()).device
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else nullcontext
    total = len(loader) if hasattr(loader, "__len__") else None
    if max_batches and total is not None:
        total = min(total, max_batches)
    loss_sum = text_nats = 0.0
    correct = count = bytes_scored = 0
    was_training = model.training
    model.eval()
    batches = islice(loader, max_batches) if max_batches else loader
    bar = tqdm(batches, total=total, desc=desc, unit="batch", dynamic_ncols=True, disable=not progress)
    try:
        for batch in bar:
            inputs, targets, arguments = unpack_batch(batch, device)
            with autocast():
                logits = model(inputs, **arguments)
            logits_NC, targets_N = logits.float().flatten(0, -2), targets.flatten()
            scored_N = targets_N != IGNORE_INDEX
            losses_N = F.cross_entropy(logits_NC, targets_N, ignore_index=IGNORE_INDEX, reduction="none")
            loss_sum += float(losses_N[scored_N].double().sum())
            correct += int((logits_NC.argmax(dim=-1) == targets_N)[scored_N].sum())
            count += int(scored_N.sum())
            if token_bytes is not None:
                bytes_N = token_bytes.to(device)[targets_N.clamp(min=0)] * scored_N
                text_nats += float(losses_N[bytes_N > 0].double().sum())
                bytes_scored += int(bytes_N.sum())
            bar.set_postfix(loss=f"{loss_sum / max(count, 1):.4f}", refresh=False)
    finally:
        bar.close()
        model.train(was_training)
    if count == 0:
        raise RunError("the evaluation set has no scored target: it is empty (or every target is -100)")
    metrics = {"eval/loss": loss_sum / count, "eval/accuracy": correct / count}
    if task == "language_modeling":
        metrics["eval/perplexity"] = math.exp(min(metrics["eval/loss"], PERPLEXITY_LOSS_CAP))
    if token_bytes is not None and bytes_scored:
        metrics["eval/bits_per_byte"] = text_nats / bytes_scored / math.log(2)
    return metrics


def _check_fits(run: Run, data: DataModule) -> None:
    """Other data must give the model the inputs it was built with (sequence length: at most it)."""
    if data.task != run.task:
        raise RunError(f"the data is for {data.task} but the run's model does {run.task}: pick data of its task")
    ours, theirs = run.tokenizer, data.tokenizer
    if ours is not None and theirs is not None and ours.sha256 != theirs.sha256:
        raise RunError(f"the data is tokenized by {theirs.source} (sha256 {str(theirs.sha256)[:12]}...), not by the "
                       f"run's tokenizer ({ours.source}): evaluate on data tokenized by the run's tokenizer "
                       f"(the data config's tokenizer: {run.run_dir / 'tokenizer'})")
    model_keys = run.config.get("model", {})
    for key, built in run.model_inputs.items():
        given = data.model_inputs.get(key)
        if key in model_keys or given == built:
            continue
        if key == "max_seq_len" and isinstance(given, int) and given <= built:
            continue  # shorter sequences run on the same model
        raise RunError(f"the data gives the model {key}={given} but the run's model was built with {key}={built} "
                       f"(from its own data): evaluate on data with data.{_DATA_KEY.get(key, key)}={built}")


# The data key that sets each model input, for the message (most data builders name them so).
_DATA_KEY = {"max_seq_len": "seq_len", "vocab_size": "vocab_size", "image_size": "image_size",
             "in_channels": "in_channels", "num_classes": "num_classes"}


def evaluate_run(run: Run, data: dict | None = None, quant: str | QuantPolicy | None = None,
                 calibration_batches: int = 0, eval_batches: int = 0, progress: bool = True,
                 precision: str = "auto") -> dict:
    """Metrics of a loaded run (see the module doc) on its own evaluation set, or on the one of
    `data` (a data config: `_target_` and its arguments, e.g. the run's with another path).

    quant: a format name (fp8, fp8_block, mxfp4, nvfp4) or a QuantPolicy: a copy of the model gets
    quantized routed experts (the run's model is untouched); a hot/cold policy measures expert use
    on `calibration_batches` training batches of the evaluated data. Adds expert_bytes, the routed
    expert weights' memory."""
    module = run.data if data is None else build_data(data, int(run.config.get("seed", 0)))
    _check_fits(run, module)
    model = run.model
    metrics = {}
    if quant is not None:
        policy = QuantPolicy(format=quant) if isinstance(quant, str) else quant
        counts = None
        if policy.needs_calibration:
            if calibration_batches <= 0:
                raise RunError(f"hot_format={policy.hot_format} goes to the most used experts: measure their use "
                               "with calibration_batches > 0 (training batches of the evaluated data)")
            device = next(model.parameters()).device
            loader = DataLoader(module.train_set, batch_size=module.batch_size)
            counts = calibrate(model, islice(loader, calibration_batches), run=lambda m, batch: forward_batch(m, batch, device))
        model = copy.deepcopy(model)
        quantize_model(model, policy, counts)
        metrics["expert_bytes"] = sum(row.bytes for row in expert_memory(model).values())
    loader = DataLoader(module.eval_set, batch_size=module.eval_batch_size, num_workers=module.num_workers)
    tokenizer = module.tokenizer
    token_bytes = torch.as_tensor(tokenizer.byte_lengths()) if tokenizer is not None else None
    metrics.update(evaluate(model, loader, module.task, token_bytes=token_bytes, max_batches=eval_batches,
                            progress=progress, precision=precision))
    return metrics
