"""What the command line's modules share (cli.py, the training command; commands.py, the commands on
a run directory): where the configs live, the exit codes, and every error as one line.

  fail            print `moetrain: error: MESSAGE` on stderr and exit with a code (2: a bad command
                  line or config, 1: training failed, 130: interrupted);
  in_config_keys  a library error's message in config keys (TrainerConfig.device='cuda' ->
                  trainer.device=cuda);
  explain         a Hydra or OmegaConf composition error in one line that names the key and the fix;
  check_target    a config group's _target_ imports and takes the group's keys with values of its types.

Command-line code: it knows Hydra (explain composes the config to list the keys a node has).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import sys
import types
import typing

import hydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from moetrain.config import Config, ConfigError, did_you_mean

CONFIG_MODULE = "moetrain.conf"
CONFIG_NAME = "config"
GROUPS = ("model", "gate", "parallel", "data", "optim", "trainer", "logger", "quant")
EXIT_CONFIG_ERROR = 2
EXIT_TRAINING_FAILED = 1
EXIT_INTERRUPTED = 130  # the shell's code for Ctrl-C


# ---- errors in one line -----------------------------------------------------------------
def one_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


# The library names a setting as its Python API does: a field of a settings dataclass
# (TrainerConfig.device='cuda') or a builder's argument (root='data'). The command line names it by
# its config key (trainer.device=cuda, data.root=data), with the value as an override writes it.
_GROUP_OF_SCHEMA = {hint.__name__: name for name, hint in typing.get_type_hints(Config).items()
                    if dataclasses.is_dataclass(hint)}  # TrainerConfig -> trainer, ...
_WORD = r"'[^']*'|\"[^\"]*\"|[^\s,;:()|'\"]+"
_VALUE = rf"(?:{_WORD})(?:\|(?:{_WORD}))*"  # one Python value, or alternatives joined by |
_OVERRIDE_LITERALS = {"True": "true", "False": "false", "None": "null"}


def _override_value(python: str) -> str:
    """'cuda' -> cuda, True -> true, None -> null, 'fsdp'|'fsdp_expert' -> fsdp|fsdp_expert."""
    return "|".join(_OVERRIDE_LITERALS.get(word, word.strip("'\"")) for word in re.findall(_WORD, python))


def in_config_keys(message: str, group: str | None = None, arguments=()) -> str:
    """A library error's message in the command line's terms: each settings dataclass (alone or
    with a field: TrainerConfig.resume='x') becomes its config group or key (trainer.resume=x);
    with `group`, each `NAME=VALUE` of `arguments` (the keyword arguments of the group's _target_)
    becomes group.NAME=VALUE."""

    def schema_key(match: re.Match) -> str:
        schema, field, value = match.group(1), match.group(2), match.group(3)
        key = _GROUP_OF_SCHEMA[schema] + (f".{field}" if field else "")
        return key + (f"={_override_value(value)}" if value is not None else "")

    schemas = "|".join(_GROUP_OF_SCHEMA)
    message = re.sub(rf"(?<![\w./])({schemas})(?:\.(\w+))?(?:=({_VALUE}))?", schema_key, message)
    if group and arguments:
        names = "|".join(re.escape(name) for name in arguments)
        message = re.sub(rf"(?<![\w./])({names})=({_VALUE})",
                         lambda match: f"{group}.{match.group(1)}={_override_value(match.group(2))}", message)
    return one_line(message)


def omegaconf_cause(error: BaseException) -> OmegaConfBaseException | None:
    """The OmegaConf error behind a composition error, if any."""
    while error is not None:
        if isinstance(error, OmegaConfBaseException):
            return error
        error = error.__cause__ or error.__context__
    return None


def node_under(parent: str, overrides: list[str]) -> DictConfig | None:
    """A config node as the command line's group choices make it (without its keys' overrides)."""
    parser = OverridesParser.create()
    group_choices = [
        text for text, o in zip(overrides, parser.parse_overrides(overrides)) if o.key_or_group in GROUPS + ("recipe",)
    ]
    try:
        node = hydra.compose(config_name=CONFIG_NAME, overrides=group_choices)
        node = OmegaConf.select(node, parent) if parent else node
    except Exception:  # the node only improves the message; the error itself is reported anyway
        return None
    return node if isinstance(node, DictConfig) else None


def _keys_under(parent: str, overrides: list[str]) -> list[str]:
    """The keys a config node has once the command line's group choices are applied."""
    node = node_under(parent, overrides)
    return list(node.keys()) if node is not None else []


def explain(error: Exception, overrides: list[str]) -> str:
    """One line for a Hydra or OmegaConf composition error."""
    if isinstance(error, MissingConfigException) and error.options is not None:
        group, _, option = (error.missing_cfg_file or "").rpartition("/")
        return (
            f"unknown {group or 'config'} option '{option}': choose {group}=" + "|".join(error.options)
            + did_you_mean(option, error.options)
        )
    cause = omegaconf_cause(error)
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
    if isinstance(cause, MissingMandatoryValue) and cause.full_key:
        return f"{cause.full_key} has no value (???): set {cause.full_key}=VALUE"
    if isinstance(cause, InterpolationResolutionError) and cause.full_key:
        key, problem = cause.full_key, str(cause.msg).splitlines()[0]
        variable = re.search(r"Environment variable '([^']*)' not found", problem)
        if variable:
            return (f"{key}: the environment variable {variable.group(1)} it reads (oc.env) is not set: "
                    f"export {variable.group(1)}=VALUE, or give {key}=VALUE")
        if "Recursive interpolation" in problem:
            return f"{key}: its interpolation refers back to itself: give {key}=VALUE, or point it at another key"
        return f"{key}: cannot resolve its interpolation ({one_line(problem)}): give {key}=VALUE, or fix the ${{...}}"
    if isinstance(cause, ValidationError) and cause.full_key:
        # The message's first line is the problem; the rest repeats the key and the schema's name.
        return f"bad value for {cause.full_key}: {str(cause.msg).splitlines()[0]}"
    return one_line(cause.msg if cause is not None else error)


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


def import_object(path: str):
    """The object a dotted path names, as Hydra's _target_ means it: from the top-level module, each
    next name is an attribute when the object has one (a package's `synthetic` function before its
    `synthetic` submodule), else a submodule. ImportError saying what is missing."""
    parts = path.split(".")
    try:
        found = importlib.import_module(parts[0])
    except ModuleNotFoundError:
        raise ImportError(f"no module named {parts[0]!r}") from None
    for depth, name in enumerate(parts[1:], start=1):
        if hasattr(found, name):
            found = getattr(found, name)
            continue
        module_name = ".".join(parts[: depth + 1])
        try:
            found = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise  # the module exists but needs one that is not installed
            raise ImportError(f"{'.'.join(parts[:depth])} has no attribute {name!r}") from None
    return found


def check_target(group: str, node: dict) -> None:
    """The group's _target_ imports, and takes every key of the group with a value of its type."""
    path = node["_target_"]
    try:
        target = import_object(path)
    except ImportError as error:
        raise ConfigError(f"{group}._target_={path} cannot be imported ({one_line(error)}): fix the dotted path")
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


def target_arguments(path: str) -> list[str]:
    """The keyword arguments of the callable a _target_ names (check_target imported it already)."""
    parameters = inspect.signature(import_object(path)).parameters
    return [name for name, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def fail(message: str, code: int) -> typing.NoReturn:
    print(f"moetrain: error: {message}", file=sys.stderr)
    sys.exit(code)
