"""A language-model run exported as a Hugging Face checkpoint directory (config.json + safetensors).

    from moetrain import load_run
    from moetrain.export import export_hf
    run = load_run("runs/..._qwen3_moe_lm")
    model_type = export_hf(run, "exported/")          # "qwen3_moe": the architecture the model matches
    model = moetrain.models.load_hf_checkpoint("exported/")   # same logits as run.model

The architecture is the first of qwen3_moe, deepseek_v3 and mixtral whose layout the model has
(moetrain.models.hf.hf_config decides: attention kind, q/k norms, gate kind, shared and dense
blocks, SwiGLU experts); kimi_k2 (DeepSeek-V3's architecture under another name) only when asked
for. The weights are written by moetrain.models.hf.save_hf_checkpoint in the model's dtype.

A run that started from a Hugging Face checkpoint (`model=hf`, moetrain.models.hf.pretrained_lm)
is written back as that checkpoint's model_type, each tensor in the dtype the checkpoint stores it
in, with the checkpoint's other config.json keys: after `optim.lr=0` its weights come back bit for
bit. The run's tokenizer (the files of RUN/tokenizer/, when the run recorded one) is copied beside
the weights, so that transformers' AutoTokenizer reads it from the same folder.

Hugging Face's implementations of these architectures route every token to its experts. A run
trained with an expert capacity (gate.capacity_factor > 0) drops the tokens over it, so the export
would compute other logits wherever a token is dropped: that is refused unless the caller accepts
dropless routing (allow_dropless=True).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from torch import nn

from moetrain.models.hf import CheckpointError, Pretrained, hf_config, save_hf_checkpoint
from moetrain.models.lm import MoETransformerLM
from moetrain.run import Run, RunError

ARCHITECTURES = ("qwen3_moe", "deepseek_v3", "mixtral")
EXPORTABLE = ARCHITECTURES + ("kimi_k2",)
# Where a run directory keeps the files of the tokenizer it trained with (Hugging Face's layout).
TOKENIZER_DIR = "tokenizer"


class ExportError(RunError):
    """A run that cannot be written in the asked (or any) Hugging Face architecture: one line why."""


def matching_architecture(model: nn.Module) -> str:
    """The first of ARCHITECTURES the model's layout fits; ExportError with every reason otherwise."""
    if not isinstance(model, MoETransformerLM):
        raise ExportError(f"{type(model).__name__} is not a language model (MoETransformerLM): only LM runs export "
                          "to Hugging Face checkpoints")
    reasons = []
    for model_type in ARCHITECTURES:
        try:
            hf_config(model.config, model_type)
            return model_type
        except CheckpointError as error:
            reasons.append(str(error))
    raise ExportError("the model fits no Hugging Face architecture moetrain writes: " + "; ".join(reasons))


def export_hf(run: Run | nn.Module, directory: str | Path, model_type: str | None = None,
              allow_dropless: bool = False) -> str:
    """Write `run`'s model (a Run or an MoETransformerLM) to `directory` as a Hugging Face
    checkpoint of `model_type` (None: the checkpoint's the run started from, else the matching
    architecture), with the run's tokenizer files; returns the model_type written."""
    model = run.model if isinstance(run, Run) else run
    source: Pretrained | None = getattr(model, "pretrained", None)
    if model_type is None:
        model_type = source.model_type if source is not None else matching_architecture(model)
    elif model_type not in EXPORTABLE:
        raise ExportError(f"model_type must be one of {'|'.join(EXPORTABLE)}, got {model_type!r}")
    if not isinstance(model, MoETransformerLM):
        raise ExportError(f"{type(model).__name__} is not a language model (MoETransformerLM): only LM runs export "
                          "to Hugging Face checkpoints")
    capacity_factor = model.config.moe_kwargs.get("capacity_factor", 1.0)
    if capacity_factor > 0 and not allow_dropless:
        raise ExportError(
            f"the run routes with GateConfig.capacity_factor={capacity_factor:g} (tokens over an expert's capacity "
            f"are dropped) but Hugging Face's {model_type} routes every token, so its logits would differ where "
            "tokens are dropped: train with GateConfig.capacity_factor=0, or accept dropless routing "
            "(allow_dropless=True)")
    directory = Path(directory)
    if directory.is_file() or (directory.is_dir() and any(directory.iterdir())):
        raise ExportError(f"{directory} exists and is not an empty folder: export into a new or empty folder")
    tokenizer = Path(run.run_dir) / TOKENIZER_DIR if isinstance(run, Run) else None
    if tokenizer is not None and tokenizer.is_dir():
        clashes = sorted(path.name for path in tokenizer.iterdir()
                         if path.name == "config.json" or path.name.startswith("model") and ".safetensors" in path.name)
        if clashes:
            raise ExportError(f"{tokenizer} holds {', '.join(clashes)}, which the export writes itself: keep only the "
                              "tokenizer's files there")
    try:
        # The source's dtypes and config keys only where the model is written as the source's architecture.
        save_hf_checkpoint(model, directory, model_type,
                           source=source if source is not None and source.model_type == model_type else None)
    except CheckpointError as error:
        raise ExportError(str(error)) from None
    if tokenizer is not None and tokenizer.is_dir():
        shutil.copytree(tokenizer, directory, dirs_exist_ok=True)
    return model_type
