"""The `moetrain` command (also `python -m moetrain`): compose the config with Hydra, check it, train.

    moetrain +recipe=quickstart
    moetrain +recipe=switch_cifar10 trainer.max_steps=2000 gate.top_k=2 optim.lr=3e-4
    moetrain -m +recipe=quickstart gate=switch,gshard
    moetrain +recipe=quickstart mode=eval quant=mxfp4 trainer.resume=runs/RUN quant.export=model.mxfp4.pt

This is the only module that knows Hydra. The configs ship as the package moetrain.conf (groups
model, gate, parallel, data, optim, trainer, logger, quant) and recipes as moetrain.recipes, registered
here in the ConfigStore group `recipe` (package _global_) so that `+recipe=NAME` finds them.

Every configuration mistake ends the same way: exit code 2 and one line on stderr that names the
key and the fix, never a traceback. Hydra reports its own composition errors in several lines
with exit code 1, so `main` first composes the command line itself (each combination of a sweep)
and turns any failure into that one line; only a config that composes and validates reaches
Hydra's entry point, which makes the run directory and calls `train`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import sys
import types
import typing
from importlib import resources
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import _locate, get_args_parser
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, InstantiationException, MissingConfigException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError
from torch.multiprocessing import ProcessExitedException

import moetrain
from moetrain.config import Config, ConfigError, GateType, Mode, did_you_mean, moe_kwargs, validate
from moetrain.data import DataModule
from moetrain.moe import EXPERTS
from moetrain.ops import ExtensionUnavailable
from moetrain.parallel.launch import choose_backend, init_from_torchrun, spawn
from moetrain.parallel.training import Distributed
from moetrain.train import NonFiniteLoss, Trainer, resolve_device, seed_everything
from moetrain.train.lock import RunDirectoryBusy, lock_run_directory
from moetrain.train.quantized import evaluate_quantized
from moetrain.train.trainer import Terminated

log = logging.getLogger(__name__)

CONFIG_MODULE = "moetrain.conf"
CONFIG_NAME = "config"
GROUPS = ("model", "gate", "parallel", "data", "optim", "trainer", "logger", "quant")
EXIT_CONFIG_ERROR = 2
EXIT_TRAINING_FAILED = 1
EXIT_INTERRUPTED = 130  # the shell's code for Ctrl-C


def recipe_names() -> list[str]:
    folder = resources.files("moetrain.recipes")
    return sorted(entry.name[: -len(".yaml")] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def _names(kind: str) -> str:
    """${moetrain_names:gates|experts} in the help template: the choices the code knows."""
    return ", ".join({"gates": [gate.value for gate in GateType], "experts": sorted(EXPERTS)}[kind])


def register_configs() -> None:
    """The typed schema under the primary config, every recipes/*.yaml as group `recipe`, and the
    help template's resolver."""
    OmegaConf.register_new_resolver("moetrain_names", _names, replace=True)
    store = ConfigStore.instance()
    store.store(name="moetrain_schema", node=Config)
    folder = resources.files("moetrain.recipes")
    for name in recipe_names():
        recipe = OmegaConf.create(folder.joinpath(f"{name}.yaml").read_text())
        store.store(group="recipe", name=name, node=recipe, package="_global_")


# ---- turning errors into one line -----------------------------------------------------------------
def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _omegaconf_cause(error: BaseException) -> OmegaConfBaseException | None:
    while error is not None:
        if isinstance(error, OmegaConfBaseException):
            return error
        error = error.__cause__ or error.__context__
    return None


def _keys_under(parent: str, overrides: list[str]) -> list[str]:
    """The keys a config node has once the command line's group choices are applied."""
    parser = OverridesParser.create()
    group_choices = [
        text for text, o in zip(overrides, parser.parse_overrides(overrides)) if o.key_or_group in GROUPS + ("recipe",)
    ]
    try:
        node = hydra.compose(config_name=CONFIG_NAME, overrides=group_choices)
        node = OmegaConf.select(node, parent) if parent else node
    except Exception:  # the key list only improves the message; the error itself is reported anyway
        return []
    return list(node.keys()) if isinstance(node, DictConfig) else []


def _explain(error: Exception, overrides: list[str]) -> str:
    """One line for a Hydra or OmegaConf composition error."""
    if isinstance(error, MissingConfigException) and error.options is not None:
        group, _, option = (error.missing_cfg_file or "").rpartition("/")
        return (
            f"unknown {group or 'config'} option '{option}': choose {group}=" + "|".join(error.options)
            + did_you_mean(option, error.options)
        )
    cause = _omegaconf_cause(error)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
        parent, _, leaf = cause.full_key.rpartition(".")
        keys = _keys_under(parent, overrides)
        where = parent or "the top level"
        message = f"unknown key '{cause.full_key}'"
        if keys:
            message += f": {where} has " + ", ".join(keys) + did_you_mean(leaf, keys)
        if parent.split(".")[0] in ("model", "data"):
            message += f"; to pass a new argument to {parent}._target_, write +{cause.full_key}=VALUE"
        return message
    if isinstance(cause, ValidationError) and cause.full_key:
        # The message's first line is the problem; the rest repeats the key and the schema's name.
        return f"bad value for {cause.full_key}: {str(cause.msg).splitlines()[0]}"
    return _one_line(cause.msg if cause is not None else error)


# ---- checks Hydra cannot make ---------------------------------------------------------------------
def _matches(value, hint) -> bool:
    """Whether `value` fits a plain annotation; anything fancier is left to the target itself."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def check_target(group: str, node: dict) -> None:
    """The group's _target_ imports, and takes every key of the group with a value of its type."""
    path = node["_target_"]
    try:
        target = _locate(path)  # hydra.utils.get_object would also log the failure on stderr
    except ImportError as error:
        raise ConfigError(f"{group}._target_={path} cannot be imported ({_one_line(error)}): fix the dotted path")
    parameters = inspect.signature(target).parameters
    if any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return  # takes anything: the target checks its own arguments
    accepted = [name for name, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    for key, value in node.items():
        if key.startswith("_") and key.endswith("_"):  # Hydra's own keys (_target_, _partial_, ...)
            continue
        if key not in accepted:
            raise ConfigError(
                f"unknown key {group}.{key}: {path} takes " + ", ".join(accepted) + did_you_mean(key, accepted)
            )
        if key in hints and not _matches(value, hints[key]):
            expected = getattr(hints[key], "__name__", str(hints[key]))
            raise ConfigError(f"bad value for {group}.{key}: {value!r} is not {expected} ({path} wants {expected})")


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
    validate(config)
    for group in ("model", "data"):
        check_target(group, getattr(config, group))
    return config


def check_command_line(overrides: list[str], multirun: bool, config_dir: str | None = None) -> None:
    """Compose every run the command line asks for and check it; raises ConfigError."""
    if config_dir:  # --config-dir: the user's own configs, searched after moetrain's
        overrides = overrides + [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as error:
        raise ConfigError(_one_line(error)) from None
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
            runs = BasicSweeper.split_arguments(parsed, None)[0]
        except HydraException:
            runs = []  # a sweep only a sweeper plugin can expand: each job checks its own config
    with hydra.initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        for run in runs:
            try:
                cfg = hydra.compose(config_name=CONFIG_NAME, overrides=list(run))
            except Exception as error:
                raise ConfigError(_explain(error, list(run))) from None
            config = checked(cfg)
            # The device is checked here, not in checked(): a GPU recipe still composes on a CPU machine.
            resolve_device(config.trainer.device)


# ---- the run ------------------------------------------------------------------------------------
def _instantiate(group: str, node: dict, **kwargs):
    try:
        return hydra.utils.instantiate(node, **kwargs, _convert_="all")
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, (ConfigError, ExtensionUnavailable)):
            raise cause from None
        raise ConfigError(f"{group} ({node['_target_']}): {_one_line(cause or error)}") from None


def build(config: Config) -> tuple[DataModule, torch.nn.Module]:
    """The data module, then the model: every MoE layer gets the gate settings (moe_kwargs), and the
    data fixes the model's input and output sizes unless the model config sets them itself."""
    seed_everything(config.seed)
    data = _instantiate("data", config.data)
    return data, build_model(config, data)


def build_model(config: Config, data: DataModule) -> torch.nn.Module:
    model_inputs = {key: value for key, value in data.model_inputs.items() if key not in config.model}
    return _instantiate("model", config.model, **model_inputs, moe_kwargs=moe_kwargs(config.gate))


def train(cfg: DictConfig, run_dir: Path, distributed: bool = False) -> dict:
    """Build data, model and trainer from the composed config, then (config.mode) train in run_dir,
    or evaluate trainer.resume's model as trained and quantized; return the final metrics.
    distributed: this process is one rank of an initialised process group."""
    config = checked(cfg)
    log.info("run directory %s", run_dir)
    data, model = build(config)
    log.info("model %s: %.2fM parameters", config.model["_target_"], sum(p.numel() for p in model.parameters()) / 1e6)
    trainer = Trainer(
        model,
        data,
        trainer=config.trainer,
        optim=config.optim,
        logger=config.logger,
        run_dir=run_dir,
        seed=config.seed,
        run_config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        strategy=Distributed(config.parallel) if distributed else None,
    )
    if config.mode == Mode.eval:
        return evaluate_quantized(trainer, config.quant, lambda: build_model(config, data))
    return trainer.fit()


def _fail(message: str, code: int) -> typing.NoReturn:
    print(f"moetrain: error: {message}", file=sys.stderr)
    sys.exit(code)


def _train_reporting(cfg: DictConfig, run_dir: Path, distributed: bool, report: bool = True) -> None:
    """train(), turning a config mistake or a diverged run into its exit code (and, when report,
    its one line: in several processes only rank 0 reports, the others exit with the same code)."""
    try:
        train(cfg, run_dir, distributed)
    except ExtensionUnavailable as error:  # a setup problem, said in one line with its fix
        if report:
            _fail(f"{error} (on the command line: gate.impl=torch)", EXIT_CONFIG_ERROR)
        sys.exit(EXIT_CONFIG_ERROR)
    except (ConfigError, NonFiniteLoss, Terminated) as error:
        code = EXIT_CONFIG_ERROR if isinstance(error, ConfigError) else EXIT_TRAINING_FAILED
        code = error.exit_code if isinstance(error, Terminated) else code  # SIGTERM, checkpoint saved: 143
        if report:
            _fail(str(error), code)
        sys.exit(code)


class RunDirectoryLock(Callback):
    """conf/config.yaml's hydra.callbacks: a second run in a run directory is refused in one line
    before Hydra writes anything there (Hydra calls this before making the directory)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 holds it for the job
            try:
                lock_run_directory(Path(str(config.hydra.run.dir)))
            except RunDirectoryBusy as error:
                _fail(str(error), EXIT_CONFIG_ERROR)


# ---- several processes --------------------------------------------------------------------------
def _worker_logging(run_dir: Path, is_main: bool) -> None:
    """Spawned workers start without Hydra's logging: rank 0 logs like a one-process run (console
    and the run's moetrain.log), the other ranks print warnings only."""
    root = logging.getLogger()
    root.handlers.clear()
    handlers = [logging.StreamHandler()] + ([logging.FileHandler(run_dir / "moetrain.log")] if is_main else [])
    for handler in handlers:
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.INFO if is_main else logging.WARNING)


def _spawned_worker(rank: int, world_size: int, cfg: DictConfig, run_dir: Path) -> None:
    _worker_logging(run_dir, rank == 0)
    _train_reporting(cfg, run_dir, distributed=True, report=rank == 0)


def _launch(cfg: DictConfig, run_dir: Path) -> None:
    """One process, N spawned workers (parallel.nproc_per_node), or this rank of a torchrun job."""
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
    if not torchrun:
        try:
            spawn(_spawned_worker, config.parallel.nproc_per_node, args=(cfg, run_dir), backend=backend)
        except ProcessExitedException as error:  # the worker printed its one line
            sys.exit(error.exit_code)
        return
    init_from_torchrun(backend)
    try:
        # Every rank writes into rank 0's run directory (on several machines, pass hydra.run.dir).
        shared = [str(run_dir)]
        dist.broadcast_object_list(shared, src=0)
        if dist.get_rank() != 0:
            logging.getLogger().setLevel(logging.WARNING)
        _train_reporting(cfg, Path(shared[0]), distributed=True, report=dist.get_rank() == 0)
    finally:
        dist.destroy_process_group()


def _task(cfg: DictConfig) -> None:
    hydra_config = HydraConfig.get()
    run_dir = Path(hydra_config.runtime.output_dir)
    try:
        _launch(cfg, run_dir)
    except ConfigError as error:
        _fail(str(error), EXIT_CONFIG_ERROR)
    except KeyboardInterrupt:
        overrides = [o for o in hydra_config.overrides.task if not o.startswith(("hydra.run.dir=", "trainer.resume="))]
        _fail(
            "interrupted; continue from the last checkpoint with: moetrain "
            + " ".join(overrides + [f"hydra.run.dir={run_dir}", "trainer.resume=auto"]),
            EXIT_INTERRUPTED,
        )


def main() -> None:
    if "--version" in sys.argv[1:]:  # before Hydra's parser, whose --version prints Hydra's own
        print(f"moetrain {moetrain.__version__} (torch {torch.__version__}, hydra-core {hydra.__version__})")
        return
    register_configs()
    args = get_args_parser().parse_args()
    if args.config_path or args.config_name:
        _fail("moetrain composes its own configs: add yours with --config-dir DIR instead of -cp/-cn", EXIT_CONFIG_ERROR)
    if not (args.help or args.hydra_help or args.shell_completion or args.info):
        try:
            check_command_line(args.overrides, args.multirun, args.config_dir)
        except ConfigError as error:
            _fail(str(error), EXIT_CONFIG_ERROR)
    hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME)(_task)()
