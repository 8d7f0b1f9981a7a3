"""A trained run back in Python: `load_run(run_dir)` rebuilds the model as the `moetrain` command
trained it and loads its latest (or a chosen) intact checkpoint.

    from moetrain import load_run
    run = load_run("runs/2026-12-01_10-00-00_qwen3_moe_lm")          # newest intact checkpoint
    run = load_run("runs/...", step=200)                              # that step's checkpoint
    logits = run.model(tokens_BT)

Where everything comes from:
- the config is the one saved inside the checkpoint (`state["config"]`, the composed config with
  interpolations resolved, as plain dicts): the exact settings that produced those weights, even
  when the run directory was later resumed with other settings (which rewrites .hydra/config.yaml);
- the data module is rebuilt from that config (`data._target_`), because the data fixes the
  model's input and output sizes (vocabulary, sequence length, image size, classes) unless the
  model config sets them, as the command does; a data tokenizer is read from the run's copy
  (RUN/tokenizer/, which the command writes) rather than from where it was when the run started;
- the model is built from `model._target_` with every MoE layer getting the run's saved routing
  (the gate node, moetrain.models.routing_settings.layer_kwargs), then the weights are loaded;
- the checkpoint is read by moetrain.train.checkpoint (one-process runs: step_N.pt checked against
  its .sha256) or moetrain.parallel.checkpoint (multi-process runs: step_N/ with one file per rank
  checked against SHA256SUMS, gathered into one model with every expert).

With `step=None` a newer checkpoint that is incomplete or fails its checksum is skipped (with a
warning naming it) for the newest intact one; a chosen step is loaded as it is or not at all. A
checkpoint holding objects other than tensors, containers and numbers is refused, never skipped
(moetrain.train.checkpoint: nothing in a file runs).
Every problem with the run directory is a `RunError` (a ValueError) of one line.
"""

from __future__ import annotations

import logging
import pydoc
import random
import re
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from torch import nn

from moetrain.data.base import DataModule
from moetrain.data.tokenizer import TOKENIZER_FILE, Tokenizer, load_tokenizer
from moetrain.models.routing_settings import layer_kwargs
from moetrain.train import checkpoint

log = logging.getLogger(__name__)

_STEP = re.compile(r"^step_(\d+)(\.pt)?$")
# A run's copy of its tokenizer's files (moetrain/data/tokenizer.py), written when it starts.
TOKENIZER_DIR = "tokenizer"


class RunError(ValueError):
    """A run directory that cannot be loaded: missing, without checkpoints, no such step, a config
    that does not build, or weights that do not fit the model. One line saying what and how to fix.
    data_target: the data builder whose arguments the message names, when it failed."""

    def __init__(self, message: str, data_target: str | None = None):
        super().__init__(message)
        self.data_target = data_target


@dataclass
class Run:
    """A loaded run: its model (eval mode) with the checkpoint's weights, and what it was built from."""

    run_dir: Path
    checkpoint: Path  # the step_N.pt file or the step_N/ directory of one file per rank
    step: int
    config: dict  # the composed config of the run that wrote the checkpoint (plain dicts and lists)
    model: nn.Module
    data: DataModule  # the run's own data module, rebuilt from config["data"]
    model_inputs: dict  # the model arguments the data gave (vocab_size, max_seq_len, image_size, ...)

    @property
    def task(self) -> str:
        return self.data.task

    @cached_property
    def tokenizer(self) -> Tokenizer | None:
        """The run's tokenizer: the copy in RUN/tokenizer/ (a tokenizer.json run), else its data's
        (the byte-level tokenizer for text read by it); None for token ids without a tokenizer
        (token files, the synthetic language) and for image runs."""
        if (self.run_dir / TOKENIZER_DIR / TOKENIZER_FILE).is_file():
            return load_tokenizer(self.run_dir / TOKENIZER_DIR)
        return self.data.tokenizer


def locate(path: str, key: str):
    """The object a dotted path names (what Hydra's `_target_` means), or a RunError naming `key`."""
    found = pydoc.locate(path) if isinstance(path, str) else None
    if found is None:
        raise RunError(f"{key}={path!r} cannot be imported: install the package that provides it, "
                       "or put its folder on PYTHONPATH")
    return found


@contextmanager
def _global_rng_kept():
    """Building data and model draws from the global generators: leave the caller's state as it was."""
    state = checkpoint.rng_state()
    try:
        yield
    finally:
        checkpoint.set_rng_state(state)


def build_data(data_config: dict, seed: int = 0) -> DataModule:
    """The data module a data config describes (`_target_` plus its keyword arguments), built after
    seeding as the command does; errors of the data builder become a RunError of one line."""
    if not isinstance(data_config, dict) or "_target_" not in data_config:
        raise RunError(f"the data config {data_config!r} has no _target_: give a dict such as "
                       "{'_target_': 'moetrain.data.text.text', 'path': 'corpus/'}")
    builder = locate(data_config["_target_"], "the data config's _target_")
    arguments = {key: value for key, value in data_config.items() if not (key.startswith("_") and key.endswith("_"))}
    with _global_rng_kept():
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        try:
            data = builder(**arguments)
        except (ValueError, OSError, TypeError) as error:
            raise RunError(f"data ({data_config['_target_']}): {_one_line(error)}", data_config["_target_"]) from None
    if not isinstance(data, DataModule):
        raise RunError(f"the data config's _target_={data_config['_target_']!r} returned {type(data).__name__}, "
                       "not a DataModule")
    return data


def build_model(config: dict, model_inputs: dict) -> nn.Module:
    """The model a run's config describes: model._target_ with its keys, the data's inputs it does
    not set itself, and every MoE layer's gate settings (the same construction as the command)."""
    model_config = config.get("model") or {}
    if "_target_" not in model_config:
        raise RunError("the run's config has no _target_ for its model: this is not a moetrain run's config")
    try:
        moe_kwargs = layer_kwargs(config.get("gate") or {})  # a setting the run did not save: its default
    except ValueError as error:
        raise RunError(f"the run's {_one_line(error)}") from None
    builder = locate(model_config["_target_"], "the model config's _target_")
    arguments = {key: value for key, value in model_config.items() if not (key.startswith("_") and key.endswith("_"))}
    inputs = {key: value for key, value in model_inputs.items() if key not in arguments}
    with _global_rng_kept():
        torch.manual_seed(int(config.get("seed", 0)))  # the weights are overwritten; only the build's draws
        try:
            return builder(**arguments, **inputs, moe_kwargs=moe_kwargs)
        except (ValueError, TypeError) as error:
            raise RunError(f"model ({model_config['_target_']}): {_one_line(error)}") from None


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


# In a sharded (DCP) checkpoint's state: where the weights are read from once the model exists.
_SHARDED_WEIGHTS = "sharded_weights_dir"


def _step_of(entry: Path) -> int:
    return int(_STEP.match(entry.name).group(1))


def _read(entry: Path) -> dict:
    """One checkpoint's state with the whole model: a file as it is, a per-rank directory gathered
    (every rank's file checked against SHA256SUMS). Raises CheckpointError for a damaged one."""
    checkpoint.check_complete(entry)
    if not entry.is_dir():
        return checkpoint.load(entry)
    from moetrain.parallel import checkpoint as shards  # torch.distributed only for per-rank checkpoints
    from moetrain.parallel import sharded_checkpoint as sharded

    if sharded.is_sharded_checkpoint(entry):
        # DCP (parallel=fsdp|fsdp_expert): the trainer's state now, the weights once the model is built.
        sharded.verify(entry)
        loaded = sharded.load({"model": {}, "trainer": sharded.blob(None)}, entry, distributed=False)
        return {**loaded["trainer"], _SHARDED_WEIGHTS: entry}

    try:
        return shards.consolidate(shards.load_shards(str(entry)))
    except (FileNotFoundError, KeyError) as error:
        raise checkpoint.CheckpointError(f"{entry}: {_one_line(error)}") from None


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> tuple[Path, dict]:
    """(checkpoint path, its state) of the run directory: `step`'s checkpoint, or with None the
    newest intact one (newer incomplete or corrupted ones are skipped with a warning)."""
    run_dir = Path(run_dir).expanduser()
    if not run_dir.exists():
        raise RunError(f"run directory {run_dir} does not exist: pass the folder a moetrain run wrote "
                       "(runs/<date>_<time>_<name>)")
    if not run_dir.is_dir():
        raise RunError(f"{run_dir} is a file, not a run directory: pass the folder that holds checkpoints/")
    folder = run_dir / checkpoint.CHECKPOINT_DIR
    entries = checkpoint.checkpoints(folder)
    if not entries:
        raise RunError(f"no checkpoint in {folder}: the run saved none yet (TrainerConfig.checkpoint_every, or it "
                       "stopped before its first save); train it further or pass another run directory")
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int):
            raise RunError(f"step must be an integer step number, got {step!r}")
        chosen = [entry for entry in entries if _step_of(entry) == step]
        if not chosen:
            steps = ", ".join(str(_step_of(entry)) for entry in entries)
            raise RunError(f"{run_dir} has no checkpoint of step {step}: it has step(s) {steps}")
        try:
            return chosen[0], _read(chosen[0])
        except checkpoint.CheckpointError as error:
            raise RunError(f"step {step}: {_one_line(error)}") from None
    skipped = []
    for entry in reversed(entries):
        try:
            return entry, _read(entry)
        except checkpoint.UnsafeCheckpointError as error:  # refused, not damaged: no older one instead
            raise RunError(_one_line(error)) from None
        except checkpoint.CheckpointError as error:
            log.warning("skipping %s: %s", entry.name, _one_line(error))
            skipped.append(entry.name)
    raise RunError(f"no intact checkpoint in {folder}: {', '.join(skipped)} "
                   f"{'is' if len(skipped) == 1 else 'are'} incomplete or corrupted (each reason is logged); "
                   "restore one from a copy")


def load_run(run_dir: str | Path, step: int | None = None, device: str | torch.device = "cpu") -> Run:
    """The model of a run directory as trained (see the module doc), in eval mode on `device`."""
    path, state = find_checkpoint(run_dir, step)
    config = state.get("config")
    if not isinstance(config, dict) or "model" not in config or "data" not in config:
        raise RunError(f"{path} holds no run config (model and data): it was not written by the moetrain trainer")
    data_config = dict(config["data"])
    recorded = Path(run_dir).expanduser() / TOKENIZER_DIR
    if data_config.get("tokenizer") and (recorded / TOKENIZER_FILE).is_file():
        data_config["tokenizer"] = str(recorded)  # the run's own copy: the original may have moved since
    data = build_data(data_config, int(config.get("seed", 0)))
    model = build_model(config, data.model_inputs)
    try:
        if _SHARDED_WEIGHTS in state:
            from moetrain.parallel import sharded_checkpoint as sharded

            weights = model.state_dict()
            sharded.load({"model": weights}, state[_SHARDED_WEIGHTS], distributed=False)  # in place
        else:
            model.load_state_dict(state["model"])
    except (RuntimeError, checkpoint.CheckpointError) as error:
        first = next((line.strip() for line in str(error).splitlines()[1:] if line.strip()), _one_line(error))
        raise RunError(f"{path} does not fit the model its own config builds ({first}): was the data it was "
                       "trained on changed since? (the data fixes the vocabulary, sequence and image sizes)") from None
    model.to(device).eval()
    return Run(run_dir=Path(run_dir), checkpoint=path, step=int(state["step"]), config=config, model=model,
               data=data, model_inputs=dict(data.model_inputs))
