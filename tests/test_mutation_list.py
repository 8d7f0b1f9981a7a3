"""tests/mutation.py's mutants stay runnable: each names text that occurs exactly once in its file
(else the mutation check stops at it as stale) and test files that exist. The check itself takes
about 20 minutes and is not part of this suite (docs/testing.md)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mutation_module():
    spec = importlib.util.spec_from_file_location("moetrain_mutation_check", ROOT / "tests" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_mutant_names_code_and_tests_that_exist():
    mutants = _mutation_module().MUTANTS
    assert mutants
    for mutant in mutants:
        text = (ROOT / mutant.path).read_text()
        assert text.count(mutant.before) == 1, f"stale mutant {mutant.name}: fix its text in tests/mutation.py"
        assert mutant.after != mutant.before, mutant.name
        for test in mutant.tests:
            assert (ROOT / test).is_file(), f"mutant {mutant.name} names a missing test file {test}"
