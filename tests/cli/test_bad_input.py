"""Bad input to the real `moetrain` command: each case must end with exit code 2 and ONE line on
stderr, `moetrain: error: ...`, naming what is wrong (the key or the file) and the fix, with no
traceback; and it must create nothing (no run directory) and lose nothing (older checkpoints).

Permissions are denied with chmod; as root (who ignores permissions) the command runs under
`setpriv` without the capabilities that bypass them.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from conftest import TINY_RUN, TINY_SYNTHETIC
from image_folders import write_class_folders

MOETRAIN = str(Path(sys.executable).parent / "moetrain")
QUICK = ["+recipe=quickstart", *TINY_RUN, *TINY_SYNTHETIC, "logger=none"]


def unprivileged() -> list[str] | None:
    """A command prefix under which chmod'ed permissions hold (empty unless running as root); None
    as root without setpriv, where permissions cannot be denied."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    return None if setpriv is None else [setpriv, "--bounding-set=-dac_override,-dac_read_search"]


def moetrain(args: list[str], cwd: Path, prefix: list[str] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, MOETRAIN, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@dataclass
class Sources:
    cifar10_root: Path
    mnist_root: Path
    finished_run: Path | None  # a finished 2-step run with its checkpoint at step 2 (when the case needs it)


@dataclass
class Case:
    """args(tmp) -> the command line; prepare(tmp, sources) sets the scene (sources: the fabricated
    data sets and a finished run to copy) and returns the working directory; every string of `says`
    must be in the one line; check(tmp) looks at what is left."""

    args: Callable[[Path], list[str]]
    says: list[str]
    prepare: Callable[[Path, Sources], Path] = lambda tmp, sources: tmp
    check: Callable[[Path], None] = lambda tmp: None
    unprivileged: bool = False
    needs_run: bool = False  # prepare copies the finished run
    no_run_directory: bool = True  # nothing under runs/ (the default place of run directories)
    forbidden: list[str] = field(default_factory=list)  # strings the line must not hold


# ---- scenes ----------------------------------------------------------------------------------------
def locked(folder: Path, mode: int = 0o555) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(mode)
    return folder


def token_file(tmp: Path, ids: np.ndarray) -> Path:
    np.save(tmp / "tokens.npy", ids)
    return tmp


def text_corpus(tmp: Path, sources: Sources) -> Path:
    """A directory of three documents; b.txt is Latin-1, not UTF-8, from its line 7 on."""
    corpus = tmp / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the first document\n" * 50)
    (corpus / "b.txt").write_bytes(b"plain line\n" * 6 + "caf\u00e9 in Latin-1\n".encode("latin-1") + b"more\n")
    (corpus / "c.txt").write_text("the last document\n" * 50)
    return tmp


BROKEN_JSON = '{"text": "abcd", "n": }'  # a value missing where "}" stands
BROKEN_COLUMN = BROKEN_JSON.index("}") + 1  # 1-based, as JSON parsers count columns


def jsonl_corpus(tmp: Path, sources: Sources) -> Path:
    """200 good lines, then one whose JSON breaks at BROKEN_COLUMN."""
    lines = [json.dumps({"text": f"document number {i}"}) for i in range(200)] + [BROKEN_JSON]
    (tmp / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return tmp


class MarkerPayload:
    """A pickled object whose unpickling runs `touch MARKER`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def planted_cifar(tmp: Path, sources: Sources) -> Path:
    """A copy of the fabricated CIFAR-10 whose data_batch_2 carries a payload among its labels."""
    shutil.copytree(sources.cifar10_root, tmp / "cifar")
    path = tmp / "cifar" / "cifar-10-batches-py" / "data_batch_2"
    batch = pickle.loads(path.read_bytes())
    batch["labels"][0] = MarkerPayload(tmp / "MARKER")
    path.write_bytes(pickle.dumps(batch))
    return tmp


def marker_absent(tmp: Path) -> None:
    assert not (tmp / "MARKER").exists()


def small_image_folder(tmp: Path, sources: Sources) -> Path:
    write_class_folders(tmp / "few", per_class=2)
    return tmp


def damaged_cifar(tmp: Path, sources: Sources) -> Path:
    """A copy of the fabricated CIFAR-10 with label 12 (of 10 classes) in data_batch_3."""
    shutil.copytree(sources.cifar10_root, tmp / "cifar")
    path = tmp / "cifar" / "cifar-10-batches-py" / "data_batch_3"
    batch = pickle.loads(path.read_bytes())
    batch["labels"][5] = 12
    path.write_bytes(pickle.dumps(batch))
    return tmp


def garbage_mnist(tmp: Path, sources: Sources) -> Path:
    shutil.copytree(sources.mnist_root, tmp / "mnist")
    path = tmp / "mnist" / "MNIST" / "raw" / "train-images-idx3-ubyte"
    path.write_bytes(np.random.default_rng(3).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    return tmp


def copy_of_run(tmp: Path, sources: Sources) -> Path:
    shutil.copytree(sources.finished_run, tmp / "run")
    return tmp


def unreadable_run(tmp: Path, sources: Sources) -> Path:
    copy_of_run(tmp, sources)
    locked(tmp / "run" / "checkpoints", 0o000)
    return tmp


def read_only_checkpoints(tmp: Path, sources: Sources) -> Path:
    copy_of_run(tmp, sources)
    locked(tmp / "run" / "checkpoints")
    return tmp


def disk_full_at_step_4(tmp: Path, sources: Sources) -> Path:
    """Step 4's checkpoint is written to /dev/full (every write: ENOSPC), as on a full disk."""
    copy_of_run(tmp, sources)
    (tmp / "run" / "checkpoints" / "step_00000004.pt.tmp").symlink_to("/dev/full")
    return tmp


def step_2_survives(tmp: Path) -> None:
    """The older checkpoint is intact (and loads), and the failed write left no temporary file."""
    folder = tmp / "run" / "checkpoints"
    folder.chmod(0o755)
    assert [p.name for p in folder.glob("*.tmp")] == []
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step_")) == [
        "step_00000002.pt", "step_00000002.pt.sha256"]
    digest = (folder / "step_00000002.pt.sha256").read_text().split()[0]
    assert hashlib.sha256((folder / "step_00000002.pt").read_bytes()).hexdigest() == digest
    assert torch.load(folder / "step_00000002.pt", weights_only=True)["step"] == 2


def nothing_at(*relative: str) -> Callable[[Path], None]:
    def check(tmp: Path) -> None:
        for path in relative:
            assert not (tmp / path).exists(), f"{path} was created"
    return check


def run_untouched(tmp: Path) -> None:
    (tmp / "run" / "checkpoints").chmod(0o755)
    assert sorted(p.name for p in (tmp / "run" / "checkpoints").iterdir()) == [
        "step_00000002.pt", "step_00000002.pt.sha256"]


CASES = {
    "capacity_factor inf": Case(lambda t: [*QUICK, "gate.capacity_factor=inf"],
                                ["gate.capacity_factor must be a finite number, got inf"]),
    "capacity_factor nan": Case(lambda t: [*QUICK, "gate.capacity_factor=nan"],
                                ["gate.capacity_factor must be a finite number, got nan"]),
    "batch_size 0": Case(lambda t: [*QUICK, "data.batch_size=0"], ["data.batch_size must be an integer >= 1, got 0"]),
    "num_experts 0": Case(lambda t: [*QUICK, "model.num_experts=0"], ["model.num_experts must be >= 1, got 0"],
                          forbidden=["top_k"]),
    "model that cannot be built": Case(lambda t: [*QUICK, "model.dim=17", "hydra.run.dir=new/folders/run"],
                                       ["model (moetrain.models.VisionMoE): dim (17) must be divisible by num_heads"],
                                       check=nothing_at("new")),
    "model that cannot be built, 2 workers": Case(
        lambda t: [*QUICK, "model.dim=17", "parallel=data", "parallel.nproc_per_node=2"],
        ["model (moetrain.models.VisionMoE): dim (17) must be divisible by num_heads"]),
    "adaptive_r without expert parallelism": Case(lambda t: [*QUICK, "parallel=data", "parallel.adaptive_r=0"],
                                                  ["parallel.adaptive_r applies to parallel.strategy=expert, not data"]),
    "full recomputation compiled": Case(lambda t: [*QUICK, "trainer.compile=true", "trainer.activation_checkpointing=full"],
                                        ["trainer.activation_checkpointing=full cannot be compiled",
                                         "trainer.compile=false"]),
    "name of 300 characters": Case(lambda t: [*QUICK, "name=" + "n" * 300],
                                   ["name=", "(300 characters)", "at most 100 letters, digits"]),
    "name with a path": Case(lambda t: [*QUICK, "name=a/b/../../../../tmp/x"],
                             ["name='a/b/../../../../tmp/x'", "one folder", "(no / and no ..)"]),
    "lr from an unset variable": Case(lambda t: [*QUICK, "optim.lr=${oc.env:MOETRAIN_TEST_UNSET}"],
                                      ["optim.lr", "MOETRAIN_TEST_UNSET", "is not set", "export"]),
    "self-referencing interpolation": Case(lambda t: [*QUICK, "optim.lr=${optim.lr}"],
                                           ["optim.lr", "refers back to itself"]),
    "unwritable hydra.run.dir": Case(lambda t: [*QUICK, f"hydra.run.dir={t / 'locked' / 'run'}"],
                                     ["cannot make the run directory", "is not writable", "hydra.run.dir="],
                                     prepare=lambda t, sources: (locked(t / "locked"), t)[1], unprivileged=True,
                                     check=nothing_at("locked/run")),
    "unwritable current directory": Case(lambda t: QUICK, ["the current directory", "is not writable",
                                                            "hydra.run.dir="],
                                         prepare=lambda t, sources: locked(t / "here"), unprivileged=True,
                                         check=nothing_at("here/runs")),
    "read-only run directory": Case(lambda t: [*QUICK, "hydra.run.dir=run", "trainer.resume=auto"],
                                    ["the run directory run is not writable", "chmod"],
                                    prepare=lambda t, sources: (copy_of_run(t, sources), locked(t / "run"))[0],
                                    unprivileged=True, needs_run=True, check=run_untouched),
    "metrics.json cannot be written": Case(
        lambda t: [*QUICK, "trainer.checkpoint_every=2", "hydra.run.dir=run"],
        ["cannot write", "run/metrics.json: Is a directory", "checkpoints saved before are intact "
         "(step_00000002.pt, step_00000003.pt)", "trainer.resume=auto"],
        prepare=lambda t, sources: ((t / "run" / "metrics.json").mkdir(parents=True), t)[1], no_run_directory=False),
    "unreadable trainer.resume": Case(lambda t: [*QUICK, "trainer.resume=run"],
                                      ["trainer.resume=run: cannot read", "Permission denied", "chmod"],
                                      prepare=unreadable_run, unprivileged=True, needs_run=True, check=run_untouched),
    "missing trainer.resume": Case(lambda t: [*QUICK, "trainer.resume=nowhere"],
                                   ["trainer.resume=nowhere does not exist"]),
    "negative token ids": Case(lambda t: ["data=text", f"data.path={t / 'tokens.npy'}", "data.vocab_size=100"],
                               ["tokens.npy: token id -3 is negative"],
                               prepare=lambda t, sources: token_file(t, np.array([5, 7, -3, 2] * 200, dtype=np.int32))),
    "token ids past the vocabulary": Case(
        lambda t: ["data=text", f"data.path={t / 'tokens.npy'}", "data.vocab_size=100"],
        ["tokens.npy: token id 140", ">= data.vocab_size=100", "at least 141"],
        prepare=lambda t, sources: token_file(t, np.array([5, 7, 140, 2] * 200, dtype=np.uint16))),
    "text file not UTF-8": Case(lambda t: ["data=text", f"data.path={t / 'corpus'}"],
                                ["corpus/b.txt:7: not UTF-8", "convert the file to UTF-8"], prepare=text_corpus),
    "jsonl line 201": Case(lambda t: ["data=text", f"data.path={t / 'docs.jsonl'}"],
                           [f"docs.jsonl:201: invalid JSON at column {BROKEN_COLUMN}"], prepare=jsonl_corpus),
    "missing text corpus": Case(lambda t: ["data=text", f"data.path={t / 'nothing'}"],
                                ["data.path", "nothing", "does not exist"]),
    "missing CIFAR-10": Case(lambda t: ["+recipe=switch_cifar10", f"data.root={t / 'nothing'}", "data.download=false"],
                             ["CIFAR-10 not found", "data.download=true"]),
    "CIFAR-10 labels outside the classes": Case(
        lambda t: ["+recipe=switch_cifar10", f"data.root={t / 'cifar'}", "data.download=false",
                   "data.verify_checksums=false"],
        ["cifar-10-batches-py/data_batch_3 has 1 labels outside the 10 classes 0..9 (the first: 12 of image 5)"],
        prepare=damaged_cifar),
    "CIFAR-10 batch carrying a pickled payload": Case(
        lambda t: ["+recipe=switch_cifar10", f"data.root={t / 'cifar'}", "data.download=false",
                   "data.verify_checksums=false"],
        ["cifar-10-batches-py/data_batch_2 is not a pickled CIFAR-10 batch", "posix.system",
         "which a CIFAR-10 batch does not hold"], prepare=planted_cifar, check=marker_absent),
    "image folder smaller than one batch": Case(
        lambda t: ["+recipe=quickstart", "data=folder", f"data.path={t / 'few'}"],
        ["the training set has 3 items, fewer than one batch of 64", "lower the data's batch_size"],
        prepare=small_image_folder),
    "MNIST of garbage": Case(
        lambda t: ["+recipe=switch_mnist", f"data.root={t / 'mnist'}", "data.download=false",
                   "data.verify_checksums=false"],
        ["MNIST/raw/train-images-idx3-ubyte starts with bytes", "not the idx magic", "download again"],
        prepare=garbage_mnist),
    "disk full while saving": Case(
        lambda t: [*QUICK, "trainer.max_steps=4", "trainer.checkpoint_every=2", "hydra.run.dir=run",
                   "trainer.resume=auto"],
        ["step_00000004.pt", "No space left on device", "untouched", "trainer.resume=auto"],
        prepare=disk_full_at_step_4, check=step_2_survives, needs_run=True, no_run_directory=False),
    "read-only checkpoint folder while saving": Case(
        lambda t: [*QUICK, "trainer.max_steps=4", "trainer.checkpoint_every=2", "hydra.run.dir=run",
                   "trainer.resume=auto"],
        ["step_00000004.pt", "Permission denied", "untouched", "trainer.resume=auto"],
        prepare=read_only_checkpoints, check=step_2_survives, unprivileged=True, needs_run=True,
        no_run_directory=False),
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 2-step run with its checkpoint at step 2 (each case that needs one gets a copy)."""
    folder = tmp_path_factory.mktemp("finished")
    result = moetrain([*QUICK, "trainer.max_steps=2", "trainer.checkpoint_every=2", "hydra.run.dir=run"], folder)
    assert result.returncode == 0, result.stderr
    return folder / "run"


@dataclass
class Outcome:
    tmp: Path
    cwd: Path
    result: subprocess.CompletedProcess


def _run_case(case: Case, tmp: Path, sources: Sources) -> Outcome | None:
    prefix = unprivileged() if case.unprivileged else []
    if prefix is None:
        return None
    cwd = case.prepare(tmp, sources)
    try:
        result = moetrain(case.args(tmp), cwd, prefix)
    finally:
        for path in [tmp, *tmp.rglob("*")]:  # let pytest clean up what was locked
            if path.is_dir() and not path.is_symlink():
                path.chmod(path.stat().st_mode | stat.S_IRWXU)
    return Outcome(tmp, cwd, result)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, cifar10_root, mnist_root, finished_run) -> dict:
    """Every case run once, two commands at a time (each is mostly Python starting up; CI has two
    cores), each in a directory of its own."""
    jobs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, case in CASES.items():
            sources = Sources(cifar10_root, mnist_root, finished_run if case.needs_run else None)
            jobs[name] = pool.submit(_run_case, case, tmp_path_factory.mktemp("case"), sources)
    return {name: job.result() for name, job in jobs.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_exit_2(name, outcomes):
    case, outcome = CASES[name], outcomes[name]
    if outcome is None:
        pytest.skip("running as root without setpriv: permissions cannot be denied")
    result, cwd = outcome.result, outcome.cwd
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("moetrain: error: "), result.stderr
    for text in case.says:
        assert text in lines[0], (text, lines[0])
    for text in case.forbidden:
        assert text not in lines[0], (text, lines[0])
    if case.no_run_directory:
        assert not (cwd / "runs").exists(), list((cwd / "runs").rglob("*"))
    case.check(outcome.tmp)


def test_help_into_a_closed_pipe_is_silent(tmp_path):
    """`moetrain --help | head -3`: the reader stops early; no BrokenPipeError, exit 0 or 141 as
    other tools (141: the status of a process ended by SIGPIPE)."""
    shell = subprocess.run(["bash", "-c", f"set -o pipefail; '{MOETRAIN}' --help | head -3"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert shell.returncode in (0, 141) and shell.stderr == "", shell.stderr
    assert len(shell.stdout.splitlines()) == 3
    # The same with a reader that is gone before anything is written: the write always fails.
    read_end, write_end = os.pipe()
    os.close(read_end)
    closed = subprocess.run([MOETRAIN, "--help"], cwd=tmp_path, stdout=write_end, stderr=subprocess.PIPE, text=True,
                            timeout=120)
    os.close(write_end)
    assert closed.returncode == 141 and closed.stderr == "", closed.stderr
