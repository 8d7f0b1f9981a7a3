"""What the command reads before Hydra's entry point, through Hydra's public API only: the jobs of a
basic sweep (-m), its flags, and the object a `_target_` names."""

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from moetrain import cli, command_errors
from moetrain.data import synthetic
from moetrain.models import VisionMoE


def jobs(*overrides: str) -> list[list[str]]:
    return cli.sweep_runs(OverridesParser.create().parse_overrides(list(overrides)))


def test_a_sweep_is_every_combination_in_command_line_order():
    assert jobs("+recipe=quickstart", "gate=switch,gshard", "gate.top_k=range(1,3)", "name=a") == [
        ["+recipe=quickstart", "gate=switch", "gate.top_k=1", "name=a"],
        ["+recipe=quickstart", "gate=switch", "gate.top_k=2", "name=a"],
        ["+recipe=quickstart", "gate=gshard", "gate.top_k=1", "name=a"],
        ["+recipe=quickstart", "gate=gshard", "gate.top_k=2", "name=a"],
    ]


def test_a_key_given_twice_keeps_its_place_and_its_last_values():
    assert jobs("gate.top_k=1,2", "seed=0", "gate.top_k=3,4") == [["gate.top_k=3", "seed=0"], ["gate.top_k=4", "seed=0"]]
    assert jobs("seed=0") == [["seed=0"]]


def test_a_sweep_a_plugin_must_expand_is_refused():
    with pytest.raises(cli.HydraException, match="interval"):
        jobs("optim.lr=interval(0.1,1)")


def test_flags_that_take_values_are_not_overrides():
    args = cli.command_line_parser().parse_args(["-m", "--cfg", "job", "-p", "gate", "--config-dir", "mine", "seed=1"])
    assert (args.multirun, args.cfg, args.package, args.config_dir, args.overrides) == (True, "job", "gate", "mine",
                                                                                         ["seed=1"])
    assert cli.command_line_parser().parse_args(["--info"]).info == "all"


def test_import_object_finds_classes_and_says_what_is_missing():
    assert command_errors.import_object("moetrain.models.VisionMoE") is VisionMoE
    assert command_errors.import_object("moetrain.models.vision.VisionMoE") is VisionMoE
    # A package's attribute wins over its submodule of the same name (data._target_: moetrain.data.synthetic).
    assert command_errors.import_object("moetrain.data.synthetic") is synthetic and callable(synthetic)
    with pytest.raises(ImportError, match="no module named 'nowhere'"):
        command_errors.import_object("nowhere.Model")
    with pytest.raises(ImportError, match="has no attribute 'Nope'"):
        command_errors.import_object("moetrain.models.Nope")
