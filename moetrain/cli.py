"""The `moetrain` command (also `python -m moetrain`): compose the config with Hydra, check it, train.

    moetrain +recipe=quickstart
    moetrain +recipe=switch_cifar10 trainer.max_steps=2000 gate.top_k=2 optim.lr=3e-4
    moetrain -m +recipe=quickstart gate=switch,gshard
    moetrain +recipe=quickstart mode=eval quant=mxfp4 trainer.resume=runs/RUN quant.export=model.mxfp4.pt
    moetrain model=hf model.path=CHECKPOINT_DIR data=text data.path=CORPUS

This is the only module that knows Hydra. The configs ship as the package moetrain.conf (groups
model, gate, parallel, data, optim, trainer, logger, quant) and recipes as moetrain.recipes, registered
here in the ConfigStore group `recipe` (package _global_) so that `+recipe=NAME` finds them.

Every configuration mistake ends the same way: exit code 2 and one line on stderr that names the
key and the fix, never a traceback. Hydra reports its own composition errors in several lines
with exit code 1, so `main` composes the command line itself (each combination of a sweep) with
Hydra's compose API and turns any failure into that one line. A single run is composed once: the
config that was checked is the one run_composed hands to Hydra's job runner, which makes the run
directory and calls `train`. A sweep's jobs are checked the same way first, then composed again
by Hydra's sweeper, which runs them.

`model=hf` starts from a Hugging Face checkpoint directory: its routing is read from model.path's
config.json into the gate node (a second composition, under the command line's gate keys) and its
weights are read before the run directory exists (use_checkpoint_routing, prebuild_checkpoint_model).

The library raises plain errors that name settings as its Python API does (SettingError:
`TrainerConfig.resume='x'`, a data builder's `root='data'`); in_config_keys turns them into the
config keys a user types (`trainer.resume=x`, `data.root=data`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import itertools
import logging
import os
import shutil
import signal
import sys
import threading
import typing
from importlib import resources
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import run_job
from hydra.errors import HydraException, InstantiationException
from hydra.experimental.callback import Callback
from hydra.types import HydraContext, RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException
from tqdm import tqdm

from moetrain.command_errors import (
    CONFIG_MODULE, CONFIG_NAME, EXIT_CONFIG_ERROR, EXIT_INTERRUPTED, EXIT_TRAINING_FAILED, check_target, explain, fail,
    in_config_keys, node_under, omegaconf_cause, one_line, target_arguments,
)
from moetrain.config import Config, ConfigError, GateConfig, Mode, SettingError, did_you_mean, validate
from moetrain.data import DataModule
from moetrain.models.hf import CheckpointError as HFCheckpointError
from moetrain.models.hf import pretrained_lm, read_pretrained_config, training_routing
from moetrain.models.lm import LMConfig
from moetrain.data.tokenizer import TOKENIZER_FILE
from moetrain.models.presets import PRESETS
from moetrain.models.routing_settings import flat_routing, layer_kwargs, setting_owners
from moetrain.moe import EXPERTS, GATES
from moetrain.ops import ExtensionUnavailable
from moetrain.quant import FORMATS
from moetrain.run import TOKENIZER_DIR
from moetrain.parallel.launch import WorkerFailed, WorkersTerminated, choose_backend, init_from_torchrun, spawn
from moetrain.train import NonFiniteLoss, Trainer, checkpoint, resolve_device, seed_everything
from moetrain.train.lock import LOCK_NAME, RunDirectoryBusy, lock_run_directory, unlock_run_directory
from moetrain.train.quantized_evaluation import evaluate_quantized
from moetrain.train.trainer import Terminated

log = logging.getLogger(__name__)

NAME_MAX = 255  # bytes in one file name on Linux, macOS and Windows file systems


def recipe_names() -> list[str]:
    folder = resources.files("moetrain.recipes")
    return sorted(entry.name[: -len(".yaml")] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def _names(kind: str) -> str:
    """${moetrain_names:gates|experts} in the help template: the choices the code knows."""
    return ", ".join({"gates": list(GATES), "experts": sorted(EXPERTS)}[kind])


def _gate_schema() -> type[GateConfig]:
    """GateConfig's layer-level keys plus every registered gate's settings (null: the gate's own
    default), so gate.KEY=VALUE is checked while composing and a new gate needs no schema change."""
    fields = []
    for key, owners in setting_owners().items():
        hint = typing.get_type_hints(GATES[owners[0]].Settings)[key]
        fields.append((key, typing.Optional[hint], dataclasses.field(default=None)))
    return _named_here(dataclasses.make_dataclass("GateSchema", fields, bases=(GateConfig,)))


def _named_here(cls: type) -> type:
    cls.__module__ = __name__  # found by pickle as moetrain.cli.<name>
    return cls


# The schema moetrain registers: Config with the gate node typed from the gate registry. Made once,
# at import, and named in this module so that a composed config pickles (spawned workers).
GateSchema = _gate_schema()
ConfigSchema = _named_here(dataclasses.make_dataclass(
    "ConfigSchema", [("gate", GateSchema, dataclasses.field(default_factory=GateSchema))], bases=(Config,)))


def register_configs() -> None:
    """The typed schema under the primary config; group `routing`: each Python model preset's own
    routing (conf/model/<preset>.yaml puts it in the gate node); group `gate`: one option per
    registered gate (that gate with its default settings); every recipes/*.yaml as group `recipe`;
    the help template's resolver."""
    OmegaConf.register_new_resolver("moetrain_names", _names, replace=True)
    store = ConfigStore.instance()
    store.store(name="moetrain_schema", node=ConfigSchema)
    for name, preset in PRESETS.items():
        store.store(group="routing", name=name, node=flat_routing(preset.moe_kwargs))
    # model=hf's routing is its checkpoint's: empty until check_command_line reads model.path.
    store.store(group="routing", name=PRETRAINED_ROUTING, node={})
    no_settings = {key: None for key in setting_owners()}
    for name in GATES:
        store.store(group="gate", name=name, node={"type": name, **no_settings, "_target_": None})
    folder = resources.files("moetrain.recipes")
    for name in recipe_names():
        recipe = OmegaConf.create(folder.joinpath(f"{name}.yaml").read_text())
        store.store(group="recipe", name=name, node=recipe, package="_global_")


# ---- checks Hydra cannot make ---------------------------------------------------------------------
def _check_schema_keys(node: DictConfig, path: str = "") -> None:
    """`+trainer.foo=1` adds a key even to a typed node (Hydra opens it for the addition)."""
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        fields = [f.name for f in dataclasses.fields(schema)]
        for key in node:
            if key not in fields:
                raise ConfigError(
                    f"unknown key {path}{key}: {path.rstrip('.') or 'the top level'} has " + ", ".join(fields)
                    + did_you_mean(key, fields)
                )
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            _check_schema_keys(child, f"{path}{key}.")


def checked(cfg: DictConfig) -> Config:
    """The composed config as the typed schema, after every check; raises ConfigError."""
    _check_schema_keys(cfg)
    if "recipe" in cfg:
        raise ConfigError(f"'recipe' is not a config key: apply a recipe with +recipe=NAME ({'|'.join(recipe_names())})")
    config: Config = OmegaConf.to_object(cfg)
    checkpoint_config = None
    if config.model.get("_target_") == PRETRAINED_TARGET:
        checkpoint_config = read_checkpoint_config(config.model.get("path"))[1]
        fixed = [key for key in config.model if key in FIXED_BY_CHECKPOINT]
        if fixed:
            raise ConfigError(_fixed_by_checkpoint(fixed[0]))
    validate(config, FORMATS, num_experts=checkpoint_config.num_experts if checkpoint_config else None)
    try:
        layer_kwargs(dataclasses.asdict(config.gate))
    except ValueError as error:
        raise ConfigError(in_config_keys(str(error))) from None
    for group in ("model", "data"):
        check_target(group, getattr(config, group))
    return config


def check_command_line(overrides: list[str], multirun: bool, config_dir: str | None = None,
                       build_data: bool = False) -> DictConfig | None:
    """Compose every run the command line asks for and check it: the config, the folders it names
    (where the run directory goes, trainer.resume) and, with build_data, its data set, so that a bad
    input fails before a run directory is made. Returns the one run's composed config (its hydra
    node included) to run as it is; None for a sweep. Raises ConfigError."""
    if config_dir:  # --config-dir: the user's own configs, searched after moetrain's
        overrides = overrides + [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as error:
        raise ConfigError(one_line(error)) from None
    recipes = recipe_names()
    for override in parsed:
        if override.key_or_group != "recipe":
            continue
        if not override.is_add():
            raise ConfigError(
                f"write +recipe=... with a plus: a recipe is applied on top of the defaults (recipes: {'|'.join(recipes)})"
            )
        names = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
        for name in names:
            if name not in recipes:
                raise ConfigError(f"unknown recipe '{name}': choose +recipe=" + "|".join(recipes) + did_you_mean(name, recipes))
    runs = [overrides]
    if multirun:
        try:
            runs = sweep_runs(parsed)
        except HydraException:
            runs = []  # a sweep only a sweeper plugin can expand: each job checks its own config
    _PREBUILT_DATA.clear()  # only this command line's data sets
    _PREBUILT_MODELS.clear()
    with hydra.initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        built, routings, loaded = {}, {}, set()
        for run in runs:
            try:
                composed = hydra.compose(config_name=CONFIG_NAME, overrides=list(run), return_hydra_config=True)
                if use_checkpoint_routing(composed, routings):  # model=hf: the gate node starts from DIR's routing
                    composed = hydra.compose(config_name=CONFIG_NAME, overrides=list(run), return_hydra_config=True)
                    apply_checkpoint_tokenizer(composed)
                output_dir = _output_dir(composed, multirun)  # ${now:...} is resolved once per composed config
                cfg = copy.deepcopy(composed)
                with open_dict(cfg):
                    del cfg["hydra"]
                config = checked(cfg)
            except ConfigError:
                raise
            except Exception as error:
                raise ConfigError(_explain(error, list(run))) from None
            # The device is checked here, not in checked(): a GPU recipe still composes on a CPU machine.
            try:
                resolve_device(config.trainer.device)
            except SettingError as error:
                raise ConfigError(in_config_keys(str(error), "trainer", ["device"])) from None
            if output_dir is not None:
                check_output_dir(Path(output_dir), "hydra.sweep.dir" if multirun else "hydra.run.dir")
            check_resume_path(config.trainer.resume)
            key = _data_key(config)
            if build_data and key not in built:
                data = _build_data(config)
                check_vocabulary(config, data)
                built[key] = (data.task, data.model_inputs)
                if not multirun:  # the run itself uses it (a sweep's jobs build their own)
                    _PREBUILT_DATA[key] = data
            if build_data and config.model.get("_target_") == PRETRAINED_TARGET:
                # The weights are read now, so that a damaged checkpoint fails before the run directory
                # exists (a sweep reads each checkpoint once); a one-process run trains this very model.
                checkpoint_key = repr(sorted(config.model.items()))
                if checkpoint_key not in loaded or not multirun:
                    loaded.add(checkpoint_key)
                    model = prebuild_checkpoint_model(config, *built[key])
                    if not multirun:
                        _PREBUILT_MODELS[_model_key(config)] = model
    return None if multirun else composed


def sweep_runs(parsed: list) -> list[list[str]]:
    """The override lists of every job of a basic sweep (-m): the cartesian product of each
    sweep's values; a key given twice keeps its place and its last values. A sweep only a sweeper
    plugin can expand (an interval) raises HydraException."""
    choices: dict[str, list[str]] = {}
    for override in parsed:
        key = override.get_key_element()
        if not override.is_sweep_override():
            choices[key] = [override.input_line]
        elif override.is_interval_sweep():
            raise HydraException(f"{override.input_line}: an interval sweep needs a sweeper plugin")
        else:
            choices[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
    return [list(combination) for combination in itertools.product(*choices.values())]


def _output_dir(cfg: DictConfig, multirun: bool) -> str | None:
    """Where Hydra will make the run (or sweep) directory; None when only Hydra's own resolvers,
    set up as the run starts (${hydra:...}), can say."""
    try:
        return OmegaConf.select(cfg, "hydra.sweep.dir" if multirun else "hydra.run.dir")
    except OmegaConfBaseException:
        return None


def check_output_dir(path: Path, key: str) -> None:
    """The run directory can be made (or, when it exists, written): its nearest existing folder is
    writable and each new name fits the file system. Raises ConfigError."""
    for part in path.parts:
        if len(os.fsencode(part)) > NAME_MAX:
            raise ConfigError(
                f"{key}: the folder name {part[:40]}... has {len(os.fsencode(part))} bytes, more than a file name "
                f"may have ({NAME_MAX}): shorten `name` or give a shorter {key}")
    existing = path
    try:
        while not existing.exists():
            existing = existing.parent
        usable = existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)
    except OSError as error:
        raise ConfigError(f"cannot make the run directory {path}: {error.strerror} ({error.filename}): "
                          f"set {key}=A/WRITABLE/FOLDER") from None
    if not existing.is_dir():
        raise ConfigError(f"cannot make the run directory {path}: {existing} is a file: set {key}=A/FOLDER/PATH")
    if not usable and existing == path:
        raise ConfigError(f"the run directory {path} is not writable: make it writable (chmod u+w), or set "
                          f"{key}=A/WRITABLE/FOLDER")
    if not usable:
        where = "the current directory" if existing.resolve() == Path.cwd().resolve() else "the folder"
        raise ConfigError(
            f"cannot make the run directory {path}: {where} {existing.resolve()} is not writable: run moetrain "
            f"from a writable directory, or set {key}=A/WRITABLE/FOLDER")


def check_resume_path(resume: str | None) -> None:
    """trainer.resume names something readable that holds a checkpoint ("auto" is checked by the
    trainer: a new run directory has none yet). Raises ConfigError."""
    if resume in (None, "auto"):
        return
    path = Path(resume).expanduser()
    try:
        if not path.exists():
            raise ConfigError(f"trainer.resume={resume} does not exist: pass a run directory, a checkpoint file, or auto")
        folders = [path] + ([path / checkpoint.CHECKPOINT_DIR] if (path / checkpoint.CHECKPOINT_DIR).is_dir() else [])
        for folder in folders if path.is_dir() else []:
            if not os.access(folder, os.R_OK | os.X_OK):
                raise PermissionError(13, "Permission denied", str(folder))
        if path.is_file() and not os.access(path, os.R_OK):
            raise PermissionError(13, "Permission denied", str(path))
        if path.is_dir() and not any(p.name.startswith(("step_", "rank")) for folder in folders for p in folder.iterdir()):
            raise ConfigError(
                f"trainer.resume={resume}: no checkpoint there; pass a run directory, a checkpoint file, or auto")
    except OSError as error:
        raise ConfigError(f"trainer.resume={resume}: cannot read {error.filename or path} ({error.strerror}): "
                          "make it readable (chmod -R u+rX) or resume from a copy") from None


# The data set that check_command_line built, handed to the run (each built once, before any run
# directory exists): key -> DataModule.
_PREBUILT_DATA: dict[str, DataModule] = {}


def _data_key(config: Config) -> str:
    return repr((sorted(config.data.items()), config.seed))


def _build_data(config: Config) -> DataModule:
    seed_everything(config.seed)
    return _instantiate("data", config.data)


# ---- starting from a published checkpoint (model=hf) -----------------------------------------------
PRETRAINED_TARGET = "moetrain.models.hf.pretrained_lm"
PRETRAINED_ROUTING = "hf"  # conf/model/hf.yaml's routing option: the checkpoint's, once model.path is read
# A checkpoint's config.json fixes its architecture: of LMConfig's fields only these are the run's.
PRETRAINED_OPEN_KEYS = ("max_seq_len", "dropout")
FIXED_BY_CHECKPOINT = tuple(f.name for f in dataclasses.fields(LMConfig) if f.name not in PRETRAINED_OPEN_KEYS)


def _explain(error: Exception, overrides: list[str]) -> str:
    """explain(), with a model key that a published checkpoint fixes (model=hf) named as such."""
    cause = omegaconf_cause(error)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
        parent, _, leaf = cause.full_key.rpartition(".")
        if parent == "model" and leaf in FIXED_BY_CHECKPOINT:
            model = node_under("model", overrides)
            if model is not None and model.get("_target_") == PRETRAINED_TARGET:
                return _fixed_by_checkpoint(leaf)
    return explain(error, overrides)


def _fixed_by_checkpoint(key: str) -> str:
    routing = "; the routing changes with gate.KEY=VALUE" if key == "moe_kwargs" else ""
    return (f"model.{key} is fixed by the checkpoint (model=hf takes its architecture from model.path's config.json, "
            f"and the weights have its sizes): remove model.{key}{routing}; a run from a checkpoint sets "
            "model.path, model.max_seq_len, model.dropout, gate.*, optim.*, trainer.* and parallel.*")


def read_checkpoint_config(path) -> tuple[dict, LMConfig]:
    """config.json of model.path and the architecture it gives, checked; ConfigError naming the key."""
    if path is None:
        raise ConfigError("model=hf starts from a Hugging Face checkpoint: set model.path=DIR (a folder with "
                          "config.json and *.safetensors)")
    try:
        return read_pretrained_config(str(path))
    except HFCheckpointError as error:
        raise ConfigError(f"model.path: {one_line(error)}") from None


def use_checkpoint_routing(composed: DictConfig, routings: dict[str, dict]) -> bool:
    """For model=hf, register its checkpoint's routing (with the balance loss its config.json names)
    as conf/model/hf.yaml's routing option, so that composing again puts it under the command
    line's gate keys; True when the caller must compose again. `routings`: the checkpoints of this
    command line so far (a sweep's jobs share the one option, so they must agree)."""
    model = composed.model
    if model.get("_target_") != PRETRAINED_TARGET:
        return False
    path = None if OmegaConf.is_missing(model, "path") else model.path
    hf_config, lm_config = read_checkpoint_config(path)
    routing = flat_routing(training_routing(hf_config, lm_config))
    others = {other: their for other, their in routings.items() if their != routing}
    if others:
        raise ConfigError(f"model.path={path} and model.path={next(iter(others))} route differently, and one command "
                          "line composes one checkpoint routing: run one command per checkpoint")
    routings[str(path)] = routing
    ConfigStore.instance().store(group="routing", name=PRETRAINED_ROUTING, node=routing)
    return True


def checkpoint_tokenizer(model_path: str, tokenizer: str | None) -> str | None:
    """data.tokenizer of a run that starts from a checkpoint directory: the one the user set, else
    the checkpoint's own (its directory, when it holds tokenizer.json), else None: byte-level text,
    whose 257 ids must then fit the checkpoint's embedding (prebuild_checkpoint_model checks)."""
    if tokenizer is not None:
        return tokenizer
    return model_path if (Path(model_path).expanduser() / "tokenizer.json").is_file() else None


def apply_checkpoint_tokenizer(composed: DictConfig) -> None:
    """model=hf with a data option that reads text through a tokenizer (it has data.tokenizer): the
    checkpoint's own tokenizer unless data.tokenizer names one."""
    if "tokenizer" in composed.data:
        composed.data.tokenizer = checkpoint_tokenizer(str(composed.model.path), composed.data.tokenizer)


def prebuild_checkpoint_model(config: Config, task: str, model_inputs: dict) -> torch.nn.Module:
    """model=hf's model with its weights (what the run builds), read before the run directory exists:
    the data must be language modelling whose vocabulary fits the checkpoint's embedding and whose
    sequences fit its positions; a missing, truncated or misshapen weight is a ConfigError."""
    path = config.model["path"]
    hf_config, lm_config = read_checkpoint_config(path)
    if task != "language_modeling":
        raise ConfigError(f"model=hf is a language model but data._target_={config.data['_target_']} is a {task} data "
                          "set: choose language-model data (data=text or data=synthetic_lm)")
    vocab_size = model_inputs.get("vocab_size")
    if vocab_size is not None and vocab_size > lm_config.vocab_size:
        raise ConfigError(
            f"the data's {vocab_size} token ids do not fit model.path={path}'s embedding of "
            f"{lm_config.vocab_size} (its vocab_size): train on text encoded by the checkpoint's own tokenizer "
            f"(data.tokenizer=TOKENIZER), or on token ids below {lm_config.vocab_size}")
    key = "model.max_seq_len" if "max_seq_len" in config.model else "data.seq_len"
    seq_len = config.model.get("max_seq_len", model_inputs.get("max_seq_len"))
    positions = hf_config.get("max_position_embeddings")
    if seq_len is not None and positions is not None and seq_len > positions:
        raise ConfigError(f"{key}={seq_len} is longer than the {positions} positions of model.path={path} "
                          f"(its max_position_embeddings): set {key}={positions} or less")
    try:
        return _instantiate_checkpoint_model(config, model_inputs)
    except HFCheckpointError as error:  # says what and where, and how to fix it
        raise ConfigError(f"model.path: {one_line(error)}") from None
    except OSError as error:
        raise ConfigError(f"model.path={path}: cannot read {error.filename or 'the checkpoint'}: "
                          f"{error.strerror or error}: fix the path or its permissions") from None


def _instantiate_checkpoint_model(config: Config, model_inputs: dict) -> torch.nn.Module:
    """pretrained_lm called as build_model calls the model node's _target_ (the same arguments)."""
    arguments = {key: value for key, value in config.model.items() if not (key.startswith("_") and key.endswith("_"))}
    inputs = {key: value for key, value in model_inputs.items() if key not in arguments}
    return pretrained_lm(**arguments, **inputs, moe_kwargs=layer_kwargs(dataclasses.asdict(config.gate)))


# The model that check_command_line built for model=hf, handed to the run: key -> model.
_PREBUILT_MODELS: dict[str, torch.nn.Module] = {}


def _model_key(config: Config) -> str:
    return repr((sorted(config.model.items()), dataclasses.asdict(config.gate), _data_key(config)))


def check_vocabulary(config: Config, data: DataModule) -> None:
    """Every id the data's tokenizer can give fits the model's embedding (model.vocab_size, when
    the model config sets it; otherwise the data sets it). Raises ConfigError."""
    size = config.model.get("vocab_size")
    tokenizer = data.tokenizer
    needed = max(data.model_inputs.get("vocab_size") or 0, tokenizer.vocab_size if tokenizer is not None else 0)
    if isinstance(size, int) and needed > size:
        what = f"the tokenizer {tokenizer.source}" if tokenizer is not None else "the data"
        raise ConfigError(f"{what} has {needed} token ids, more than model.vocab_size={size} (the model's embedding): "
                          f"raise model.vocab_size to at least {needed}, or use a tokenizer of at most {size} ids")


def record_tokenizer(data: DataModule, run_dir: Path, run_config: dict, write: bool = True) -> None:
    """A tokenizer.json run keeps its tokenizer: the files in RUN/tokenizer/ (written when `write`:
    rank 0) and, in the config its checkpoints save, its SHA-256, vocabulary size and end-of-text
    id. A run directory continued with another tokenizer is refused."""
    tokenizer = data.tokenizer
    if tokenizer is None or tokenizer.sha256 is None:
        return
    run_config["tokenizer"] = {"sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
                               "eos_id": tokenizer.eos_id, "files": sorted(tokenizer.files)}
    recorded = run_dir / TOKENIZER_DIR
    if not write:
        return
    if (recorded / TOKENIZER_FILE).is_file():
        before = hashlib.sha256((recorded / TOKENIZER_FILE).read_bytes()).hexdigest()
        if before != tokenizer.sha256:
            raise ConfigError(f"{run_dir} was trained with another tokenizer ({recorded}, sha256 {before[:12]}...) than "
                              f"{tokenizer.source} (sha256 {tokenizer.sha256[:12]}...): continue it with data.tokenizer="
                              f"{recorded}, or train in a new run directory")
    tokenizer.save(recorded)


# ---- the run ------------------------------------------------------------------------------------
def _instantiate(group: str, node: dict, **kwargs):
    try:
        return hydra.utils.instantiate(node, **kwargs, _convert_="all")
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, (ConfigError, ExtensionUnavailable)):
            raise cause from None
        message = in_config_keys(str(cause or error), group, target_arguments(node["_target_"]))
        if isinstance(cause, SettingError):  # says which of the group's keys to change: no prefix needed
            raise ConfigError(message) from None
        raise ConfigError(f"{group} ({node['_target_']}): {message}") from None


def build(config: Config) -> tuple[DataModule, torch.nn.Module]:
    """The data module, then the model: every MoE layer gets the routing of the gate node (the
    model's own with the user's overrides), and the data fixes the model's input and output sizes unless the model config sets them itself."""
    data = _PREBUILT_DATA.pop(_data_key(config), None) or _build_data(config)
    check_vocabulary(config, data)
    seed_everything(config.seed)  # the model's initial weights do not depend on how the data was built
    return data, build_model(config, data)


def build_model(config: Config, data: DataModule) -> torch.nn.Module:
    prebuilt = _PREBUILT_MODELS.pop(_model_key(config), None)
    if prebuilt is not None:
        return prebuilt
    model_inputs = {key: value for key, value in data.model_inputs.items() if key not in config.model}
    return _instantiate("model", config.model, **model_inputs, moe_kwargs=layer_kwargs(dataclasses.asdict(config.gate)))


def train(cfg: DictConfig, run_dir: Path, distributed: bool = False) -> dict:
    """Build data, model and trainer from the composed config, then (config.mode) train in run_dir,
    or evaluate trainer.resume's model as trained and quantized; return the final metrics.
    distributed: this process is one rank of an initialised process group."""
    config = checked(cfg)
    log.info("run directory %s", run_dir)
    # Imported here: FSDP's and DCP's modules take about a second to import, which every command
    # (its --help and its bad-input errors included) would otherwise wait for.
    from moetrain.parallel.processes import Distributed  # noqa: PLC0415

    bias_update_rate = layer_kwargs(dataclasses.asdict(config.gate))["gate_kwargs"].get("bias_update_rate")
    if config.optim.lr == 0 and bias_update_rate:
        # The balancing bias follows the routing's load, not the optimizer (DeepSeek-V3's rule): said, not changed.
        log.warning("optim.lr=0 leaves the weights as they are, but the routers' balancing bias still moves by "
                    "gate.bias_update_rate=%g per step: add gate.bias_update_rate=0 to keep it too", bias_update_rate)
    data, model = build(config)
    log.info("model %s: %.2fM parameters", config.model["_target_"], sum(p.numel() for p in model.parameters()) / 1e6)
    run_config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    record_tokenizer(data, run_dir, run_config, write=not distributed or dist.get_rank() == 0)
    trainer = Trainer(
        model,
        data,
        trainer=config.trainer,
        optim=config.optim,
        logger=config.logger,
        run_dir=run_dir,
        seed=config.seed,
        run_config=run_config,
        processes=Distributed(config.parallel) if distributed else None,
    )
    if config.mode == Mode.eval:
        return evaluate_quantized(trainer, config.quant, lambda: build_model(config, data))
    return trainer.fit()


def _resume_command(run_dir: Path) -> str:
    """The command that continues this run from its last checkpoint (inside Hydra's task only)."""
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith(("hydra.run.dir=", "trainer.resume="))]
    return "moetrain " + " ".join(overrides + [f"hydra.run.dir={run_dir}", "trainer.resume=auto"])


def _remove_partial_checkpoints(run_dir: Path) -> None:
    """Temporary files of a checkpoint whose write failed; called once nothing writes any more."""
    for partial in (Path(run_dir) / checkpoint.CHECKPOINT_DIR).rglob("*.tmp"):
        partial.unlink(missing_ok=True)


def _file_system_error(error: OSError, run_dir: Path) -> str:
    """One line for a file that could not be read or written while the run went on."""
    _remove_partial_checkpoints(run_dir)
    where = f" {error.filename}" if error.filename else ""
    saved = [p.name for p in checkpoint.checkpoints(Path(run_dir) / checkpoint.CHECKPOINT_DIR)
             if checkpoint.is_complete(p)]
    kept = f"checkpoints saved before are intact ({', '.join(saved)})" if saved else "no checkpoint was saved yet"
    return (f"cannot write{where}: {error.strerror or error}: free space, fix the permissions or move what is in "
            f"the way; {kept}; continue with: {_resume_command(run_dir)}")


# The library's errors that end a run with one line (a bug keeps its traceback).
REPORTED = (ExtensionUnavailable, ConfigError, SettingError, checkpoint.CheckpointError, NonFiniteLoss, Terminated,
            OSError)


def _error_line(error: BaseException, run_dir: Path) -> tuple[str, int]:
    """The one line and exit code of an error (one of REPORTED) that ended the run: a config mistake
    or a setup problem (2), a diverged run (1), SIGTERM after its checkpoint (143), a file that could
    not be read or written (2)."""
    if isinstance(error, ExtensionUnavailable):
        return f"{error} (on the command line: gate.impl=torch)", EXIT_CONFIG_ERROR
    if isinstance(error, (ConfigError, SettingError, checkpoint.CheckpointError)):
        _remove_partial_checkpoints(run_dir)  # a checkpoint write that failed leaves no .tmp behind
        return in_config_keys(str(error)), EXIT_CONFIG_ERROR
    if isinstance(error, NonFiniteLoss):
        return in_config_keys(str(error)), EXIT_TRAINING_FAILED
    if isinstance(error, Terminated):
        return (f"stopped by SIGTERM at step {error.step} after saving its checkpoint; continue with the same "
                f"command plus hydra.run.dir={error.run_dir} trainer.resume=auto"), error.exit_code
    return _file_system_error(error, run_dir), EXIT_CONFIG_ERROR


def _train_reporting(cfg: DictConfig, run_dir: Path, distributed: bool, report: bool = True) -> None:
    """train(), turning a config mistake or a diverged run into its exit code (and, when report,
    its one line: under torchrun only rank 0 reports, the others exit with the same code)."""
    try:
        train(cfg, run_dir, distributed)
    except REPORTED as error:
        message, code = _error_line(error, run_dir)
        if report:
            fail(message, code)
        sys.exit(code)


# The folders this command makes for its run directory (the run directory first, then each missing
# parent), found before Hydra makes them: a run refused before it trained removes them again.
_MADE_FOR_THE_RUN: list[Path] = []


def _remember_made_folders(run_dir: Path) -> None:
    folder = run_dir.absolute()
    _MADE_FOR_THE_RUN.clear()
    while not folder.exists():
        _MADE_FOR_THE_RUN.append(folder)
        folder = folder.parent


def _remove_unused_run_directory(run_dir: Path) -> None:
    """A run refused before it trained (a model that cannot be built, a checkpoint of another model)
    leaves no directory behind: the folders this command made go, when they hold only what Hydra
    and the lock wrote."""
    made = list(_MADE_FOR_THE_RUN)
    if not made or os.path.realpath(made[0]) != os.path.realpath(run_dir) or not Path(run_dir).is_dir():
        return
    if any(entry.name not in (".hydra", "moetrain.log", LOCK_NAME, TOKENIZER_DIR) for entry in Path(run_dir).iterdir()):
        return
    unlock_run_directory(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    for folder in made[1:]:
        try:
            folder.rmdir()  # only while empty: another run may have made its own directory there since
        except OSError:
            break


class RunDirectoryLock(Callback):
    """conf/config.yaml's hydra.callbacks: a second run in a run directory is refused in one line
    before Hydra writes anything there (Hydra calls this before making the directory)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 holds it for the job
            _remember_made_folders(Path(str(config.hydra.run.dir)))
            try:
                lock_run_directory(Path(str(config.hydra.run.dir)))
            except RunDirectoryBusy as error:
                fail(f"{error.run_dir} is in use by another moetrain run (pid and host: {error.holder}): wait for "
                      "it to end, or give this run its own hydra.run.dir", EXIT_CONFIG_ERROR)


# ---- several processes --------------------------------------------------------------------------
def _worker_logging(run_dir: Path, is_main: bool) -> None:
    """Spawned workers start without Hydra's logging: rank 0 logs like a one-process run (console
    on stdout, as Hydra's, and the run's moetrain.log), the other ranks print warnings only. stderr
    keeps the launcher's one-line errors."""
    root = logging.getLogger()
    root.handlers.clear()
    handlers = [logging.StreamHandler(sys.stdout)] + ([logging.FileHandler(run_dir / "moetrain.log")] if is_main else [])
    for handler in handlers:
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.INFO if is_main else logging.WARNING)
    _log_in_config_keys()


def _spawned_worker(rank: int, world_size: int, cfg: DictConfig, run_dir: Path) -> None:
    """One of parallel.nproc_per_node workers: its errors go to the launcher, which reports them."""
    # tqdm's default lock is a multiprocessing semaphore even for a hidden bar: a worker killed by a
    # signal leaves it behind, and the launcher's resource tracker warns about it on stderr at exit.
    # One bar per process needs a thread lock only.
    tqdm.set_lock(threading.RLock())
    _worker_logging(run_dir, rank == 0)
    train(cfg, run_dir, distributed=True)


def _report_worker_failure(failure: WorkerFailed, run_dir: Path, timeout_s: float) -> typing.NoReturn:
    """One line for the worker that failed first; the others have been stopped."""
    failed = failure.failed
    if isinstance(failed.error, REPORTED):
        fail(*_error_line(failed.error, run_dir))
    if failed.traceback and not failed.communication_error and not isinstance(failed.error, KeyboardInterrupt):
        sys.stderr.write(failed.traceback)  # a bug: its traceback, then the one line
    _remove_partial_checkpoints(run_dir)
    waited = f" (the others waited parallel.timeout_s={timeout_s:g} s for it)" if failed.stopped else ""
    fail(f"{failed.describe()}{waited}; every worker is stopped; continue from the last checkpoint with: "
          f"{_resume_command(run_dir)}", EXIT_TRAINING_FAILED)


def _report_sigterm(stopped: WorkersTerminated, run_dir: Path) -> typing.NoReturn:
    """SIGTERM reached the launcher and, through it, every worker: rank 0 says where it stopped."""
    first = stopped.exits[0]
    if isinstance(first.error, Terminated):
        fail(*_error_line(first.error, run_dir))
    _remove_partial_checkpoints(run_dir)
    fail(f"{stopped}; continue from the last checkpoint with: {_resume_command(run_dir)}", 128 + signal.SIGTERM)


def _launch(cfg: DictConfig, run_dir: Path) -> None:
    """One process, N spawned workers (parallel.nproc_per_node), or this rank of a torchrun job."""
    if cfg.model.get("_target_") == PRETRAINED_TARGET:
        apply_checkpoint_tokenizer(cfg)  # a sweep's jobs, which Hydra's sweeper composed
    config = checked(cfg)
    # torchrun tells its processes their place through the environment (only the CLI reads it).
    torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if config.mode == Mode.eval and (torchrun or config.parallel.nproc_per_node > 1):
        raise ConfigError("mode=eval runs in one process: drop parallel.nproc_per_node (and torchrun)")
    if not torchrun and config.parallel.nproc_per_node == 1:
        _train_reporting(cfg, run_dir, distributed=False)
        return
    try:
        backend = choose_backend(config.parallel.backend, resolve_device(config.trainer.device).type)
    except (ValueError, RuntimeError) as error:
        raise ConfigError(f"parallel.backend: {error}") from None
    timeout_s = config.parallel.timeout_s
    if not torchrun:
        _PREBUILT_DATA.clear()  # each worker builds its own
        _PREBUILT_MODELS.clear()
        try:
            spawn(_spawned_worker, config.parallel.nproc_per_node, args=(cfg, run_dir), backend=backend,
                  timeout_s=timeout_s)
        except WorkerFailed as failure:
            _report_worker_failure(failure, run_dir, timeout_s)
        except WorkersTerminated as stopped:
            _report_sigterm(stopped, run_dir)
        return
    init_from_torchrun(backend, timeout_s=timeout_s)
    try:
        # Every rank writes into rank 0's run directory (on several machines, pass hydra.run.dir).
        shared = [str(run_dir)]
        dist.broadcast_object_list(shared, src=0)
        if dist.get_rank() != 0:
            logging.getLogger().setLevel(logging.WARNING)
        _train_reporting(cfg, Path(shared[0]), distributed=True, report=dist.get_rank() == 0)
    finally:
        dist.destroy_process_group()


class _InConfigKeys(logging.Filter):
    """On the command's log handlers: the library's log lines, which name settings as Python does
    (TrainerConfig.max_steps=5), in the command line's terms (trainer.max_steps=5)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("moetrain.") and record.name != __name__:
            record.msg, record.args = in_config_keys(record.getMessage()), None
        return True


def _log_in_config_keys() -> None:
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _InConfigKeys) for f in handler.filters):
            handler.addFilter(_InConfigKeys())


def _task(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    _log_in_config_keys()
    try:
        try:
            _launch(cfg, run_dir)
        except ConfigError as error:
            fail(str(error), EXIT_CONFIG_ERROR)
        except KeyboardInterrupt:
            fail(f"interrupted; continue from the last checkpoint with: {_resume_command(run_dir)}", EXIT_INTERRUPTED)
    except SystemExit as exit_request:
        if exit_request.code == EXIT_CONFIG_ERROR:
            _remove_unused_run_directory(run_dir)
        raise


class _JobCallbacks:
    """The callbacks of hydra.callbacks (conf/config.yaml), notified as Hydra notifies them."""

    def __init__(self, cfg: DictConfig):
        self.callbacks = [hydra.utils.instantiate(node) for node in (cfg.hydra.callbacks or {}).values()]

    def notify(self, event: str, reverse: bool = False, **kwargs) -> None:
        for callback in reversed(self.callbacks) if reverse else self.callbacks:
            getattr(callback, event)(**kwargs)

    def on_job_start(self, **kwargs) -> None:
        self.notify("on_job_start", **kwargs)

    def on_job_end(self, **kwargs) -> None:
        self.notify("on_job_end", reverse=True, **kwargs)


def run_composed(cfg: DictConfig) -> None:
    """Run one composed and checked config (its hydra node included) as Hydra's entry point runs a
    single run, through Hydra's public job runner: the run directory, its .hydra/ copy of the
    config, logging, then `_task`. The config check_command_line composed is the one that runs."""
    with open_dict(cfg.hydra):
        cfg.hydra.mode = RunMode.RUN
    callbacks = _JobCallbacks(cfg)
    callbacks.notify("on_run_start", config=cfg, config_name=CONFIG_NAME)
    with hydra.initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        context = HydraContext(config_loader=GlobalHydra.instance().config_loader(), callbacks=callbacks)
        result = run_job(task_function=_task, config=cfg, job_dir_key="hydra.run.dir", job_subdir_key=None,
                         hydra_context=context)
    callbacks.notify("on_run_end", reverse=True, config=cfg, config_name=CONFIG_NAME, job_return=result)
    result.return_value  # noqa: B018 - raises the task's error, as Hydra's entry point does


def command_line_parser() -> argparse.ArgumentParser:
    """The flags `moetrain` reads before handing the command line to Hydra's entry point (Hydra's
    own flags, with the values they take, so that none is mistaken for an override)."""
    parser = argparse.ArgumentParser(prog="moetrain", add_help=False)
    for flags in (("--help", "-h"), ("--hydra-help",), ("--resolve",), ("--run", "-r"), ("--multirun", "-m"),
                  ("--shell-completion", "-sc")):
        parser.add_argument(*flags, action="store_true")
    for flags in (("--package", "-p"), ("--config-path", "-cp"), ("--config-name", "-cn"), ("--config-dir", "-cd"),
                  ("--experimental-rerun",)):
        parser.add_argument(*flags)
    parser.add_argument("--cfg", "-c", choices=["job", "hydra", "all"])
    parser.add_argument("--info", "-i", nargs="?", const="all")
    parser.add_argument("overrides", nargs="*")
    return parser


def _main() -> None:
    from moetrain import commands  # here: its modules load only for a command on a run directory

    # eval, generate and export of a run directory, and --version (before Hydra's parser, whose
    # --version prints Hydra's own); for --help, the commands' usage above Hydra's help.
    if commands.dispatch(sys.argv[1:]):
        return
    register_configs()
    args = command_line_parser().parse_args()
    if args.config_path or args.config_name:
        fail("moetrain composes its own configs: add yours with --config-dir DIR instead of -cp/-cn", EXIT_CONFIG_ERROR)
    if not (args.help or args.hydra_help or args.shell_completion or args.info):
        try:
            # --cfg only prints the config: no data set is built (nor downloaded) for it.
            composed = check_command_line(args.overrides, args.multirun, args.config_dir, build_data=not args.cfg)
        except ConfigError as error:
            fail(str(error), EXIT_CONFIG_ERROR)
        single_run = composed is not None and composed.hydra.mode != RunMode.MULTIRUN
        if single_run and not (args.cfg or args.experimental_rerun):
            run_composed(composed)  # one run: composed once, checked, run as it is
            return
    # Help, --cfg, --info, a sweep (whose sweeper composes each job) and the rest: Hydra's entry point.
    hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME)(_task)()


def main() -> None:
    try:
        try:
            _main()
        finally:
            sys.stdout.flush()  # here, not at exit, so that a closed pipe is noticed below
    except BrokenPipeError:
        # `moetrain --help | head -3`: the reader has what it wanted. Stop quietly, as other
        # command-line tools do (they die of SIGPIPE: exit status 141).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(128 + signal.SIGPIPE)
