"""Nothing in a file runs: checkpoints a user is handed are loaded as data only.

A tiny language-model run is trained once per module by the moetrain command. Its checkpoint is
then planted with a pickled object whose __reduce__ would create a marker file, in each place a
run directory can carry one: a one-process step_N.pt, one rank's file of a per-rank step_N/, an
item of a sharded (DCP) step_N/ and DCP's own .metadata, each with its checksum rewritten to match
(a checksum proves a file whole, not harmless). Resume, eval, generate, export and load_run must
refuse each with one line (exit 2) or a clear exception, and the marker must never appear; the
same payload loaded in full does create it, so the test can tell.

A checkpoint of an earlier moetrain (random states as Python's and NumPy's tuples) is refused
with the line naming `moetrain convert-checkpoint --trust`, which rewrites it: the converted one
loads with the same tensors, and its random states draw the same numbers as the originals.

CIFAR-10's batches are pickles too: one planted the same way is refused whether its checksums are
checked or not, while batches of every pickle protocol read back as they were written.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from moetrain import cli
from moetrain.config import SettingError
from moetrain.data import images
from moetrain.parallel import checkpoint as shards
from moetrain.parallel import sharded_checkpoint as sharded
from moetrain.parallel.processes import _named_optimizer_state
from moetrain.run import RunError, load_run
from moetrain.train import checkpoint
from moetrain.train.checkpoint import UnsafeCheckpointError

TINY_LM = ["+recipe=qwen3_moe_lm", "data.seq_len=16", "data.batch_size=4", "data.eval_batch_size=4",
           "data.train_size=32", "data.eval_size=8", "trainer.max_steps=2", "trainer.checkpoint_every=2",
           "trainer.eval_every=0", "trainer.progress_bar=false", "logger=none"]
STEP = "step_00000002"


class Payload:
    """What an attacker pickles: loading it in full runs `touch MARKER`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def in_process(argv: list[str], monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["moetrain", *argv])
    cli.main()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("trust") / "run"
    with pytest.MonkeyPatch.context() as patch:
        in_process([*TINY_LM, f"hydra.run.dir={run_dir}", "hydra/job_logging=none", "hydra/hydra_logging=none"],
                   patch)
    return run_dir


@pytest.fixture(scope="module")
def model(trained) -> torch.nn.Module:
    return load_run(trained).model


def _rewrite(path: Path, state) -> None:
    """torch.save `state` to a checkpoint file with its .sha256 rewritten to match."""
    torch.save(state, path)
    checkpoint.write_checksums(checkpoint.checksum_path(path), {path.name: checkpoint.sha256_of(path)})


def _old_rng(state: dict) -> dict:
    """A random state in the form an earlier moetrain saved (Python's and NumPy's own tuples)."""
    python, numpy = state["python"], state["numpy"]
    return {**state, "python": (python["version"], tuple(python["state"].tolist()), python["gauss_next"]),
            "numpy": (numpy["kind"], numpy["key"].numpy().astype(np.uint32), numpy["position"], numpy["has_gauss"],
                      numpy["cached_gaussian"])}


def _dcp_checkpoint(state: dict, directory: Path, model: torch.nn.Module, trainer=None, rng=None) -> None:
    """The trainer's state as a sharded (DCP) checkpoint as moetrain.parallel.processes writes it (one
    process here), with its SHA256SUMS; `trainer` / `rng` replace those items' contents. `model`: the
    run's, which names the optimizer's parameters."""
    keys = ("step", "skipped_steps", "data", "config", "metrics")
    items = {"model": state["model"], "optimizer": _named_optimizer_state(state["optimizer"], model),
             "trainer": sharded.blob(trainer if trainer is not None else {key: state[key] for key in keys}),
             sharded.rng_key(0): sharded.blob(rng if rng is not None else state["rng"])}
    dcp.save(items, checkpoint_id=str(directory), no_dist=True)
    _rewrite_manifest(directory)


def _rewrite_manifest(directory: Path) -> None:
    files = sorted(directory.glob("*.distcp")) + [directory / sharded.METADATA]
    checkpoint.write_checksums(directory / checkpoint.MANIFEST, {p.name: checkpoint.sha256_of(p) for p in files})


def _saved(trained: Path) -> dict:
    return torch.load(trained / "checkpoints" / f"{STEP}.pt", weights_only=True)


def _planted(trained: Path, model: torch.nn.Module, tmp_path: Path, where: str) -> Path:
    """A copy of the run whose only checkpoint carries the payload in `where`."""
    run_dir = tmp_path / "planted"
    shutil.copytree(trained, run_dir)
    folder, marker = run_dir / "checkpoints", tmp_path / "MARKER"
    file = folder / f"{STEP}.pt"
    state = torch.load(file, weights_only=True)
    if where == "file":
        _rewrite(file, {**state, "metrics": {"eval/loss": Payload(marker)}})
        return run_dir
    file.unlink()
    checkpoint.checksum_path(file).unlink()
    step_dir = folder / STEP
    if where == "rank file":
        step_dir.mkdir()
        name = "rank00000-of-00001.pt"
        torch.save({**state, "rng": Payload(marker)}, step_dir / name)
        checkpoint.write_checksums(step_dir / checkpoint.MANIFEST, {name: checkpoint.sha256_of(step_dir / name)})
    elif where == "dcp item":
        keys = ("step", "skipped_steps", "data", "config")
        _dcp_checkpoint(state, step_dir, model, trainer={**{key: state[key] for key in keys}, "metrics": Payload(marker)})
    elif where == "dcp metadata":
        _dcp_checkpoint(state, step_dir, model)
        (step_dir / sharded.METADATA).write_bytes(pickle.dumps(Payload(marker)))
        _rewrite_manifest(step_dir)
    return run_dir


PLACES = ["file", "rank file", "dcp item", "dcp metadata"]


def test_the_payload_runs_when_loaded_in_full(tmp_path):
    """The control: the payload is live, so its marker's absence below means it was not run."""
    buffer = io.BytesIO()
    torch.save({"metrics": Payload(tmp_path / "MARKER")}, buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=False)
    assert (tmp_path / "MARKER").exists()


@pytest.mark.parametrize("where", PLACES)
def test_load_run_refuses_a_planted_checkpoint(trained, model, tmp_path, where):
    run_dir = _planted(trained, model, tmp_path, where)
    with pytest.raises(RunError, match="convert-checkpoint --trust") as refused:
        load_run(run_dir)
    assert "os.system" in str(refused.value) or "posix.system" in str(refused.value)
    assert not (tmp_path / "MARKER").exists()


COMMANDS = {
    "eval": lambda run: ["eval", str(run)],
    "generate": lambda run: ["generate", str(run), "--prompt", "1 2 3", "--max-tokens", "2"],
    "export": lambda run: ["export", str(run), str(run.parent / "exported")],
    "resume": lambda run: [*TINY_LM, "trainer.max_steps=3", f"trainer.resume={run}",
                           f"hydra.run.dir={run.parent / 'resumed'}", "hydra/job_logging=none",
                           "hydra/hydra_logging=none"],
}


# generate and export read checkpoints through load_run, as eval does: eval alone covers the rarer places
CASES = [(command, where) for command in COMMANDS for where in PLACES
         if command in ("eval", "resume") or where in ("file", "dcp item")]


@pytest.mark.parametrize("command, where", CASES)
def test_every_command_refuses_a_planted_checkpoint(trained, model, tmp_path, monkeypatch, capsys, command, where):
    run_dir = _planted(trained, model, tmp_path, where)
    with pytest.raises(SystemExit) as exit_info:
        in_process(COMMANDS[command](run_dir), monkeypatch)
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("moetrain: error: ") and "system" in line and "convert-checkpoint --trust" in line, line
    assert not (tmp_path / "MARKER").exists()
    assert not (tmp_path / "exported").exists()


def test_the_saved_random_states_are_data_and_restore_exactly():
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    random.gauss(0, 1), np.random.normal()  # a cached Gaussian each: part of the state too
    buffer = io.BytesIO()
    torch.save(checkpoint.rng_state(), buffer)
    expected = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.normal(), torch.rand(3))
    buffer.seek(0)
    checkpoint.set_rng_state(torch.load(buffer, weights_only=True))
    drawn = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.normal(), torch.rand(3))
    assert drawn[:4] == expected[:4] and torch.equal(drawn[4], expected[4])


def _draws(state: dict) -> tuple:
    checkpoint.set_rng_state(state)
    return random.random(), np.random.rand(4).tolist(), torch.rand(2).tolist()


def test_an_old_checkpoint_is_refused_then_converted_on_trust(trained, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "old"
    shutil.copytree(trained, run_dir)
    file = run_dir / "checkpoints" / f"{STEP}.pt"
    state = torch.load(file, weights_only=True)
    old_rng = _old_rng(state["rng"])
    _rewrite(file, {**state, "rng": old_rng})
    with pytest.raises(RunError, match=f"numpy.*convert-checkpoint --trust {run_dir}"):
        load_run(run_dir)
    with pytest.raises(SystemExit) as exit_info:  # without --trust: nothing is loaded, nothing written
        in_process(["convert-checkpoint", str(run_dir)], monkeypatch)
    assert exit_info.value.code == 2 and "add --trust" in capsys.readouterr().err
    in_process(["convert-checkpoint", "--trust", str(run_dir)], monkeypatch)
    assert f"{file}: converted to data only" in capsys.readouterr().out
    converted = checkpoint.load(file)  # its checksum was rewritten with it
    for key, value in state["model"].items():
        assert torch.equal(converted["model"][key], value)
    assert converted["step"] == state["step"] and converted["data"] == state["data"]
    assert converted["config"] == state["config"] and converted["metrics"] == state["metrics"]
    random.setstate(old_rng["python"])
    np.random.set_state(old_rng["numpy"])
    torch.set_rng_state(old_rng["torch"])
    expected = random.random(), np.random.rand(4).tolist(), torch.rand(2).tolist()
    assert _draws(converted["rng"]) == expected
    assert load_run(run_dir).step == 2
    in_process(["convert-checkpoint", "--trust", str(run_dir)], monkeypatch)  # a second time: nothing to do
    assert "data only already" in capsys.readouterr().out


def test_an_old_sharded_checkpoint_is_converted_on_trust(trained, model, tmp_path, monkeypatch, capsys):
    state = _saved(trained)
    run_dir = tmp_path / "old"
    (run_dir / "checkpoints").mkdir(parents=True)
    step_dir = run_dir / "checkpoints" / STEP
    _dcp_checkpoint(state, step_dir, model, rng=_old_rng(state["rng"]))
    assert load_run(run_dir).step == 2  # what load_run reads (weights, the trainer item) is data: it loads
    with pytest.raises(UnsafeCheckpointError, match="convert-checkpoint --trust"):  # resuming reads the rng item
        sharded.load({"model": {}, sharded.rng_key(0): sharded.blob(None)}, step_dir, distributed=False)
    in_process(["convert-checkpoint", "--trust", str(step_dir)], monkeypatch)
    assert "converted to data only" in capsys.readouterr().out
    sharded.verify(step_dir)  # a new SHA256SUMS
    loaded = sharded.load({"model": {key: torch.zeros_like(value) for key, value in state["model"].items()},
                           "trainer": sharded.blob(None), sharded.rng_key(0): sharded.blob(None)}, step_dir,
                          distributed=False)
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value)
    assert loaded["trainer"]["config"] == state["config"]
    assert _draws(loaded[sharded.rng_key(0)]) == _draws(state["rng"])
    assert not list(step_dir.parent.glob("*.converting")) and not list(step_dir.parent.glob("*.replaced"))


def test_an_old_per_rank_checkpoint_is_converted_on_trust(trained, tmp_path, monkeypatch, capsys):
    state = _saved(trained)
    step_dir = tmp_path / "old" / "checkpoints" / STEP
    step_dir.mkdir(parents=True)
    names = [f"rank{rank:05d}-of-00002.pt" for rank in range(2)]
    for rank, name in enumerate(names):
        old_rng = _old_rng(checkpoint.rng_state() if rank else state["rng"])
        torch.save({**state, "rng": old_rng, "moe_parallel": {"world_size": 2, "rank": rank}}, step_dir / name)
    checkpoint.write_checksums(step_dir / checkpoint.MANIFEST, {n: checkpoint.sha256_of(step_dir / n) for n in names})
    with pytest.raises(UnsafeCheckpointError, match="numpy"):
        shards.load_shards(str(step_dir))
    in_process(["convert-checkpoint", "--trust", str(tmp_path / "old")], monkeypatch)
    assert f"{step_dir}: converted to data only" in capsys.readouterr().out
    loaded = shards.load_shards(str(step_dir))  # every file against the new SHA256SUMS
    assert [shard["moe_parallel"]["rank"] for shard in loaded] == [0, 1]
    for key, value in state["model"].items():
        assert torch.equal(loaded[1]["model"][key], value)
    assert _draws(loaded[0]["rng"]) == _draws(state["rng"])
    assert sorted(path.name for path in step_dir.parent.iterdir()) == [STEP]


def test_a_planted_checkpoint_is_not_converted_without_running_it_first(trained, model, tmp_path, monkeypatch, capsys):
    """--trust is the user's word: without it nothing is loaded, so the payload stays inert."""
    run_dir = _planted(trained, model, tmp_path, "file")
    with pytest.raises(SystemExit):
        in_process(["convert-checkpoint", str(run_dir)], monkeypatch)
    assert not (tmp_path / "MARKER").exists()


# ---- CIFAR-10's pickled batches ----------------------------------------------------------------


def _fabricated_batch(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"batch_label": "fabricated", "labels": rng.integers(0, 10, 4).tolist(),
            "data": rng.integers(0, 256, (4, 3 * 32 * 32), dtype=np.uint8), "filenames": ["a.png"] * 4}


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar_batches_of_every_pickle_protocol_read_back(tmp_path, protocol):
    """What real batches (protocol 2, written by Python 2) and re-pickled ones hold reads back as it was."""
    batch = _fabricated_batch(protocol)
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps(batch, protocol=protocol))
    read = images._read_batch(str(path))
    assert read.keys() == batch.keys() and read["labels"] == batch["labels"]
    assert read["data"].dtype == np.uint8 and np.array_equal(read["data"], batch["data"])


def _planted_cifar(cifar10_root: Path, tmp_path: Path) -> tuple[Path, Path]:
    root, marker = tmp_path / "cifar", tmp_path / "MARKER"
    shutil.copytree(cifar10_root, root)
    path = root / "cifar-10-batches-py" / "data_batch_4"
    batch = pickle.loads(path.read_bytes())
    batch["filenames"] = Payload(marker)
    path.write_bytes(pickle.dumps(batch))
    return root, marker


def test_a_planted_cifar_batch_is_refused_checked_or_not(cifar10_root, tmp_path):
    root, marker = _planted_cifar(cifar10_root, tmp_path)
    with pytest.raises(SettingError, match="data_batch_4 is not a pickled CIFAR-10 batch .*system, which a CIFAR-10"):
        images.cifar10(str(root), download=False, verify_checksums=False)
    with pytest.raises(SettingError, match="fails its checksums"):  # the published MD5s: refused before reading
        images.cifar10(str(root), download=False, verify_checksums=True)
    assert not marker.exists()
    pickle.loads((root / "cifar-10-batches-py" / "data_batch_4").read_bytes())  # the control: it is live
    assert marker.exists()
