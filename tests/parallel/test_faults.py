"""Faults of multi-process runs on CPU (Gloo): a worker killed (SIGKILL) or frozen (SIGSTOP), the
launcher killed, SIGTERM sent to the launcher.

Each test starts a real launcher process (moetrain.parallel.launch.spawn, or the moetrain command),
does to it what a crash, a debugger or a job scheduler would, and checks how it ends, what it says,
and that no process outlives the bound (the collective timeout, plus a few seconds of grace).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import TINY_RUN, TINY_SYNTHETIC

from moetrain.parallel import launch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")

TESTS = Path(__file__).parent
# Seconds the machine may add to a bound: these tests share small, busy CPUs with the rest of the suite.
SLACK_S = 10.0


def worker(rank: int, world_size: int, out_dir: str) -> None:
    """Steps of one all-reduce each, for ever (moetrain's own workers are tested through the command,
    below)."""
    out = Path(out_dir)
    (out / f"pid{rank}").write_text(str(os.getpid()))
    flag = torch.zeros(1)
    dist.all_reduce(flag)
    (out / f"running{rank}").touch()  # past the first collective
    while True:
        dist.all_reduce(flag)
        time.sleep(0.01)


# The launcher: spawn() in its own process, which prints how the workers ended as one JSON line.
LAUNCHER = textwrap.dedent("""
    import json, sys
    from moetrain.parallel.launch import WorkerFailed, spawn
    import test_faults

    if __name__ == "__main__":
        outcome = {}
        try:
            spawn(test_faults.worker, 2, args=(sys.argv[1],), backend="gloo", timeout_s=float(sys.argv[2]))
            outcome["ended"] = "normally"
        except WorkerFailed as failure:
            outcome.update(ended="failed", rank=failure.failed.rank, stopped=failure.failed.stopped,
                           description=failure.failed.describe(), exitcodes=[w.exitcode for w in failure.exits])
        print(json.dumps(outcome))
""")


def alive(pid: int) -> bool:
    """Whether the process exists and has not ended (a zombie has ended: only its exit status is left)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_for(condition, seconds: float, what: str) -> float:
    """Poll until condition() holds; returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < seconds, f"{what}: not within {seconds} s"
        time.sleep(0.1)
    return time.monotonic() - started


def start_launcher(out: Path, timeout_s: float) -> tuple[subprocess.Popen, list[int]]:
    """The launcher and its two workers' pids, once both workers are past their first collective."""
    environment = {**os.environ,
                   "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(out), str(timeout_s)], env=environment,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: all((out / f"running{rank}").exists() for rank in range(2)) or launcher.poll() is not None,
                 120, "the workers did not start")
    except AssertionError:
        launcher.kill()
        raise
    assert launcher.poll() is None, launcher.communicate()
    return launcher, [int((out / f"pid{rank}").read_text()) for rank in range(2)]


def outcome(launcher: subprocess.Popen, seconds: float) -> dict:
    stdout, stderr = launcher.communicate(timeout=seconds)
    assert launcher.returncode == 0, stderr
    return json.loads(stdout.strip().splitlines()[-1])


def test_a_frozen_worker_is_named_once_the_collective_timeout_passes(tmp_path):
    timeout_s = 3.0
    launcher, pids = start_launcher(tmp_path, timeout_s=timeout_s)
    os.kill(pids[1], signal.SIGSTOP)
    frozen_at = time.monotonic()
    result = outcome(launcher, 60)
    took = time.monotonic() - frozen_at
    assert result["ended"] == "failed" and result["rank"] == 1 and result["stopped"], result
    assert result["description"] == f"worker rank 1 (pid {pids[1]}) stopped responding (it was frozen, as by SIGSTOP)"
    assert result["exitcodes"] == [1, -signal.SIGKILL]  # rank 0 timed out; the frozen one was killed
    assert not alive(pids[0]) and not alive(pids[1])
    assert timeout_s <= took < timeout_s + launch.SETTLE_S + SLACK_S, took


def test_killing_the_launcher_ends_its_workers(tmp_path):
    launcher, pids = start_launcher(tmp_path, timeout_s=120)
    launcher.kill()
    launcher.wait()
    wait_for(lambda: not any(alive(pid) for pid in pids), 5, "workers outlived their launcher")


def test_timeout_is_checked():
    for bad in (0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0"):
            launch.spawn(worker, 2, args=("unused",), backend="gloo", timeout_s=bad)


# ---- the moetrain command ------------------------------------------------------------------------
def worker_pids(launcher_pid: int) -> list[int]:
    """The launcher's spawned workers in rank order (started one after the other)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == launcher_pid and b"spawn_main" in command:
            pids.append(int(entry.name))
    return sorted(pids)


def test_a_killed_worker_ends_moetrain_with_one_line_naming_it_and_the_resume_command(tmp_path):
    run_dir = tmp_path / "run"
    command = [str(Path(sys.executable).parent / "moetrain"), "+recipe=quickstart", *TINY_RUN, *TINY_SYNTHETIC,
               "trainer.max_steps=100000", "logger=none", "parallel=data", "parallel.nproc_per_node=2",
               "parallel.timeout_s=120", f"hydra.run.dir={run_dir}"]
    launcher = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        log = run_dir / "moetrain.log"
        wait_for(lambda: (log.exists() and "parameters" in log.read_text()) or launcher.poll() is not None, 180,
                 "rank 0 did not build its model")
        pids = worker_pids(launcher.pid)
        assert launcher.poll() is None and len(pids) == 2, (pids, launcher.poll())
        time.sleep(1.0)  # into the training steps
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = launcher.communicate(timeout=60)
        took = time.monotonic() - killed_at
    finally:
        launcher.kill()
    # Rank 0 fails at its next collective and is stopped: no waiting for the 120 s timeout.
    assert took < launch.SETTLE_S + launch.KILL_GRACE_S + SLACK_S, took
    assert launcher.returncode == 1
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    (line,) = lines
    assert line.startswith(f"moetrain: error: worker rank 1 (pid {pids[1]}) was killed by SIGKILL (out of host "
                           "memory? the kernel's OOM killer sends it); "), line
    resume = line.split("continue from the last checkpoint with: ")[1]
    assert resume.startswith("moetrain +recipe=quickstart ") and resume.endswith(
        f"hydra.run.dir={run_dir} trainer.resume=auto"), resume
    assert not any(alive(pid) for pid in pids)


def test_sigterm_to_moetrain_saves_a_checkpoint_on_every_rank_and_says_how_to_continue(tmp_path):
    run_dir = tmp_path / "run"
    command = [str(Path(sys.executable).parent / "moetrain"), "+recipe=quickstart", *TINY_RUN, *TINY_SYNTHETIC,
               "trainer.max_steps=100000", "trainer.eval_every=5", "logger=none", "parallel=data",
               "parallel.nproc_per_node=2", f"hydra.run.dir={run_dir}"]
    launcher = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        log = run_dir / "moetrain.log"
        wait_for(lambda: (log.exists() and "step 5: eval" in log.read_text()) or launcher.poll() is not None, 180,
                 "the workers did not train")
        pids = worker_pids(launcher.pid)
        assert launcher.poll() is None and len(pids) == 2, (pids, launcher.poll())
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM and "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moetrain: error: stopped by SIGTERM at step "), stderr
    step = int(lines[0].split("at step ")[1].split()[0])
    assert step >= 5 and f"hydra.run.dir={run_dir} trainer.resume=auto" in lines[0]
    saved = run_dir / "checkpoints" / f"step_{step:08d}"
    assert sorted(p.name for p in saved.iterdir()) == ["SHA256SUMS", "rank00000-of-00002.pt", "rank00001-of-00002.pt"]
    assert not any(alive(pid) for pid in pids)
