"""Layers point one way: every import points down the floors that moetrain/__init__.py lists, none
runs in a circle, only the command-line modules know Hydra, and config.py (the schema) is a leaf
that imports no other part of moetrain. Read from each module's own import statements (the AST), so
a late or conditional import counts too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import moetrain

PACKAGE = Path(moetrain.__file__).parent
# The command line: the only modules that may import Hydra or OmegaConf.
COMMAND_LINE = {"moetrain.cli", "moetrain.commands", "moetrain.command_errors", "moetrain.__main__"}


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


def test_the_trainer_does_not_import_models_and_the_processes_do_not_import_each_other():
    assert not any(name.startswith("moetrain.models") for name in imported(MODULES["moetrain.train.trainer"]))
    single, distributed = MODULES["moetrain.train.processes"], MODULES["moetrain.parallel.processes"]
    assert not any(name.startswith("moetrain.parallel.processes") for name in imported(single))
    assert not any(name.startswith("moetrain.train.processes") for name in imported(distributed))


def test_no_module_uses_hydras_internals():
    offenders = {name: sorted(n for n in imported(path) if n.startswith("hydra._internal"))
                 for name, path in MODULES.items()}
    assert {name: found for name, found in offenders.items() if found} == {}


# The library raises plain errors in the Python API's terms; only the command line names config keys.
CONFIG_ERROR_ALLOWED = COMMAND_LINE | {"moetrain.config"}
# Every config group: the library names settings as the Python API does (TrainerConfig.max_steps,
# GateConfig.type, a builder's path=...), and the command line rewrites them into these keys.
CONFIG_GROUPS = ("trainer", "parallel", "optim", "logger", "hydra", "gate", "data", "model", "quant")
CONFIG_KEY = re.compile(rf"(?<![\w.])({'|'.join(CONFIG_GROUPS)})\.[a-z_]+")


def raised_texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each string constant (f-string parts included) inside a `raise` statement,
    or returned by a function that builds an error (annotated to return one, or named *_error)."""
    texts = []
    tree = ast.parse(path.read_text(), str(path))
    error_builders = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                      and (node.name.lower().endswith("error") or "Error" in ast.unparse(node.returns or ast.Pass()))]
    roots = [node for node in ast.walk(tree) if isinstance(node, ast.Raise)]
    roots += [ret for function in error_builders for ret in ast.walk(function) if isinstance(ret, ast.Return)]
    for root in roots:
        for node in ast.walk(root):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.append((node.lineno, node.value))
    return texts


def test_the_scan_sees_raised_messages(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('def f(x):\n    raise ValueError(f"trainer.device={x}: use " "trainer.device=cpu")\n'
                      'def _download_failed() -> OSError:\n    return OSError("set parallel.strategy=data")\n')
    assert [CONFIG_KEY.search(text).group(0) for _, text in raised_texts(sample)] == [
        "trainer.device", "trainer.device", "parallel.strategy"]


def test_only_the_command_line_knows_config_errors():
    offenders = {name: sorted(n for n in imported(path) if n == "moetrain.config.ConfigError")
                 for name, path in MODULES.items() if name not in CONFIG_ERROR_ALLOWED}
    assert {name: found for name, found in offenders.items() if found} == {}
    mentions = {name for name, path in MODULES.items()
                if name not in CONFIG_ERROR_ALLOWED and re.search(r"\bConfigError\b", path.read_text())}
    assert mentions == set()


def test_library_errors_name_no_config_keys():
    """A library module's raised messages name settings as Python does (TrainerConfig.device='cuda',
    device='cuda'), never as config keys (trainer.device=cuda): the command line rewrites them."""
    offenders = {f"{name}:{line}": text for name, path in MODULES.items() if name not in CONFIG_ERROR_ALLOWED
                 for line, text in raised_texts(path) if CONFIG_KEY.search(text)}
    assert offenders == {}


def test_the_command_starts_without_fsdp_and_dcp():
    """The console script's modules do not import torch's FSDP, DTensor or DCP (about a second of
    every command's start, its --help and bad-input errors included); a distributed run imports them
    when it builds its trainer seam. Checked in a fresh interpreter, where nothing else loaded them."""
    import subprocess
    import sys

    heavy = ["torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint"]
    probe = (f"import sys, moetrain.cli, moetrain.commands, moetrain.parallel; "
             f"print([m for m in {heavy!r} if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout
    # and the lazy name still resolves
    probe = "import moetrain.parallel as p, sys; p.shard_model; print('torch.distributed.fsdp' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "True", result.stderr[-2000:]


# ---- floors: every import points down, and none runs in a circle -----------------------------------
# The package docstring's table: "  N  part part ...  what that floor holds", part = a top-level
# module or subpackage of moetrain.
FLOOR_ROW = re.compile(r"^  (\d+)  (\S+(?: \S+)*)  +\S", re.MULTILINE)


def floors_of(docstring: str) -> dict[str, int]:
    """{moetrain.PART: its floor} from the table of the package docstring."""
    return {f"moetrain.{part}": int(floor) for floor, parts in FLOOR_ROW.findall(docstring) for part in parts.split()}


def imports_of(source: str, module: str, is_package: bool, modules) -> set[str]:
    """The modules among `modules` that the source of `module` imports, anywhere in it (inside a
    function too). `from P import N` imports the module P.N where there is one, else P."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in modules and name != module)
    return found


def floor_of(module: str, floors: dict[str, int], graph: dict[str, set[str]]) -> int | None:
    """The floor of a module: its part's. The root package only hands names on (its face), so it
    stands as high as the highest module it imports."""
    if module not in floors and "." not in module:
        return max((floor_of(name, floors, graph) or 0 for name in graph.get(module, ())), default=0)
    part = max((part for part in floors if module == part or module.startswith(part + ".")), key=len, default=None)
    return floors.get(part)


def upward_imports(graph: dict[str, set[str]], floors: dict[str, int]) -> list[str]:
    """'A (floor a) -> B (floor b)' for each import of a module from a higher floor."""
    found = []
    for module, names in sorted(graph.items()):
        low = floor_of(module, floors, graph)
        for name in sorted(names):
            high = floor_of(name, floors, graph)
            if low is not None and high is not None and high > low:
                found.append(f"{module} (floor {low}) -> {name} (floor {high})")
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other in a loop: each strongly connected component of more than
    one module (Tarjan), sorted, or a module that imports itself."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for name in graph.get(module, ()):
            if name not in index:
                visit(name)
                low[module] = min(low[module], low[name])
            elif name in on_stack:
                low[module] = min(low[module], index[name])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or module in graph.get(module, ()):
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(cycles)


FLOORS = floors_of(moetrain.__doc__)
GRAPH = {name: imports_of(path.read_text(), name, path.name == "__init__.py", MODULES) for name, path in MODULES.items()}


def test_every_module_stands_on_a_floor():
    assert FLOORS, "the table of floors in moetrain/__init__.py's docstring did not parse"
    assert sorted(name for name in MODULES if name != "moetrain" and floor_of(name, FLOORS, GRAPH) is None) == []
    assert sorted(part for part in FLOORS if part not in MODULES) == []  # no stale name in the table


def test_every_import_points_down():
    assert upward_imports(GRAPH, FLOORS) == []


def test_no_imports_run_in_a_circle():
    assert import_cycles(GRAPH) == []


def test_the_checks_catch_a_planted_cycle_and_an_upward_import():
    floors = {"pkg.low": 1, "pkg.high": 2}
    graph = {"pkg.low.a": {"pkg.low.b"}, "pkg.low.b": {"pkg.low.c"}, "pkg.low.c": {"pkg.low.a"},
             "pkg.low.d": set(), "pkg.high.x": {"pkg.low.a", "pkg.low.d"}}
    assert import_cycles(graph) == [["pkg.low.a", "pkg.low.b", "pkg.low.c"]]
    assert upward_imports(graph, floors) == []  # a cycle inside one floor is still a cycle, not an upward import
    graph["pkg.low.d"] = {"pkg.high.x"}
    assert upward_imports(graph, floors) == ["pkg.low.d (floor 1) -> pkg.high.x (floor 2)"]
    assert import_cycles(graph) == [["pkg.high.x", "pkg.low.d"], ["pkg.low.a", "pkg.low.b", "pkg.low.c"]]
    graph["pkg.low.d"] = {"pkg.low.d"}
    assert ["pkg.low.d"] in import_cycles(graph)


def test_the_checks_see_a_deferred_upward_import_planted_in_the_package():
    """A function-level import from a higher floor (here the MoE layer reaching for the CLI) is
    found, and relative and `from moetrain import MODULE` imports resolve to the module named."""
    source = ("from . import gates\nfrom moetrain import ops\n\n\ndef late():\n"
              "    from moetrain.cli import main  # deferred\n    return main\n")
    found = imports_of(source, "moetrain.moe.planted", False, MODULES)
    assert found == {"moetrain.moe.gates", "moetrain.ops", "moetrain.cli"}
    graph = dict(GRAPH, **{"moetrain.moe.planted": found})
    assert upward_imports(graph, FLOORS) == [
        f"moetrain.moe.planted (floor {FLOORS['moetrain.moe']}) -> moetrain.cli (floor {FLOORS['moetrain.cli']})"]
    # and a planted circle through the real modules: the layer importing back from a model
    graph["moetrain.moe.layer"] = GRAPH["moetrain.moe.layer"] | {"moetrain.models.layers"}
    assert any({"moetrain.moe.layer", "moetrain.models.layers"} <= set(cycle) for cycle in import_cycles(graph))
