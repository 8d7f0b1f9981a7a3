"""Checkpoints that cannot be trusted: flipped bytes, truncated or empty files, steps whose save never
finished (in one process, and on two Gloo ranks where one rank's file is bad or only .tmp files
exist), the offline conversion of such steps, and SIGTERM reaching one rank of two. Each resumed
run is compared bit for bit with a run that was never interrupted."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from test_resume import TINY, assert_same_weights, expect_exit_2, run_in_process, tiny_trainer
from torch.distributed.checkpoint.api import CheckpointException

from moetrain.config import ParallelConfig
from moetrain.parallel import checkpoint as shards
from moetrain.parallel import sharded_checkpoint, spawn
from moetrain.train import checkpoint
from moetrain.train.checkpoint import CheckpointError
from moetrain.train.trainer import Terminated


def flip_bytes(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


DAMAGE = {
    "64 bytes flipped": flip_bytes,
    "truncated": lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]),
    "empty": lambda path: path.write_bytes(b""),
    "checksum file garbled": lambda path: checkpoint.checksum_path(path).write_text("not a checksum\n"),
}


# ---- one process ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    reference = tiny_trainer(tmp_path_factory.mktemp("reference"))
    reference.fit()
    return reference.model.state_dict()


def killed_at_step_7(run_dir: Path) -> None:
    """A run of 8 steps (checkpoints at 2, 4, 6) that dies during step 7."""
    trainer = tiny_trainer(run_dir)
    step = trainer._train_step

    def dies():
        if trainer.step == 7:
            raise KeyboardInterrupt
        return step()

    trainer._train_step = dies
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_latest_checkpoint_is_skipped_for_the_previous_one(damage, uninterrupted, tmp_path, caplog):
    killed_at_step_7(tmp_path)
    latest = tmp_path / "checkpoints" / "step_00000006.pt"
    DAMAGE[damage](latest)
    resumed = tiny_trainer(tmp_path, seed=1, resume="auto")
    with caplog.at_level(logging.INFO, logger="moetrain.train.trainer"):
        assert resumed.fit()["step"] == 8
    skipped = [r for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].levelno == logging.WARNING
    assert "step_00000006.pt" in skipped[0].getMessage()
    expected = "not a sha256sum listing" if damage == "checksum file garbled" else "is corrupted"
    assert expected in skipped[0].getMessage()
    assert any(f"resumed from {tmp_path / 'checkpoints' / 'step_00000004.pt'} at step 4" == r.getMessage()
               for r in caplog.records)
    assert_same_weights(resumed.model.state_dict(), uninterrupted)


def test_the_checksum_is_sha256_of_the_file_and_detects_each_damage(tmp_path):
    state = {"weights": torch.randn(300, generator=torch.Generator().manual_seed(3)), "step": 4}
    path = checkpoint.save(state, tmp_path, 4, keep=0)
    recorded = checkpoint.checksum_path(path).read_text()
    assert recorded == f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n"  # sha256sum's format
    assert torch.equal(checkpoint.load(path)["weights"], state["weights"])
    for damage in ("64 bytes flipped", "truncated", "empty"):
        checkpoint.save(state, tmp_path, 4, keep=0)
        DAMAGE[damage](path)
        with pytest.raises(CheckpointError, match="is corrupted"):
            checkpoint.load(path)


def test_no_intact_checkpoint_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    run_in_process([*TINY, "hydra.run.dir=run"], monkeypatch, tmp_path)
    folder = tmp_path / "run" / "checkpoints"
    for path in checkpoint.checkpoints(folder):
        flip_bytes(path)
    (tmp_path / "run" / "metrics.json").unlink()
    line = expect_exit_2([*TINY, "hydra.run.dir=run", "trainer.resume=auto", "trainer.max_steps=5"], monkeypatch,
                         capsys, tmp_path)
    assert "no intact checkpoint in" in line
    assert "step_00000003.pt, step_00000002.pt are incomplete or corrupted" in line


def test_a_file_without_checksum_is_refused_with_the_fix(tmp_path, monkeypatch, capsys):
    run_in_process([*TINY, "hydra.run.dir=run"], monkeypatch, tmp_path)
    file = tmp_path / "run" / "checkpoints" / "step_00000003.pt"
    copy = tmp_path / "copied.pt"
    shutil.copy(file, copy)  # a copy without its checksum file
    line = expect_exit_2([*TINY, "hydra.run.dir=new", "trainer.resume=copied.pt", "trainer.max_steps=4"],
                         monkeypatch, capsys, tmp_path)
    assert "has no checksum file copied.pt.sha256" in line and "sha256sum copied.pt > copied.pt.sha256" in line
    copy.with_name("copied.pt.sha256").write_text(f"{hashlib.sha256(copy.read_bytes()).hexdigest()}  copied.pt\n")
    run_in_process([*TINY, "hydra.run.dir=new", "trainer.resume=copied.pt", "trainer.max_steps=4"], monkeypatch,
                   tmp_path)


# ---- two Gloo ranks -------------------------------------------------------------------------------
def _break_into(reference: Path, run_dir: Path, how: dict) -> None:
    """A copy of the reference run's checkpoints, damaged: {step: "tmp only" | "rank 1 flipped" | ...}."""
    shutil.copytree(reference / "checkpoints", run_dir / "checkpoints")
    for step, damage in how.items():
        folder = run_dir / "checkpoints" / f"step_{step:08d}"
        if damage == "tmp only":  # both ranks killed while writing: no file renamed, no SHA256SUMS
            for path in folder.glob("rank*.pt"):
                path.rename(path.with_name(path.name + ".tmp"))
                DAMAGE["truncated"](path.with_name(path.name + ".tmp"))
            (folder / checkpoint.MANIFEST).unlink()
        elif damage == "rank 1 flipped":
            flip_bytes(folder / "rank00001-of-00002.pt")
        elif damage == "no manifest":  # every rank's file written, rank 0 killed before SHA256SUMS
            (folder / checkpoint.MANIFEST).unlink()


def dist_worker(rank: int, world_size: int, out_dir: str) -> None:
    from moetrain.parallel.processes import Distributed

    out = Path(out_dir)
    logging.getLogger().addHandler(logging.FileHandler(out / f"log{rank}.txt"))
    logging.getLogger().setLevel(logging.INFO)

    def trainer(run_dir: Path, **settings):
        processes = Distributed(ParallelConfig(nproc_per_node=world_size, strategy="expert"))
        return tiny_trainer(run_dir, processes=processes, **{"max_steps": 6, **settings})

    results = {}
    trainer(out / "reference").fit()  # checkpoints at 2, 4, 6

    # SIGTERM reaches rank 1 only, during step 3: both ranks stop after step 3, with its checkpoint.
    stopped = trainer(out / "sigterm")
    step = stopped._train_step

    def sigterm_on_rank_1():
        if stopped.step == 3 and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return step()

    stopped._train_step = sigterm_on_rank_1
    try:
        stopped.fit()
    except Terminated as error:
        results["stopped at"] = stopped.step
        results["exit code"] = error.exit_code
    trainer(out / "sigterm", resume="auto").fit()

    # Killed while saving step 6 (only .tmp files) and a corrupted rank-1 file at step 4:
    # both skipped on every rank, the run continues from step 2.
    if rank == 0:
        _break_into(out / "reference", out / "broken", {6: "tmp only", 4: "rank 1 flipped"})
    torch.distributed.barrier()
    logging.getLogger().info("=== broken ===")
    trainer(out / "broken", resume="auto").fit()
    logging.getLogger().info("=== end ===")

    # Nothing intact: the same one-line error on every rank.
    if rank == 0:
        _break_into(out / "reference", out / "hopeless", {6: "tmp only", 4: "rank 1 flipped", 2: "no manifest"})
    torch.distributed.barrier()
    try:
        trainer(out / "hopeless", resume="auto").fit()
    except CheckpointError as error:
        results["hopeless"] = str(error)
    torch.save(results, out / f"results{rank}.pt")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("two_ranks")
    spawn(dist_worker, 2, args=(str(out),), backend="gloo")
    return out, [torch.load(out / f"results{rank}.pt", weights_only=False) for rank in range(2)]


def final_shards(run_dir: Path) -> list[dict]:
    return shards.load_shards(str(run_dir / "checkpoints" / "step_00000006"))


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step(two_ranks):
    out, results = two_ranks
    assert [r["stopped at"] for r in results] == [3, 3] and results[0]["exit code"] == 143
    log = (out / "log0.txt").read_text()
    assert "SIGTERM: stopped after step 3" in log and "resumed from" in log
    for resumed, reference in zip(final_shards(out / "sigterm"), final_shards(out / "reference")):
        assert_same_weights(resumed["model"], reference["model"])


def test_incomplete_and_corrupted_rank_checkpoints_are_skipped_on_every_rank(two_ranks):
    out, results = two_ranks
    log = (out / "log0.txt").read_text()
    assert f"resumed from {out / 'broken' / 'checkpoints' / 'step_00000002'} at step 2" in log
    scenario = log[log.index("=== broken ===") : log.index("=== end ===")]
    broken = [line for line in scenario.splitlines() if "skipping" in line]
    assert len(broken) == 2, broken
    assert "step_00000006: " in broken[0] and "is incomplete" in broken[0] and ".pt.tmp" in broken[0]
    assert "step_00000004: the file of rank 1 failed its check" in broken[1]  # rank 0's own file is intact
    assert "skipping" not in (out / "log1.txt").read_text()  # one line, from rank 0 only
    for resumed, reference in zip(final_shards(out / "broken"), final_shards(out / "reference")):
        assert_same_weights(resumed["model"], reference["model"])
        assert resumed["step"] == 6
    messages = [r["hopeless"] for r in results]
    assert messages[0] == messages[1]  # every rank raises the same error, none hangs
    assert "step_00000006, step_00000004, step_00000002 are incomplete or corrupted" in messages[0]


def test_conversion_refuses_or_skips_incomplete_steps(two_ranks, tmp_path, capsys):
    out, _ = two_ranks
    _break_into(out / "reference", tmp_path / "run", {6: "tmp only"})
    with pytest.raises(SystemExit) as exit_info:
        shards.main([str(tmp_path / "run" / "checkpoints" / "step_00000006"), str(tmp_path / "one"),
                     "--world-size", "1"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "is incomplete" in error and "rank00000-of-00002.pt.tmp" in error
    assert not (tmp_path / "one").exists()

    shards.main([str(tmp_path / "run"), str(tmp_path / "one"), "--world-size", "1"])  # a run directory: newest complete
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"skipping {tmp_path / 'run' / 'checkpoints' / 'step_00000006'}: incomplete "
                                         f"(no SHA256SUMS: the run stopped while saving it)"]
    assert "step_00000004" in captured.out
    (converted,) = shards.load_shards(str(tmp_path / "one"))  # written with its own SHA256SUMS
    expected = shards.consolidate(shards.load_shards(str(out / "reference" / "checkpoints" / "step_00000004")))
    assert_same_weights(converted["model"], expected["model"])


def test_pruning_keeps_the_newest_complete_checkpoints_and_clears_leftovers(tmp_path):
    folder = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        checkpoint.save({"step": step}, tmp_path, step, keep=0)
    (folder / "step_00000004.pt").write_bytes(b"renamed, checksum never written")
    (folder / "step_00000005.pt.tmp").write_bytes(b"half")
    (folder / "step_00000006").mkdir()
    (folder / "step_00000006" / "rank00000-of-00002.pt.tmp").write_bytes(b"half")
    (folder / "step_00000007.pt.sha256").write_text("0" * 64 + "  step_00000007.pt\n")  # its file is gone
    checkpoint.prune(folder, keep=2)
    assert sorted(p.name for p in folder.iterdir()) == [
        "step_00000002.pt", "step_00000002.pt.sha256", "step_00000003.pt", "step_00000003.pt.sha256"]
    checkpoint.prune(folder, keep=0)  # 0 keeps every complete checkpoint
    assert len(list(folder.iterdir())) == 4


@pytest.mark.parametrize("fails_after", [0, 3000, 200_000])
def test_a_disk_that_fills_while_saving_gives_the_one_line_error(tmp_path, monkeypatch, fails_after):
    """The disk fills part of the way through the file (as a 6.8 GB checkpoint met on a GPU machine):
    torch.save's zip writer then fails again closing the file and raises a RuntimeError of its own;
    the save still ends in CheckpointError naming ENOSPC, leaves no .tmp, and the older checkpoint
    and its checksum stand."""
    import errno

    state = {"step": 1, "weights": torch.randn(64, 1024)}  # 256 KiB: fails_after lands inside it
    older = checkpoint.save({"step": 0}, tmp_path, 0, keep=0)
    real_write = checkpoint._HashingWriter.write
    written = [0]

    def filling_write(self, data):
        if written[0] + len(data) > fails_after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written[0] += len(data)
        return real_write(self, data)

    monkeypatch.setattr(checkpoint._HashingWriter, "write", filling_write)
    with pytest.raises(CheckpointError, match=r"step_00000001\.pt \(No space left on device\).*untouched"):
        checkpoint.save(state, tmp_path, 1, keep=0)
    folder = older.parent
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000000.pt", "step_00000000.pt.sha256"]
    assert torch.load(older, weights_only=True) == {"step": 0}


def full_disk_worker(rank: int, world_size: int, out: str) -> None:
    """Each rank's shard of step 4 is written to /dev/full (every write: ENOSPC), as on a full disk;
    the error each rank ends with is saved."""
    directory = Path(out) / "step_00000004"
    if rank == 0:
        directory.mkdir(parents=True)
        for r in range(world_size):
            (directory / f"__{r}_0.distcp").symlink_to("/dev/full")
    torch.distributed.barrier()
    state = {"model": {"w": torch.randn(256, 256)}, "step": 4}
    try:
        sharded_checkpoint.Saver().save(state, directory)
        outcome = "saved"
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - the test asserts which (DCP's is a BaseException)
        outcome = (type(error).__name__, str(error)[:2000])
    torch.save(outcome, Path(out) / f"full{rank}.pt")


def test_a_full_disk_under_sharded_checkpoints_gives_the_one_line_error(tmp_path):
    """DCP gathers each rank's write failure into a CheckpointException; the saver turns the disk's
    OSError behind it into the CheckpointError the command prints as one line, on every rank, and the
    step gets no manifest (so resuming skips it)."""
    spawn(full_disk_worker, 2, args=(str(tmp_path),), backend="gloo")
    for rank in range(2):
        kind, message = torch.load(tmp_path / f"full{rank}.pt", weights_only=False)
        assert kind == "CheckpointError", message
        assert "step_00000004" in message and "No space left on device" in message and "resume='auto'" in message
    assert not (tmp_path / "step_00000004" / checkpoint.MANIFEST).exists()
