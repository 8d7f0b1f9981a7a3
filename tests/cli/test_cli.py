"""The moetrain command: recipes, overrides, one-line errors, run directories, resume, sweeps.

Most checks compose in-process; a few run the real command in a subprocess (console script and
`python -m moetrain`) to see exit codes, files and stderr as a user would.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_RUN, TINY_SYNTHETIC

from moetrain import cli, command_errors
from moetrain.moe import MoELayer

IMAGE_RECIPES = ["quickstart", "switch_cifar10", "gshard_cifar10", "switch_mnist"]


def data_overrides(recipe: str, cifar10_root: Path, mnist_root: Path) -> list[str]:
    if "cifar10" in recipe or "mnist" in recipe:
        root = cifar10_root if "cifar10" in recipe else mnist_root
        return [f"data.root={root}", "data.download=false", "data.verify_checksums=false"]
    return TINY_SYNTHETIC


@pytest.mark.parametrize("recipe", cli.recipe_names())
def test_every_recipe_composes_and_passes_the_checks(compose, recipe):
    cfg = compose([f"+recipe={recipe}"])
    config = cli.checked(cfg)
    assert config.name == recipe  # the run directory is named after the recipe


def run_in_process(argv: list[str], monkeypatch, cwd: Path) -> None:
    """`moetrain ARGV` in this process: Hydra's entry point and all (Hydra leaves Python's logging
    alone with the two logging overrides, so pytest's capture is not disturbed)."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["moetrain", *argv, "hydra/job_logging=none", "hydra/hydra_logging=none"])
    cli.main()


@pytest.mark.parametrize("recipe", IMAGE_RECIPES)
def test_image_recipes_train_a_few_steps(recipe, cifar10_root, mnist_root, tmp_path, monkeypatch):
    """Every image recipe through the command, on fabricated CIFAR-10 / MNIST files."""
    run_in_process([f"+recipe={recipe}", *TINY_RUN, *data_overrides(recipe, cifar10_root, mnist_root)],
                   monkeypatch, tmp_path)
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.endswith(f"_{recipe}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["step"] == 3
    assert all(math.isfinite(metrics[key]) for key in ("train/loss", "train/aux_loss", "eval/loss"))
    assert 0.0 <= metrics["eval/accuracy"] <= 1.0
    assert (run_dir / "checkpoints" / "step_00000003.pt").is_file()
    assert list(run_dir.glob("events.out.tfevents.*"))


def test_recipes_set_what_they_promise(compose):
    switch = cli.checked(compose(["+recipe=switch_cifar10"]))
    gshard = cli.checked(compose(["+recipe=gshard_cifar10"]))
    assert (switch.gate.top_k, gshard.gate.top_k) == (1, 2)
    assert switch.data["_target_"] == gshard.data["_target_"] == "moetrain.data.cifar10"
    assert cli.checked(compose(["+recipe=switch_mnist"])).data["_target_"] == "moetrain.data.mnist"
    assert cli.checked(compose(["+recipe=quickstart"])).data["_target_"] == "moetrain.data.synthetic"


def test_command_line_settings_reach_every_moe_layer(compose):
    overrides = [
        "gate=switch", "gate.top_k=2", "gate.capacity_factor=0", "gate.balance_loss_weight=0.5",
        "gate.z_loss_weight=0.25", "gate.impl=torch", "model.num_experts=6", "model.moe_every=1", *TINY_SYNTHETIC,
    ]
    data, model = cli.build(cli.checked(compose(overrides)))
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert len(layers) == 4  # model.depth=4 of vit_tiny, every block
    images = data.train_set.tensors[0][:8]
    model(images)
    for layer in layers:
        assert (layer.num_experts, layer.top_k, layer.capacity_factor, layer.impl) == (6, 2, 0.0, "torch")
        assert layer.gate.jitter_eps == 0.01  # from gate=switch
        expected = 0.5 * layer.stats.balance_loss + 0.25 * layer.stats.z_loss
        torch.testing.assert_close(layer.aux_loss.detach(), expected)
    assert model.head.out_features == 10 and model.patch_embed.in_channels == 3  # sizes from the data


def test_a_negative_capacity_factor_is_the_capped_layout_on_the_command_line_too(compose):
    """The library and the command line take the same capacity factors (moetrain/moe/routing.py):
    gate.capacity_factor=-0.5 builds layers that route dropless, packed, capped at
    top_k * int(0.5 * ceil(tokens / experts)) rows an expert."""
    overrides = ["gate.capacity_factor=-0.5", "gate.impl=torch", "model.num_experts=4", "model.moe_every=1",
                 *TINY_SYNTHETIC]
    data, model = cli.build(cli.checked(compose(overrides)))
    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    assert layer.capacity_factor == -0.5
    tokens_TD = torch.randn(64, layer.model_dim)
    layer(tokens_TD)
    limit = layer.top_k * int(0.5 * -(-64 // 4))
    assert layer.stats.padded_capacity is None  # packed, as dropless
    assert torch.equal(layer.stats.kept_per_expert, layer.stats.tokens_per_expert.clamp(max=limit))
    assert layer.stats.dropped_fraction > 0  # the cap bit: 64 tokens x 2 choices over 4 experts of 16 rows


@pytest.mark.parametrize("gate", ["top", "switch", "gshard", "cosine", "sigmoid", "qwen3"])
def test_every_gate_preset_builds_and_routes(compose, gate):
    overrides = [f"gate={gate}", "gate.impl=torch", "model.depth=2", "model.moe_every=1", *TINY_SYNTHETIC]
    data, model = cli.build(cli.checked(compose(overrides)))
    logits = model(data.train_set.tensors[0][:4])
    assert logits.shape == (4, 10) and torch.isfinite(logits).all()
    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    assert type(layer.gate).__name__ == {"cosine": "CosineGate", "sigmoid": "SigmoidGate"}.get(gate, "TopKGate")


def test_optimizer_and_trainer_overrides_are_typed(compose):
    config = cli.checked(compose(["optim.lr=3e-4", "trainer.max_steps=100", "trainer.on_nonfinite=skip"]))
    assert config.optim.lr == 3e-4 and config.trainer.max_steps == 100
    assert config.trainer.on_nonfinite.value == "skip"


ERRORS = [
    (["recipe=quickstart"], "+recipe=... with a plus"),
    (["+recipe=quickstrt"], "did you mean quickstart?"),
    (["data=cifar"], "did you mean cifar10?"),
    (["gate=swich"], "did you mean switch?"),
    (["trainer.max_step=3"], "did you mean max_steps?"),
    (["+trainer.foo=1"], "unknown key trainer.foo"),
    (["trainer.max_steps=abc"], "bad value for trainer.max_steps"),
    (["trainer.on_nonfinite=maybe"], "expected one of [stop, skip]"),
    (["trainer.precision=fp8_row"], "expected one of [auto, bf16, fp32, fp8, fp8_block]"),
    (["trainer.fp8_wgrad=fp16"], "expected one of [bf16, fp8]"),
    (["trainer.fp8_wgrad=fp8"], "trainer.fp8_wgrad=fp8 applies only with precision fp8 or fp8_block, not with "
                                "trainer.precision=auto"),
    (["trainer.fp8_linears=true"], "trainer.fp8_linears=true applies only with trainer.precision=fp8 (row-wise "
                                   "scales), not with trainer.precision=auto; set trainer.precision=fp8 or "
                                   "trainer.fp8_linears=false"),
    (["trainer.fp8_linears=true", "trainer.precision=fp8_block"], "not with trainer.precision=fp8_block"),
    (["+recipe=qwen3_moe_lm", "+model.dim=40", "trainer.precision=fp8", "trainer.fp8_linears=true"],
     "trainer.fp8_linears: the model's transformer blocks have no dense linear whose input and output features are "
     "multiples of 16"),
    (["trainer.param_dtype=float16"], "expected one of [float32, bfloat16]"),
    (["trainer.param_dtype=bfloat16", "optim=sgd"], "trainer.param_dtype=bfloat16 keeps fp32 master weights in AdamW"),
    (["trainer.param_dtype=bfloat16", "trainer.precision=fp32"], "trainer.param_dtype=bfloat16 computes in bf16"),
    (["optim.moment_dtype=bfloat16"], "optim.moment_dtype=bfloat16 keeps the moments of the master-weight AdamW of "
                                      "bf16 parameters: set trainer.param_dtype=bfloat16 too"),
    (["optim.moment_dtype=float16"], "expected one of [float32, bfloat16]"),
    (["optim.master_weights=false"], "optim.master_weights=false rounds bf16 parameters stochastically: set "
                                     "trainer.param_dtype=bfloat16 too"),
    (["trainer.param_dtype=bfloat16", "parallel.strategy=fsdp", "parallel.nproc_per_node=2"],
     "trainer.param_dtype=bfloat16 applies to parallel.strategy=data|expert, not fsdp: set "
     "trainer.param_dtype=float32 and parallel.mixed_precision=true"),
    (["trainer.param_dtype=bfloat16", "optim.master_weights=false", "parallel.strategy=fsdp_expert"],
     "trainer.param_dtype=bfloat16 applies to parallel.strategy=data|expert, not fsdp_expert"),
    (["trainer.profile_at=-1"], "trainer.profile_at must be >= 0"),
    (["gate.top_k=9"], "gate.top_k=9 exceeds model.num_experts=4"),
    (["-m", "gate.top_k=1,9"], "gate.top_k=9 exceeds model.num_experts=4"),
    (["+model.dimm=3"], "did you mean dim?"),
    (["model.dim=abc"], "bad value for model.dim"),
    (["gate=sigmoid", "gate.jitter_eps=0.1"], "gate.jitter_eps applies to gate.type=top"),
    (["model._target_=nowhere.Model"], "cannot be imported"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio must be in [0, 1]"),
    pytest.param(["trainer.device=cuda"], "no CUDA GPU is visible",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")),
]


def expect_one_line_error(argv, message, monkeypatch, capsys, tmp_path):
    """The command exits 2 with one 'moetrain: error:' line holding `message`, and starts nothing."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["moetrain", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("moetrain: error: "), lines
    assert message in lines[0]
    assert not (tmp_path / "runs").exists()  # nothing started


@pytest.mark.parametrize("argv, message", ERRORS)
def test_config_mistakes_exit_2_with_one_line(argv, message, monkeypatch, capsys, tmp_path):
    expect_one_line_error(argv, message, monkeypatch, capsys, tmp_path)


@pytest.mark.parametrize("library, command_line", [
    ("TrainerConfig.resume='runs/x': no checkpoint there; or TrainerConfig.resume='auto'",
     "trainer.resume=runs/x: no checkpoint there; or trainer.resume=auto"),
    ("use ParallelConfig.strategy='fsdp'|'fsdp_expert' with ParallelConfig.nproc_per_node > 1",
     "use parallel.strategy=fsdp|fsdp_expert with parallel.nproc_per_node > 1"),
    ("ParallelConfig: zero applies to strategy=data|expert", "parallel: zero applies to strategy=data|expert"),
    ("lower OptimConfig.lr, or set TrainerConfig.on_nonfinite='skip'", "lower optim.lr, or set trainer.on_nonfinite=skip"),
    ("MyTrainerConfig.device and a/TrainerConfig.py stay", "MyTrainerConfig.device and a/TrainerConfig.py stay"),
])
def test_library_messages_name_config_keys_on_the_command_line(library, command_line):
    assert command_errors.in_config_keys(library) == command_line


def test_a_builders_arguments_become_the_groups_keys():
    message = "CIFAR-10 not found under root='/tmp/x': set download=True, or give root=FOLDER; mode=None stays"
    assert command_errors.in_config_keys(message, "data", ["root", "download"]) == (
        "CIFAR-10 not found under data.root=/tmp/x: set data.download=true, or give data.root=FOLDER; mode=None stays")


def test_interrupted_run_says_how_to_resume(monkeypatch, capsys, tmp_path):
    argv = ["+recipe=quickstart", *TINY_RUN, *TINY_SYNTHETIC, "logger=none"]

    def ctrl_c(trainer):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.Trainer, "fit", ctrl_c)
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(argv, monkeypatch, tmp_path)
    assert exit_info.value.code == 130
    (run_dir,) = (tmp_path / "runs").iterdir()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("moetrain: error: interrupted; continue from the last checkpoint with: moetrain ")
    assert line.endswith(f"{' '.join(argv)} hydra.run.dir={run_dir.resolve()} trainer.resume=auto"), line


def test_missing_kernels_stop_with_one_line_and_the_fix(monkeypatch, capsys, tmp_path):
    """A machine where the compiled kernels cannot load: one line that says so and how to go on."""
    from moetrain.ops import extension

    monkeypatch.setattr(extension, "_module", None)
    monkeypatch.setattr(extension, "_error", "moetrain's compiled kernels are unavailable: (simulated)")
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(["+recipe=quickstart", *TINY_RUN, *TINY_SYNTHETIC, "logger=none"], monkeypatch, tmp_path)
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("moetrain: error: moetrain's compiled kernels are unavailable") and "gate.impl=torch" in line


def test_help_lists_groups_and_recipes(monkeypatch, capsys):
    # Hydra's --help sets up its own logging: a handler on this test's captured stdout, which later
    # tests would find closed ("Logging error" on their stderr). Put the root's handlers back after.
    monkeypatch.setattr(logging.getLogger(), "handlers", list(logging.getLogger().handlers))
    monkeypatch.setattr(sys, "argv", ["moetrain", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for group in command_errors.GROUPS:
        assert f"\n{group}: " in text, group
    recipes = next(line for line in text.splitlines() if line.startswith("recipe: "))
    assert all(name in recipes for name in IMAGE_RECIPES)


# ---- the real command ----------------------------------------------------------------------------
def moetrain(*args: str, cwd: Path, module: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "moetrain"] if module else [str(Path(sys.executable).parent / "moetrain")]
    return subprocess.run(command + list(args), cwd=cwd, capture_output=True, text=True, timeout=300)


def test_quickstart_run_directory_and_resume(tmp_path):
    first = moetrain("+recipe=quickstart", *TINY_RUN, *TINY_SYNTHETIC, "trainer.checkpoint_every=2",
                     cwd=tmp_path, module=True)
    assert first.returncode == 0, first.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.endswith("_quickstart")  # runs/<date>_<time>_quickstart
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "moetrain.log").is_file()
    assert list(run_dir.glob("events.out.tfevents.*"))
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] != []
    assert json.loads((run_dir / "metrics.json").read_text())["step"] == 3

    resumed = moetrain("+recipe=quickstart", *TINY_RUN, *TINY_SYNTHETIC, "trainer.max_steps=5",
                       f"hydra.run.dir={run_dir}", "trainer.resume=auto", cwd=tmp_path, module=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in (run_dir / "moetrain.log").read_text()
    assert json.loads((run_dir / "metrics.json").read_text())["step"] == 5


def test_sweep_gives_each_run_its_own_directory(tmp_path):
    result = moetrain("-m", "+recipe=quickstart", "gate=switch,gshard", "trainer.max_steps=1", "logger=none",
                      *TINY_SYNTHETIC, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (sweep_dir,) = (tmp_path / "runs").iterdir()
    assert sweep_dir.name.endswith("_quickstart")
    runs = sorted(p.name for p in sweep_dir.iterdir() if p.is_dir())
    assert len(runs) == 2 and "gate=gshard" in runs[0] and "gate=switch" in runs[1], runs
    for name in runs:
        assert json.loads((sweep_dir / name / "metrics.json").read_text())["step"] == 1


def test_missing_dataset_is_one_line_from_the_console_script(tmp_path):
    missing = moetrain("+recipe=switch_cifar10", f"data.root={tmp_path / 'nothing'}", "data.download=false",
                       "logger=none", cwd=tmp_path)
    assert missing.returncode == 2
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.download=true" in lines[0] and "Traceback" not in missing.stderr, lines
