"""`moetrain parallel.nproc_per_node=2 ...`: two Gloo workers train like one process on the same data,
and one process resumes their per-rank checkpoint directly.

Two ranks with batch B see, together, the items one process sees with batch 2B (each rank takes every
other item of the epoch's order). With dropless routing and no balance loss (both depend on the
batch a layer sees), the runs compute the same function: losses must agree to fp32 precision.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from moetrain import load_run
from moetrain.evaluate import evaluate_run

TINY = [
    "+recipe=quickstart", "model.dim=16", "model.depth=2", "model.num_heads=2", "model.num_experts=4",
    "model.expert_hidden_size=32", "trainer.max_steps=3", "trainer.eval_every=0", "trainer.eval_batches=2",
    "trainer.checkpoint_every=0", "trainer.progress_bar=false", "logger.log_every=1", "data.eval_batch_size=8",
    "data.num_workers=0", "data.train_size=64", "data.eval_size=16", "gate.capacity_factor=0",
    "gate.balance_loss_weight=0", "optim.warmup_steps=0",
]


def moetrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moetrain", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_two_workers_match_one_process_and_checkpoint_per_rank(tmp_path):
    single = moetrain(*TINY, "data.batch_size=16", "hydra.run.dir=single", cwd=tmp_path)
    assert single.returncode == 0, single.stderr
    double = moetrain(*TINY, "data.batch_size=8", "parallel=expert", "parallel.nproc_per_node=2",
                      "parallel.a2a_ffn_overlap_degree=2", "hydra.run.dir=double", cwd=tmp_path)
    assert double.returncode == 0, double.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["double", "single"]  # one run directory

    one = json.loads((tmp_path / "single" / "metrics.json").read_text())
    two = json.loads((tmp_path / "double" / "metrics.json").read_text())
    assert two["step"] == one["step"] == 3
    for key in ("train/loss", "train/grad_norm", "eval/loss", "eval/accuracy"):
        assert abs(two[key] - one[key]) <= 1e-4 * max(1.0, abs(one[key])), (key, one[key], two[key])
    assert two["train/samples_per_sec"] > 0

    # Only rank 0 logs; each rank wrote its own checkpoint file.
    log = (tmp_path / "double" / "moetrain.log").read_text()
    assert log.count("run directory") == 1 and "step 3: checkpoint" in log
    files = sorted(p.name for p in (tmp_path / "double" / "checkpoints" / "step_00000003").iterdir())
    assert files == ["SHA256SUMS", "rank00000-of-00002.pt", "rank00001-of-00002.pt"]  # SHA256SUMS: complete

    # A single process resumes the two ranks' files directly (merged in memory, no conversion step),
    # exactly as it resumes the converted checkpoint.
    direct = moetrain(*TINY, "data.batch_size=16", "trainer.max_steps=4", "hydra.run.dir=direct",
                      "trainer.resume=double", cwd=tmp_path)
    assert direct.returncode == 0, direct.stderr
    convert = subprocess.run([sys.executable, "-m", "moetrain.parallel.checkpoint", "double/checkpoints/step_00000003",
                              "converted", "--world-size", "1"], cwd=tmp_path, capture_output=True, text=True)
    assert convert.returncode == 0, convert.stderr
    resumed = moetrain(*TINY, "data.batch_size=16", "trainer.max_steps=4", "hydra.run.dir=resumed",
                       "trainer.resume=converted", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    by_conversion = json.loads((tmp_path / "resumed" / "metrics.json").read_text())
    directly = json.loads((tmp_path / "direct" / "metrics.json").read_text())
    assert by_conversion["step"] == directly["step"] == 4
    assert directly["train/loss"] == by_conversion["train/loss"] and directly["eval/loss"] == by_conversion["eval/loss"]


def test_fsdp_expert_with_checkpointing_and_global_balance_loss_matches_one_process(tmp_path):
    """parallel=fsdp_expert, full activation checkpointing, async sharded checkpoints and the global-batch
    balance loss (on: with it the ranks' mean loss is one process's) through the command; one process then
    resumes the sharded checkpoint directly. A combination FSDP refuses is one line, exit 2."""
    balance = [arg for arg in TINY if not arg.startswith("gate.balance_loss_weight")] + [
        "gate.balance_loss_weight=0.1", "gate.balance_loss=global_batch"]
    single = moetrain(*balance, "data.batch_size=16", "hydra.run.dir=single", cwd=tmp_path)
    assert single.returncode == 0, single.stderr
    sharded = moetrain(*balance, "data.batch_size=8", "parallel=fsdp_expert", "parallel.nproc_per_node=2",
                       "trainer.activation_checkpointing=full", "trainer.async_checkpoint=true", "hydra.run.dir=sharded",
                       cwd=tmp_path)
    assert sharded.returncode == 0, sharded.stderr
    one = json.loads((tmp_path / "single" / "metrics.json").read_text())
    two = json.loads((tmp_path / "sharded" / "metrics.json").read_text())
    for key in ("train/loss", "train/aux_loss", "train/grad_norm", "eval/loss"):
        assert abs(two[key] - one[key]) <= 1e-4 * max(1.0, abs(one[key])), (key, one[key], two[key])
    step = tmp_path / "sharded" / "checkpoints" / "step_00000003"
    listed = sorted(line.split()[1] for line in (step / "SHA256SUMS").read_text().splitlines())
    assert listed == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    # The sharded run loads in one process (load_run, hence moetrain eval|generate|export) with the
    # weights it evaluated with at its last step.
    run = load_run(tmp_path / "sharded")
    assert run.step == 3 and run.checkpoint == step
    metrics = evaluate_run(run, progress=False)
    assert abs(metrics["eval/loss"] - two["eval/loss"]) <= 1e-5 * max(1.0, abs(two["eval/loss"]))

    resumed = moetrain(*balance, "data.batch_size=16", "trainer.max_steps=4", "hydra.run.dir=resumed",
                       "trainer.resume=sharded", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((tmp_path / "resumed" / "metrics.json").read_text())["step"] == 4

    refused = moetrain(*balance, "parallel=fsdp", "parallel.nproc_per_node=2", "parallel.zero=true",
                       "hydra.run.dir=refused", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "zero applies to strategy=data|expert" in refused.stderr
