"""Layers point one way: only the command-line modules know Hydra, and config.py (the schema) is a
leaf that imports no other part of moetrain. Read from each module's own import statements (the
AST), so a late or conditional import counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import moetrain

PACKAGE = Path(moetrain.__file__).parent
# The command line: the only modules that may import Hydra or OmegaConf.
COMMAND_LINE = {"moetrain.cli", "moetrain.commands", "moetrain.__main__"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` in the file names (relative imports resolved)."""
    names = set()
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def test_the_scan_sees_imports():
    assert "moetrain.moe" in imported(MODULES["moetrain.models.lm"])
    assert any(name.startswith("hydra") for name in imported(MODULES["moetrain.cli"]))


def test_only_the_command_line_imports_hydra():
    offenders = {name: sorted(n for n in imported(path) if n.split(".")[0] in ("hydra", "omegaconf"))
                 for name, path in MODULES.items() if name not in COMMAND_LINE}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_config_is_a_leaf_schema_module():
    inside = sorted(name for name in imported(MODULES["moetrain.config"]) if name.split(".")[0] == "moetrain")
    assert inside == []


def test_quant_does_not_import_data_or_models():
    offenders = {name: sorted(n for n in imported(path) if n.startswith(("moetrain.data", "moetrain.models")))
                 for name, path in MODULES.items() if name.startswith("moetrain.quant")}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_trainer_does_not_import_models_and_strategies_do_not_import_each_other():
    assert not any(name.startswith("moetrain.models") for name in imported(MODULES["moetrain.train.trainer"]))
    strategy, training = MODULES["moetrain.train.strategy"], MODULES["moetrain.parallel.training"]
    assert not any(name.startswith("moetrain.parallel.training") for name in imported(strategy))
    assert not any(name.startswith("moetrain.train.strategy") for name in imported(training))


def test_no_module_uses_hydras_internals():
    offenders = {name: sorted(n for n in imported(path) if n.startswith("hydra._internal"))
                 for name, path in MODULES.items()}
    assert {name: found for name, found in offenders.items() if found} == {}
