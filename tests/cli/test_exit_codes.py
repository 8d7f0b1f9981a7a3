"""The `moetrain` console script's exit codes, each from a real subprocess: a configuration mistake
exits 2, a training run that fails (a loss that turns NaN) exits 1, and Ctrl-C (SIGINT) exits 130
with the command that resumes the run. Each ends with one `moetrain: error:` line, no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import TINY_RUN, TINY_SYNTHETIC

MOETRAIN = str(Path(sys.executable).parent / "moetrain")
QUIET = ["+recipe=quickstart", *TINY_RUN, *TINY_SYNTHETIC, "logger=none"]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([MOETRAIN, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("moetrain: error:")]


def test_config_error_exits_2_and_starts_nothing(tmp_path):
    result = run(*QUIET, "trainer.max_steps=0", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == ["moetrain: error: trainer.max_steps must be >= 1, got 0"]
    assert not (tmp_path / "runs").exists()  # refused before a run directory was made


def test_failed_training_exits_1(tmp_path):
    # SGD with an absurd learning rate and no clipping: the weights overflow and the loss turns NaN.
    result = run(*QUIET, "trainer.max_steps=5", "optim.name=sgd", "optim.lr=1e30", "optim.warmup_steps=0",
                 "trainer.grad_clip=0", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    (line,) = error_lines(result.stderr)
    assert line.startswith("moetrain: error: non-finite loss at step ") and "trainer.on_nonfinite=skip" in line


def test_sigint_exits_130_with_the_resume_command(tmp_path):
    (tmp_path / "work").mkdir()
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        # A shell without job control starts background commands with SIGINT ignored, and children
        # inherit that: give the command Ctrl-C's default disposition, as a terminal would.
        process = subprocess.Popen([MOETRAIN, *QUIET, "trainer.max_steps=100000", "trainer.eval_every=0"],
                                   cwd=tmp_path / "work", stdout=out, stderr=err,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            # Wait until the run logs that its model is built (training starts next), then a little more.
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and process.poll() is None:
                logs = list((tmp_path / "work" / "runs").glob("*/moetrain.log"))
                if logs and "parameters" in logs[0].read_text():
                    break
                time.sleep(0.2)
            time.sleep(1.0)
            assert process.poll() is None, (tmp_path / "err.txt").read_text()
            os.kill(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    stderr = (tmp_path / "err.txt").read_text()
    assert process.returncode != -signal.SIGKILL, f"still running 60 s after SIGINT; stderr:\n{stderr[-3000:]}"
    assert process.returncode == 130, stderr
    (line,) = error_lines(stderr)
    (run_dir,) = (tmp_path / "work" / "runs").iterdir()
    assert line.startswith("moetrain: error: interrupted; continue from the last checkpoint with: moetrain ")
    assert line.endswith(f"hydra.run.dir={run_dir} trainer.resume=auto"), line
