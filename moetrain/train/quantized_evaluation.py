"""mode=eval: a trained checkpoint evaluated as trained, then with quantized routed experts.

The trainer loads trainer.resume's model weights and evaluates them (its own evaluate path, so the
numbers match the training run's eval metrics); then moetrain.quant replaces every MoE layer's
experts with quantized ones as the quant config says, the expert-weight memory is logged, and the
same eval set is scored again. With quant.export the quantized model is saved and loaded back
into a freshly built model, whose state must equal the one in memory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from itertools import islice

import torch
from torch import nn

from moetrain.config import QuantConfig
from moetrain.data.base import forward_batch
from moetrain.quant import QuantPolicy, calibrate, expert_memory, format_memory, load_quantized, quantize_model, save_quantized
from moetrain.train.trainer import Trainer

log = logging.getLogger(__name__)


def _memory_bytes(model: nn.Module) -> int:
    return sum(row.bytes for row in expert_memory(model).values())


def _summary(metrics: dict) -> str:
    text = f"eval loss {metrics['eval/loss']:.4f}, accuracy {metrics['eval/accuracy']:.4f}"
    if "eval/perplexity" in metrics:
        text += f", perplexity {metrics['eval/perplexity']:.3f}"
    return text


def _check_export(model: nn.Module, path: str, build_model: Callable[[], nn.Module]) -> None:
    """Load the exported file into a fresh model: every tensor must equal the in-memory one."""
    fresh = build_model()
    load_quantized(fresh, path)
    expected, loaded = model.state_dict(), fresh.state_dict()
    differing = [key for key in expected if not torch.equal(expected[key].cpu(), loaded[key].cpu())]
    if differing:
        raise RuntimeError(f"the exported quantized checkpoint {path} does not load back: {differing[:3]} differ")


def evaluate_quantized(trainer: Trainer, quant: QuantConfig, build_model: Callable[[], nn.Module]) -> dict:
    """Evaluate trainer.resume's model unquantized and quantized; returns (and writes to the run
    directory's metrics.json) eval/* of the model as trained, quant/eval/* quantized, and
    quant/change/* = quantized minus as trained. build_model: a fresh model of the same config."""
    path = trainer.load_model()
    log.info("evaluating %s (step %d)", path, trainer.step)
    model = trainer.model
    metrics = trainer.evaluate()
    metrics["expert_bytes"] = _memory_bytes(model)
    log.info("as trained: %s; expert weights:\n%s", _summary(metrics), format_memory(expert_memory(model)))
    if quant.format is None:
        log.info("quant=none: no quantized evaluation (choose quant=fp8|fp8_block|mxfp4|nvfp4|mixed)")
    else:
        policy = QuantPolicy(quant.format, quant.hot_format, quant.hot_fraction)
        counts = None
        if policy.needs_calibration:
            # Expert use measured on training batches, so the eval set stays unseen.
            batches = islice(trainer.stream, quant.calibration_batches)
            with trainer.autocast():
                counts = calibrate(model, batches, run=lambda m, batch: forward_batch(m, batch, trainer.device))
        plan = quantize_model(model, policy, counts)
        quantized = trainer.evaluate()
        name = quant.format if quant.hot_format is None else f"{quant.hot_format}/{quant.format}"
        for key, value in quantized.items():
            metrics[f"quant/{key}"] = value
            metrics[f"quant/change/{key.split('/', 1)[1]}"] = value - metrics[key]
        metrics["quant/expert_bytes"] = _memory_bytes(model)
        log.info("%s experts: %s (change: loss %+.4f, accuracy %+.4f); expert weights:\n%s", name, _summary(quantized),
                 metrics["quant/change/loss"], metrics["quant/change/accuracy"], format_memory(expert_memory(model)))
        if quant.export is not None:
            save_quantized(model, plan, quant.export)
            _check_export(model, quant.export, build_model)
            log.info("quantized checkpoint %s (loads back with moetrain.quant.load_quantized)", quant.export)
    metrics["step"] = trainer.step
    (trainer.run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics
