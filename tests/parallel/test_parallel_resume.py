"""Resuming at another world size and in another layout, with no conversion step (Gloo, CPU, fp32).

A 4-rank fsdp_expert run writes sharded (DCP) checkpoints asynchronously at steps 1, 2 and 3, and a
4-rank expert run writes per-rank files at step 3. Runs on 2 ranks (fsdp, expert, fsdp_expert) and
on one process resume them and take steps 4 to 8: their losses, aux losses and gradient norms
continue the curve of one process that was never interrupted, step by step (<= 1e-5 relative), and
so do those of a run told to resume from a directory whose newest checkpoint is incomplete (no
SHA256SUMS) and the next one corrupted: it skips both and resumes at step 1. Mixed precision and CPU
offload train (bf16 losses near fp32's)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from test_parallel_fsdp import assert_close, record_steps, tiny_trainer

from moetrain.config import ParallelConfig
from moetrain.parallel import spawn
from moetrain.parallel.processes import Distributed
from moetrain.train import checkpoint

FIRST, TOTAL = 3, 8  # checkpoints of steps 1 to FIRST; the resumed runs go on to step TOTAL


def writer(rank: int, world_size: int, out_dir: str) -> None:
    out = Path(out_dir)
    for layout, settings in (("fsdp_expert", dict(checkpoint_every=1, async_checkpoint=True)), ("expert", {})):
        trainer = tiny_trainer(out / layout, world_size, Distributed(ParallelConfig(nproc_per_node=world_size,
                                                                                    strategy=layout)),
                               max_steps=FIRST, **settings)
        trainer.fit()


def resumer(rank: int, world_size: int, out_dir: str) -> None:
    out = Path(out_dir)
    sharded_run = out / "fsdp_expert" / "checkpoints"
    runs = {
        "fsdp from fsdp_expert": ("fsdp", sharded_run / "step_00000003"),
        "expert from fsdp_expert": ("expert", sharded_run / "step_00000003"),
        "fsdp_expert from per-rank expert": ("fsdp_expert", out / "expert" / "checkpoints" / "step_00000003"),
        "fsdp from damaged": ("fsdp", out / "damaged"),
    }
    results = {}
    for name, (layout, source) in runs.items():
        trainer = tiny_trainer(out / f"{world_size}-{name}", world_size,
                               Distributed(ParallelConfig(nproc_per_node=world_size, strategy=layout)),
                               max_steps=TOTAL, resume=str(source))
        steps = record_steps(trainer)
        trainer.fit()
        results[name] = steps
    for name, settings in (("mixed precision", dict(mixed_precision=True)), ("cpu offload", dict(cpu_offload=True))):
        trainer = tiny_trainer(out / f"{world_size}-{name}", world_size,
                               Distributed(ParallelConfig(nproc_per_node=world_size, strategy="fsdp_expert",
                                                          **settings)), max_steps=2)
        results[name] = record_steps(trainer)
        trainer.fit()
    torch.save(results, out / f"resumed{rank}.pt")


def _damage(run_dir: Path, into: Path) -> None:
    """A copy of the run's checkpoints: step 3 incomplete (no SHA256SUMS), one file of step 2 flipped."""
    shutil.copytree(run_dir / "checkpoints", into / "checkpoints")
    (into / "checkpoints" / "step_00000003" / checkpoint.MANIFEST).unlink()
    victim = sorted((into / "checkpoints" / "step_00000002").glob("*.distcp"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    reference = tiny_trainer(out / "reference", max_steps=TOTAL)
    uninterrupted = record_steps(reference)
    reference.fit()
    spawn(writer, 4, args=(str(out),), backend="gloo")
    _damage(out / "fsdp_expert", out / "damaged")
    spawn(resumer, 2, args=(str(out),), backend="gloo")
    resumed = [torch.load(out / f"resumed{rank}.pt") for rank in range(2)]
    single = {}
    for name, source in (("one process from fsdp_expert", out / "fsdp_expert"),
                         ("one process from per-rank expert", out / "expert")):
        trainer = tiny_trainer(out / name.replace(" ", "_"), max_steps=TOTAL, resume=str(source))
        single[name] = record_steps(trainer)
        trainer.fit()
    return out, uninterrupted, resumed, single


def assert_continues(steps, uninterrupted, first_step):
    """steps: a run resumed after first_step, which continues the uninterrupted run's curve."""
    assert_close(steps, uninterrupted[first_step:], first_step=first_step + 1)


def test_the_writers_left_complete_checkpoints(curves):
    out, *_ = curves
    sharded = out / "fsdp_expert" / "checkpoints"
    assert [entry.name for entry in checkpoint.checkpoints(sharded)] == [f"step_0000000{i}" for i in (1, 2, 3)]
    for entry in checkpoint.checkpoints(sharded):  # async saves all finished: each has its SHA256SUMS
        listed = checkpoint.read_checksums(entry / checkpoint.MANIFEST)
        assert ".metadata" in listed and sum(name.endswith(".distcp") for name in listed) >= 4
    per_rank = sorted(p.name for p in (out / "expert" / "checkpoints" / "step_00000003").iterdir())
    assert per_rank == ["SHA256SUMS"] + [f"rank0000{r}-of-00004.pt" for r in range(4)]


@pytest.mark.parametrize("name", ["fsdp from fsdp_expert", "expert from fsdp_expert",
                                  "fsdp_expert from per-rank expert"])
def test_two_ranks_continue_a_four_rank_run(curves, name):
    _, uninterrupted, resumed, _ = curves
    for rank_results in resumed:
        assert_continues(rank_results[name], uninterrupted, FIRST)


def test_damaged_newest_checkpoints_are_skipped(curves):
    _, uninterrupted, resumed, _ = curves
    for rank_results in resumed:
        assert_continues(rank_results["fsdp from damaged"], uninterrupted, 1)


@pytest.mark.parametrize("name", ["one process from fsdp_expert", "one process from per-rank expert"])
def test_one_process_continues_a_four_rank_run(curves, name):
    _, uninterrupted, _, single = curves
    assert_continues(single[name], uninterrupted, FIRST)


@pytest.mark.parametrize("name", ["mixed precision", "cpu offload"])
def test_mixed_precision_and_offload_train(curves, name):
    _, uninterrupted, resumed, _ = curves
    for rank_results in resumed:
        steps = rank_results[name]
        assert len(steps) == 2
        tolerance = 2e-2 if name == "mixed precision" else 1e-5  # bf16 compute against fp32
        for (loss, aux, norm), (want_loss, want_aux, _) in zip(steps, uninterrupted):
            assert abs(loss - want_loss) <= tolerance * want_loss and abs(aux - want_aux) <= tolerance * want_aux
