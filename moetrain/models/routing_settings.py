"""A model's routing in its two forms: one flat mapping, and the MoELayer keyword arguments.

The flat form is the `gate` node of a run's config, saved with every checkpoint: the gate kind
(`type`, a registered gate, or `_target_`, the dotted path of a gate class of your own, with its
constructor's `kwargs`), the layer's routing settings, and the chosen gate's own settings side by
side, as Hugging Face configs keep them:

    {"type": "sigmoid", "top_k": 8, "capacity_factor": 0, "balance_loss_weight": 0.0001,
     "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "jitter_eps": None, ...}

The layer form is what a model gives each MoELayer (`moe_kwargs`; a preset's routing):

    {"gate": "sigmoid", "top_k": 8, "capacity_factor": 0, ..., "gate_kwargs": {"n_group": 8, ...}}

The layer's routing settings are the fields of moetrain.config.GateConfig; a gate's own settings are
the fields of the dataclass registered with it (moetrain.moe.gates.register_gate). A setting left
None (null) takes the gate's default. A gate of your own (`_target_`) gets `kwargs` only.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from enum import Enum
from typing import Mapping

from moetrain.config import GateConfig
from moetrain.moe import GATES, Gate, MoELayer

# The flat form's keys that name the gate rather than set it.
GATE_CHOICE_KEYS = ("type", "_target_", "kwargs")
# The layer's routing settings: GateConfig's other fields, each an MoELayer argument of that name.
LAYER_SETTINGS = tuple(f.name for f in dataclasses.fields(GateConfig) if f.name not in GATE_CHOICE_KEYS)


def gate_settings(name: str) -> tuple[str, ...]:
    """The settings a registered gate declares (the fields of its Settings dataclass)."""
    settings = GATES[name].Settings
    return tuple(f.name for f in dataclasses.fields(settings)) if settings is not None else ()


def setting_owners() -> dict[str, list[str]]:
    """Every registered gate's setting -> the gates that declare it."""
    owners: dict[str, list[str]] = {}
    for name in GATES:
        for setting in gate_settings(name):
            owners.setdefault(setting, []).append(name)
    return owners


def gate_class(path: str) -> type[Gate]:
    """The Gate subclass a dotted path names; ValueError when it cannot be used."""
    module_name, _, class_name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(
            f"GateConfig._target_={path!r} cannot be imported ({error}): give the dotted path of a Gate subclass "
            f"in an importable module (installed, or its folder on PYTHONPATH)"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, Gate)):
        raise ValueError(f"GateConfig._target_={path!r} is not a moetrain.moe.Gate subclass (see docs/extending.md)")
    return cls


def _plain(value):
    return value.value if isinstance(value, Enum) else value


def layer_kwargs(flat: Mapping) -> dict:
    """The MoELayer keyword arguments of a flat routing. A layer setting it lacks takes GateConfig's
    default (a run saved before the setting existed); the chosen gate's settings it leaves None take
    the gate's defaults, stated explicitly so that the result replaces a preset's routing whole.
    ValueError, naming the key, for an unknown key, a gate that does not exist or a setting that
    belongs to another gate."""
    flat = {key: _plain(value) for key, value in dict(flat).items()}
    unknown = sorted(set(flat) - set(GATE_CHOICE_KEYS) - set(LAYER_SETTINGS) - set(setting_owners()))
    if unknown:
        raise ValueError(f"GateConfig has unknown setting(s) {unknown}: its keys are "
                         + ", ".join([*GATE_CHOICE_KEYS, *LAYER_SETTINGS, *setting_owners()]))
    defaults = GateConfig()
    layer = {key: flat[key] if key in flat else _plain(getattr(defaults, key)) for key in LAYER_SETTINGS}
    own = {key: value for key, value in flat.items()
           if key not in GATE_CHOICE_KEYS and key not in LAYER_SETTINGS and value is not None}
    target, constructor_kwargs = flat.get("_target_"), dict(flat.get("kwargs") or {})
    if target is not None:  # your own gate replaces the model's: the built-in gates' settings do not apply
        return {"gate": gate_class(target), **layer, "gate_kwargs": constructor_kwargs}
    if constructor_kwargs:
        raise ValueError("GateConfig.kwargs are constructor arguments of your own gate: set "
                         "GateConfig._target_='your_module.YourGate' as well, or use the built-in gates' settings "
                         "(GateConfig.normalize, ...)")
    kind = flat.get("type", defaults.type)
    if kind not in GATES:
        raise ValueError(f"GateConfig.type={kind!r} is not one of {'|'.join(GATES)}")
    for key in own:
        if key not in gate_settings(kind):
            owners = [name for name in GATES if key in gate_settings(name)]
            raise ValueError(f"GateConfig.{key} applies to GateConfig.type={'|'.join(repr(o) for o in owners)} only, "
                             f"not {kind}: remove GateConfig.{key}, or choose the {kind} gate with its own "
                             f"defaults")
    settings = GATES[kind].Settings
    if settings is not None:
        try:
            own = dataclasses.asdict(settings(**own))
        except ValueError as error:
            raise ValueError(f"gate ({kind}): {error}") from None
    return {"gate": kind, **layer, "gate_kwargs": own}


def _layer_default(name: str):
    return inspect.signature(MoELayer).parameters[name].default


def flat_routing(moe_kwargs: Mapping) -> dict:
    """The flat form of a model's MoELayer keyword arguments (a registered gate by name): every layer
    setting as the layer would use it, the gate's own settings as given."""
    gate = moe_kwargs.get("gate", _layer_default("gate"))
    if not isinstance(gate, str):
        raise ValueError(f"a routing in flat form names a registered gate; got {gate!r}")
    flat = {"type": gate}
    flat.update({key: _plain(moe_kwargs.get(key, _layer_default(key))) for key in LAYER_SETTINGS})
    flat.update(moe_kwargs.get("gate_kwargs") or {})
    return flat
