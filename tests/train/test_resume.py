"""Resuming as a user does it: a changed schedule, a finished run, a second run in one directory,
SIGTERM, and processes killed (SIGKILL) while training and while saving, each resumed run checked
bit for bit against a run that was never interrupted."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import TINY_RUN, TINY_SYNTHETIC

from moetrain import cli
from moetrain.config import LoggerConfig, OptimConfig, TrainerConfig
from moetrain.data import synthetic
from moetrain.models import VisionMoE
from moetrain.train import Trainer, checkpoint, seed_everything
from moetrain.train.lock import RunDirectoryBusy, lock_run_directory, unlock_run_directory
from moetrain.train.trainer import Terminated


def tiny_trainer(run_dir: Path, optim: OptimConfig | None = None, seed: int = 0, processes=None,
                 **trainer_settings) -> Trainer:
    """A small MoE ViT on a synthetic 4-class task (6 batches of 8 per epoch), dropout and router jitter on."""
    settings = dict(max_steps=8, eval_every=0, eval_batches=1, checkpoint_every=2, keep_checkpoints=0,
                    progress_bar=False)
    settings.update(trainer_settings)
    optim = optim or OptimConfig(lr=3e-3, warmup_steps=2)
    seed_everything(seed)
    routing = {"gate": "top", "top_k": 2, "capacity_factor": 1.0, "balance_loss_weight": 0.01, "z_loss_weight": 0.001,
               "gate_kwargs": {"jitter_eps": 0.1}}
    model = VisionMoE(image_size=8, in_channels=3, patch_size=4, num_classes=4, dim=16, depth=2, num_heads=2,
                      num_experts=4, expert_hidden_size=16, moe_every=1, dropout=0.1, moe_kwargs=routing)
    data = synthetic(num_classes=4, image_size=8, train_size=48, eval_size=16, batch_size=8, eval_batch_size=8)
    config = {"model": {"name": "tiny"}, "optim": {"lr": optim.lr, "warmup_steps": optim.warmup_steps},
              "trainer": {"max_steps": settings["max_steps"]}}
    return Trainer(model, data, trainer=TrainerConfig(**settings), optim=optim,
                   logger=LoggerConfig(tensorboard=False, log_every=1), run_dir=run_dir, seed=0, run_config=config,
                   processes=processes)


def reference_lr(step: int, lr: float, warmup_steps: int, min_lr_ratio: float, max_steps: int) -> float:
    """The documented schedule, written out again: warm-up from lr/(w+1), then cosine to lr*ratio."""
    w = min(warmup_steps, max_steps - 1)
    if step < w:
        return lr * (step + 1) / (w + 1)
    if step >= max_steps:
        return lr * min_lr_ratio
    return lr * min_lr_ratio + (lr - lr * min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * (step - w) / (max_steps - w)))


def record_lrs(trainer: Trainer) -> list[float]:
    """The learning rate each optimizer step of `trainer` uses, in order."""
    used = []
    step = trainer._train_step

    def recording():
        used.append(trainer.optimizer.param_groups[0]["lr"])
        return step()

    trainer._train_step = recording
    return used


def assert_same_weights(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in actual.items():
        assert torch.equal(tensor, expected[name]), name


# ---- item 5: the schedule and the optimizer settings follow the current config ------------------
def test_extended_run_decays_to_the_new_max_steps_and_takes_the_new_lr(tmp_path, caplog):
    first = tiny_trainer(tmp_path, OptimConfig(lr=3e-3, warmup_steps=2), max_steps=4)
    first.fit()
    new = OptimConfig(lr=1e-3, warmup_steps=3, weight_decay=0.2, betas=[0.8, 0.9])
    resumed = tiny_trainer(tmp_path, new, max_steps=12, resume="auto")
    lrs = record_lrs(resumed)
    with caplog.at_level(logging.INFO, logger="moetrain.train.trainer"):
        resumed.fit()
    # Steps 5..12 use the schedule of lr=1e-3, 3 warm-up steps, 12 steps: never the old cycle.
    expected = [reference_lr(step, 1e-3, 3, 0.1, 12) for step in range(4, 12)]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=0)
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # past the warm-up: decaying to the end
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4, rel=1e-12)  # lr * min_lr_ratio at 12
    groups = resumed.optimizer.param_groups
    assert (groups[0]["weight_decay"], groups[1]["weight_decay"]) == (0.2, 0.0)
    assert tuple(groups[0]["betas"]) == (0.8, 0.9)
    assert resumed.optimizer.state  # the moments did come from the checkpoint
    lines = [r.getMessage() for r in caplog.records]
    assert "optim.lr: 0.003 (checkpoint) -> 0.001 (now)" in lines
    assert "optim.warmup_steps: 2 (checkpoint) -> 3 (now)" in lines
    assert "trainer.max_steps: 4 (checkpoint) -> 12 (now)" in lines
    assert not [line for line in lines if line.startswith("model.")]


def test_a_lower_lr_on_resume_is_the_one_the_update_uses(tmp_path):
    """The run that diverged at step 5 continues from step 4's checkpoint with the lr the user gave."""
    tiny_trainer(tmp_path, OptimConfig(lr=3e-3, warmup_steps=0, weight_decay=0.0), max_steps=4).fit()
    saved = checkpoint.load(tmp_path / "checkpoints" / "step_00000004.pt")["model"]
    resumed = tiny_trainer(tmp_path, OptimConfig(lr=1e-5, warmup_steps=0, weight_decay=0.0, min_lr_ratio=1.0),
                           max_steps=5, resume="auto")
    lrs = record_lrs(resumed)
    resumed.fit()
    assert lrs == [1e-5]
    # An AdamW step moves each weight by about lr at most: 1e-5 here, where 3e-3 would move ~1e-3.
    moved = max((tensor - saved[name]).abs().max().item() for name, tensor in resumed.model.state_dict().items()
                if tensor.is_floating_point())
    assert 0 < moved < 1e-4


def test_warmup_and_cosine_match_the_formula_for_odd_settings():
    from moetrain.train.optim import learning_rate

    generator = torch.Generator().manual_seed(5)
    for _ in range(20):
        max_steps = int(torch.randint(1, 40, (), generator=generator))
        cfg = OptimConfig(lr=float(torch.rand((), generator=generator)) + 1e-4,
                          warmup_steps=int(torch.randint(0, 50, (), generator=generator)),
                          min_lr_ratio=float(torch.rand((), generator=generator)))
        for step in range(max_steps + 5):
            expected = reference_lr(step, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio, max_steps)
            assert learning_rate(step, cfg, max_steps) == pytest.approx(expected, rel=1e-12), (cfg, max_steps, step)


# ---- item 8: a finished run, and a second run in the same directory -----------------------------
def run_in_process(argv: list[str], monkeypatch, cwd: Path) -> None:
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["moetrain", *argv, "hydra/job_logging=none", "hydra/hydra_logging=none"])
    cli.main()


def settings(*changes: str) -> list[str]:
    """The quickstart recipe on TINY_RUN's small model and data, with `changes` replacing its keys."""
    keys = {change.split("=")[0] for change in changes}
    return ["+recipe=quickstart", *[s for s in TINY_RUN if s.split("=")[0] not in keys], *TINY_SYNTHETIC,
            "logger=none", *changes]


TINY = settings("trainer.checkpoint_every=1")


def test_rerunning_a_finished_run_keeps_its_metrics_and_trains_nothing(tmp_path, monkeypatch, caplog):
    run_in_process([*TINY, "hydra.run.dir=run"], monkeypatch, tmp_path)
    metrics_file = tmp_path / "run" / "metrics.json"
    final = metrics_file.read_bytes()
    assert json.loads(final)["step"] == 3 and "eval/accuracy" in json.loads(final)
    files = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run" / "checkpoints").iterdir()}
    with caplog.at_level(logging.INFO):
        run_in_process([*TINY, "hydra.run.dir=run", "trainer.resume=auto"], monkeypatch, tmp_path)
    assert metrics_file.read_bytes() == final
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run" / "checkpoints").iterdir()} == files
    assert any("already complete at step 3" in r.getMessage() for r in caplog.records)

    # Resumed into a new directory, the finished checkpoint brings its final metrics along.
    run_in_process([*TINY, "hydra.run.dir=copy", "trainer.resume=run"], monkeypatch, tmp_path)
    assert json.loads((tmp_path / "copy" / "metrics.json").read_text()) == json.loads(final)


def expect_exit_2(argv, monkeypatch, capsys, cwd) -> str:
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(argv, monkeypatch, cwd)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("moetrain: error: "), lines
    return lines[0]


def test_a_checkpoint_past_max_steps_is_refused(tmp_path, monkeypatch, capsys):
    run_in_process([*TINY, "hydra.run.dir=run"], monkeypatch, tmp_path)
    line = expect_exit_2([*TINY, "hydra.run.dir=run", "trainer.resume=auto", "trainer.max_steps=2"], monkeypatch,
                         capsys, tmp_path)
    assert "at step 3, past trainer.max_steps=2" in line


HOLDER = textwrap.dedent("""
    import sys, time
    from moetrain.train.lock import lock_run_directory
    lock_run_directory(sys.argv[1])
    print("locked", flush=True)
    time.sleep(120)
""")


def hold_lock(run_dir: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_run_in_a_busy_run_directory_is_refused_and_writes_nothing(tmp_path, monkeypatch, capsys):
    holder = hold_lock(tmp_path / "run")
    try:
        line = expect_exit_2([*TINY, "hydra.run.dir=run"], monkeypatch, capsys, tmp_path)
        assert f"in use by another moetrain run (pid and host: {holder.pid} " in line and "hydra.run.dir" in line
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".moetrain.lock"]  # no .hydra, no log
    finally:
        holder.kill()  # SIGKILL: the lock file stays, the lock goes with the process
        holder.wait()
    run_in_process([*TINY, "hydra.run.dir=run"], monkeypatch, tmp_path)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["step"] == 3


def test_the_lock_is_per_directory_and_released(tmp_path):
    holder = hold_lock(tmp_path / "a")
    try:
        with pytest.raises(RunDirectoryBusy, match="in use by another moetrain run"):
            lock_run_directory(tmp_path / "a")
        lock_run_directory(tmp_path / "b")  # another directory is free
        lock_run_directory(tmp_path / "b")  # and taking it again in this process is no conflict
    finally:
        holder.kill()
        holder.wait()
    lock_run_directory(tmp_path / "a")  # the dead holder's lock file blocks nothing
    for name in ("a", "b"):
        unlock_run_directory(tmp_path / name)
    again = hold_lock(tmp_path / "b")  # released: another process takes it
    again.kill()
    again.wait()


# ---- SIGTERM in one process ---------------------------------------------------------------------
def test_sigterm_saves_a_checkpoint_after_the_step_and_resumes_exactly(tmp_path):
    reference = tiny_trainer(tmp_path / "reference")
    reference.fit()

    stopped = tiny_trainer(tmp_path / "run")
    step = stopped._train_step

    def sigterm_during_step_3():
        if stopped.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives in the middle of the step
        return step()

    stopped._train_step = sigterm_during_step_3
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated, match="at step 3") as stop:
        stopped.fit()
    assert stop.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is handler  # the handler is put back
    saved = [p.name for p in checkpoint.checkpoints(tmp_path / "run" / "checkpoints")]
    assert saved == ["step_00000002.pt", "step_00000003.pt"]  # step 3's, although checkpoint_every=2
    assert not (tmp_path / "run" / "metrics.json").exists()

    resumed = tiny_trainer(tmp_path / "run", seed=1, resume="auto")
    assert resumed.fit()["step"] == 8
    assert_same_weights(resumed.model.state_dict(), reference.model.state_dict())


def test_ctrl_c_still_stops_at_once_and_restores_the_handler(tmp_path):
    trainer = tiny_trainer(tmp_path)
    step = trainer._train_step

    def ctrl_c():
        if trainer.step == 2:
            raise KeyboardInterrupt
        return step()

    trainer._train_step = ctrl_c
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert signal.getsignal(signal.SIGTERM) is handler
    assert not (tmp_path / "checkpoints").exists()  # Ctrl-C saves nothing new (unchanged behaviour)


# ---- kills survived: the real command, SIGTERM and SIGKILL at chosen points ---------------------
# Runs `moetrain ARGS` in a fresh process after arranging for it to receive a signal at one point:
#   step N         SIGTERM (sigterm) or SIGKILL (kill) to itself while step N trains
#   save-data N    SIGKILL halfway through writing step N's checkpoint bytes
#   save-checksum N SIGKILL after step N's checkpoint is renamed into place, before its checksum is written
KILLER = textwrap.dedent("""
    import os, signal, sys
    from moetrain import cli
    from moetrain.train import Trainer, checkpoint

    how, where, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    name = f"step_{step:08d}.pt"
    kill = lambda: os.kill(os.getpid(), signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    if where == "step":
        train_step = Trainer._train_step
        def dying_step(self):
            if self.step == step:
                kill()
            return train_step(self)
        Trainer._train_step = dying_step
    elif where == "save-data":
        write = checkpoint._HashingWriter.write
        def dying_write(self, data):
            if self.file.name.endswith(name + ".tmp") and self.file.tell() > 40000:
                self.file.flush()
                kill()
            return write(self, data)
        checkpoint._HashingWriter.write = dying_write
    elif where == "save-checksum":
        write_checksums = checkpoint.write_checksums
        def dying_checksums(path, digests):
            if name in digests:
                kill()
            return write_checksums(path, digests)
        checkpoint.write_checksums = dying_checksums
    sys.argv = ["moetrain", *sys.argv[4:]]
    cli.main()
""")
KILL_RUN = settings("trainer.max_steps=10", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=0",
                    "trainer.eval_every=0")


def moetrain(*args: str, cwd: Path, kill: tuple[str, str, int] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", KILLER, *map(str, kill)] if kill else [sys.executable, "-m", "moetrain"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command + list(args), cwd=cwd, capture_output=True, text=True, timeout=300, env=environment)


def final_weights(run_dir: Path) -> dict:
    return checkpoint.load(run_dir / "checkpoints" / "step_00000010.pt")["model"]


def test_killed_and_terminated_runs_resume_to_the_uninterrupted_weights(tmp_path):
    reference = moetrain(*KILL_RUN, "hydra.run.dir=reference", cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr
    run = [*KILL_RUN, "hydra.run.dir=run"]
    resume = [*run, "trainer.resume=auto"]
    folder = tmp_path / "run" / "checkpoints"

    # SIGTERM during step 3: step 3's checkpoint, exit 143, one line saying how to go on.
    stopped = moetrain(*run, cwd=tmp_path, kill=("sigterm", "step", 3))
    assert stopped.returncode == 143, stopped.stderr
    (line,) = stopped.stderr.splitlines()
    assert line.startswith("moetrain: error: stopped by SIGTERM at step 3") and "trainer.resume=auto" in line
    assert checkpoint.is_complete(folder / "step_00000003.pt")

    # SIGKILL while step 5 trains: nothing of step 5 on disk.
    killed = moetrain(*resume, cwd=tmp_path, kill=("kill", "step", 5))
    assert killed.returncode == -signal.SIGKILL
    assert [p.name for p in checkpoint.checkpoints(folder)][-1] == "step_00000004.pt"

    # SIGKILL halfway through writing step 6: a partial .tmp file and no step 6.
    killed = moetrain(*resume, cwd=tmp_path, kill=("kill", "save-data", 6))
    assert killed.returncode == -signal.SIGKILL
    assert (folder / "step_00000006.pt.tmp").stat().st_size > 40000 and not (folder / "step_00000006.pt").exists()

    # SIGKILL after step 8's bytes are in place, before their checksum: step 8 counts as incomplete.
    killed = moetrain(*resume, cwd=tmp_path, kill=("kill", "save-checksum", 8))
    assert killed.returncode == -signal.SIGKILL
    assert (folder / "step_00000008.pt").exists() and not checkpoint.is_complete(folder / "step_00000008.pt")

    finished = moetrain(*resume, cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr
    log = (tmp_path / "run" / "moetrain.log").read_text()
    assert log.count("skipping step_00000008.pt") == 1
    assert f"resumed from {folder / 'step_00000006.pt'} at step 6" in log
    assert_same_weights(final_weights(tmp_path / "run"), final_weights(tmp_path / "reference"))
    assert not list(folder.glob("*.tmp"))  # the later saves cleared the leftovers
    reference_metrics = json.loads((tmp_path / "reference" / "metrics.json").read_text())
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["step"] == 10 and metrics["eval/loss"] == reference_metrics["eval/loss"]


def test_a_killed_run_on_token_shards_resumes_at_the_exact_token_position(tmp_path):
    """data=text on memory-mapped shards (document mask on): killed while step 3 trains, resumed from
    step 2's checkpoint, it ends with the uninterrupted run's weights (the stream continues at the
    very next window of tokens)."""
    pytest.importorskip("tokenizers")
    from tiny_tokenizers import train_tokenizer, write_text_corpus

    from moetrain.data.shards import tokenize_corpus

    write_text_corpus(tmp_path / "corpus")
    tokenize_corpus(tmp_path / "corpus", tmp_path / "shards", train_tokenizer(tmp_path / "tok"), progress=False)
    run = ["+recipe=qwen3_moe_lm", "data=text", f"data.path={tmp_path / 'shards'}", "data.document_mask=true",
           "data.seq_len=16", "data.batch_size=4", "data.eval_batch_size=4", "trainer.max_steps=4",
           "trainer.checkpoint_every=2", "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.progress_bar=false",
           "logger=none"]
    assert moetrain(*run, "hydra.run.dir=reference", cwd=tmp_path).returncode == 0
    killed = moetrain(*run, "hydra.run.dir=run", cwd=tmp_path, kill=("kill", "step", 3))
    assert killed.returncode == -signal.SIGKILL
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "run" / "checkpoints")] == ["step_00000002.pt"]
    finished = moetrain(*run, "hydra.run.dir=run", "trainer.resume=auto", cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr
    last = {name: checkpoint.checkpoints(tmp_path / name / "checkpoints")[-1] for name in ("reference", "run")}
    assert last["run"].name == last["reference"].name == "step_00000004.pt"
    reference, resumed = checkpoint.load(last["reference"]), checkpoint.load(last["run"])
    assert resumed["data"] == reference["data"]
    assert_same_weights(resumed["model"], reference["model"])
