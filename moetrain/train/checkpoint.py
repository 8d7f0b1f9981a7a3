"""Checkpoints: one file per saved step under <run dir>/checkpoints, each with its sha256 written last.

A checkpoint holds everything a resumed run needs to continue as if it had never stopped: model,
optimizer, data position, every random generator, the step, the composed config and the metrics so
far. The learning-rate schedule is not stored: it is a function of the step and the current config.

On disk, and what makes a checkpoint count:

    checkpoints/step_00000500.pt          the data, written to step_00000500.pt.tmp and renamed
    checkpoints/step_00000500.pt.sha256   its sha256, in `sha256sum`'s format, written after the data
    checkpoints/step_00000500/            a multi-process checkpoint: one file per rank
        rank00000-of-00002.pt ...         (moetrain.parallel.checkpoint), and
        SHA256SUMS                        every rank's sha256, written last by rank 0 once all have written

A step without its checksum file is incomplete (the run stopped while saving it); a file whose bytes
do not match its checksum is corrupted. Resuming skips both, saying so, and takes the newest intact
checkpoint. `sha256sum -c step_00000500.pt.sha256` (or `sha256sum -c SHA256SUMS` in a step
directory) checks a checkpoint by hand.

A checksum proves a file whole, not harmless: whoever wrote it chose its bytes. So a checkpoint
holds only tensors, plain containers (dict, list, tuple), strings and numbers, random states
included, and is read with `torch.load(weights_only=True)`, which builds nothing else. A file that
needs any other object (a checkpoint of an earlier moetrain held Python's and NumPy's random
states as their own objects, or a crafted one) is refused with UnsafeCheckpointError;
`moetrain convert-checkpoint --trust PATH` rewrites one the user trusts (convert_trusted).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

CHECKPOINT_DIR = "checkpoints"
CHECKSUM_SUFFIX = ".sha256"  # step_N.pt -> step_N.pt.sha256
MANIFEST = "SHA256SUMS"  # in a multi-process step directory
# A file, or (multi-process runs) a directory with one file per rank: moetrain.parallel.checkpoint.
_NAME = re.compile(r"^step_(\d+)(\.pt)?$")
_RANK_FILE = re.compile(r"^rank\d{5}-of-\d{5}\.pt$")
_CHECKSUM_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


class CheckpointError(ValueError):
    """A checkpoint is incomplete, corrupted, unreadable, or not this model's (the CLI reports it in one
    line, exit 2)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint that holds objects other than tensors, containers and numbers: loading it would run
    whatever code its author chose, so it is not loaded (nor skipped for an older one: see the module doc)."""


def conversion_target(path: Path) -> Path:
    """What `moetrain convert-checkpoint --trust` is best given for a checkpoint: its run directory
    (every checkpoint in it) when it lies in one, else the checkpoint itself."""
    entry = Path(path)
    if _RANK_FILE.match(entry.name) or entry.suffix == ".distcp" or entry.name == ".metadata":
        entry = entry.parent  # one file of a multi-process checkpoint: its step directory
    return entry.parent.parent if entry.parent.name == CHECKPOINT_DIR else entry


def unsafe(path: Path, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path} holds {what}, which only running code from the file could build: moetrain loads only tensors, "
        "containers and numbers from checkpoints; if you trust where it comes from, rewrite it once in that form "
        f"with `moetrain convert-checkpoint --trust {conversion_target(path)}`")


def refused_object(error: Exception) -> str:
    """The object torch.load(weights_only=True) refused to build, from its message."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    return f"a reference to {found.group(1)}" if found else "an object that is not a tensor, container or number"


def load_data_only(source, path: Path, **kwargs):
    """torch.load(source, weights_only=True): tensors, containers and numbers, nothing else built.
    A file needing any other object is an UnsafeCheckpointError naming `path`; nothing of it runs."""
    try:
        return torch.load(source, weights_only=True, **kwargs)
    except pickle.UnpicklingError as error:
        if not refused_by_weights_only(error):
            raise  # bytes that are no pickle at all: the caller says the file does not load
        raise unsafe(path, refused_object(error)) from None


def refused_by_weights_only(error: pickle.UnpicklingError) -> bool:
    """Whether torch.load(weights_only=True) refused an object (before building it), rather than bytes
    that are no pickle at all."""
    return "Weights only load failed" in str(error)


# The random generators as tensors and numbers (random.getstate() and np.random.get_state() are a
# tuple and a tuple with an array: neither loads without running code). Restoring them is exact.
def rng_state() -> dict:
    return plain_rng_state({
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    })


def plain_rng_state(state: dict) -> dict:
    """Python's and NumPy's random states (random.getstate()'s and np.random.get_state()'s tuples,
    as an earlier moetrain saved them) as dicts of tensors and numbers; a state in that form already
    is returned as it is."""
    python, numpy = state["python"], state["numpy"]
    if isinstance(python, tuple):
        version, words, gauss_next = python
        python = {"version": version, "state": torch.tensor(words, dtype=torch.int64), "gauss_next": gauss_next}
    if isinstance(numpy, tuple):
        kind, key, position, has_gauss, cached_gaussian = numpy
        numpy = {"kind": kind, "key": torch.from_numpy(np.asarray(key).astype(np.int64)), "position": int(position),
                 "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    return {**state, "python": python, "numpy": numpy}


def set_rng_state(state: dict) -> None:
    python, numpy = state["python"], state["numpy"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss_next"]))
    np.random.set_state((numpy["kind"], numpy["key"].numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- writing ------------------------------------------------------------------------------------
class _HashingWriter:
    """A file wrapper that hashes the bytes torch.save writes, so the file is not read back."""

    def __init__(self, file):
        self.file, self.sha256 = file, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _sync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable (a power loss could otherwise undo it)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def os_error_behind(error: BaseException) -> OSError | None:
    """The OSError that `error` is, or was raised while handling: when a write fails part of the way
    through, torch.save's zip writer fails again closing the file and raises a RuntimeError of its
    own ("unexpected pos"), with the disk's OSError as its context."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def cannot_write(path: Path, cause: OSError) -> CheckpointError:
    """The one-line error of a checkpoint the disk or the folder did not take."""
    return CheckpointError(
        f"cannot write the checkpoint {path} ({cause.strerror or cause}): the checkpoints saved before it "
        "are untouched; free space or make the folder writable, then continue with TrainerConfig.resume='auto'")


def write(state: dict, path: Path) -> str:
    """torch.save `state` to `path` through a temporary file renamed when complete; returns the
    sha256 of the bytes written. A crash while writing leaves only `path`.tmp behind."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            writer = _HashingWriter(file)
            torch.save(state, writer)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        temporary.unlink(missing_ok=True)  # a full disk or a read-only folder leaves no .tmp behind
        cause = os_error_behind(error)
        if cause is not None:
            raise cannot_write(path, cause) from None
        raise
    _sync_directory(path.parent)
    return writer.sha256.hexdigest()


def write_checksums(path: Path, digests: dict[str, str]) -> None:
    """`sha256sum`'s format ("<hex>  <name>" per line), through a temporary file renamed when complete."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as file:
        file.writelines(f"{digest}  {name}\n" for name, digest in digests.items())
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    _sync_directory(path.parent)


def save(state: dict, run_dir: Path, step: int, keep: int) -> Path:
    """Write <run_dir>/checkpoints/step_<step>.pt, then its checksum; keep the newest `keep` (0 = all)."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:08d}.pt"
    # A stale checksum of an earlier attempt at this step must not vouch for the new bytes.
    checksum_path(path).unlink(missing_ok=True)
    write_checksums(checksum_path(path), {path.name: write(state, path)})
    prune(directory, keep)
    return path


def _remove(entry: Path) -> None:
    if entry.is_dir():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)
        checksum_path(entry).unlink(missing_ok=True)


def prune(directory: Path, keep: int) -> None:
    """Delete the complete checkpoints beyond the newest `keep` (0 = keep all), every incomplete one,
    and leftover temporary files. Call it only while no checkpoint is being written."""
    entries = checkpoints(directory)
    complete = [entry for entry in entries if is_complete(entry)]
    doomed = [entry for entry in entries if entry not in complete] + (complete[:-keep] if keep else [])
    for entry in doomed:
        _remove(entry)
    for leftover in list(directory.glob("step_*.tmp")) + list(directory.glob(f"step_*.pt{CHECKSUM_SUFFIX}")):
        if leftover.name.endswith(".tmp") or not leftover.with_name(leftover.name[: -len(CHECKSUM_SUFFIX)]).exists():
            leftover.unlink(missing_ok=True)


# ---- finding ------------------------------------------------------------------------------------
def checksum_path(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + CHECKSUM_SUFFIX)


def checkpoints(directory: Path) -> list[Path]:
    """Every checkpoint entry in `directory` (complete or not), oldest step first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [path for _, path in sorted(found)]


def is_complete(entry: Path) -> bool:
    """Whether the checksum file, written last, is there (says nothing about the bytes: see verify)."""
    return (entry / MANIFEST).is_file() if entry.is_dir() else checksum_path(entry).is_file()


def check_complete(entry: Path) -> None:
    """Raise CheckpointError unless `entry` (a checkpoint file or step directory) was completely saved."""
    entry = Path(entry)
    if is_complete(entry):
        return
    if entry.is_dir():
        held = sorted(p.name for p in entry.iterdir()) or ["nothing"]
        raise CheckpointError(
            f"{entry} is incomplete: it has no {MANIFEST} (written once every rank's file is), so the run stopped "
            f"while saving it; it holds {', '.join(held)}")
    if not entry.exists():
        raise CheckpointError(f"{entry} does not exist")
    raise CheckpointError(
        f"{entry} has no checksum file {checksum_path(entry).name}: the run stopped while saving it, or it was not "
        f"written by moetrain (to load it anyway, write one: sha256sum {entry.name} > {checksum_path(entry).name})")


def candidates(resume: str, run_dir: Path) -> list[Path]:
    """The checkpoints trainer.resume names, newest first, to be tried in that order: "auto" = those of
    this run ([] when it has none yet), a run directory = its own, a checkpoint file or a per-rank or
    sharded (DCP) step directory = just that one."""
    if resume == "auto":
        return checkpoints(Path(run_dir) / CHECKPOINT_DIR)[::-1]
    path = Path(resume).expanduser()
    if path.is_file() or any(path.glob("rank*-of-*.pt*")) or any(path.glob("*.distcp")) or (path / MANIFEST).is_file():
        return [path]
    found = checkpoints(path / CHECKPOINT_DIR) or checkpoints(path)
    if not found:
        raise CheckpointError(
            f"TrainerConfig.resume={resume!r}: no checkpoint there; pass a run directory, a checkpoint file, "
            "or TrainerConfig.resume='auto'"
        )
    return found[::-1]


def find(resume: str, run_dir: Path) -> Path | None:
    """The newest complete checkpoint trainer.resume names (None for "auto" in a run without any;
    the only candidate when none is complete). Loading it checks its bytes; the trainer also falls
    back to older checkpoints when they are damaged."""
    found = candidates(resume, run_dir)
    return next((path for path in found if is_complete(path)), found[0] if found else None)


# ---- converting a trusted checkpoint of an earlier moetrain ---------------------------------------
def _is_rng_state(value) -> bool:
    return isinstance(value, dict) and {"python", "numpy", "torch", "cuda"} <= value.keys()


def safe_form(value):
    """A state loaded in full, in the data-only form: random states as rng_state() gives them, NumPy
    arrays as tensors and NumPy scalars as numbers, containers rebuilt around them. Anything else
    stays as it is (and still fails to load data-only)."""
    if _is_rng_state(value):
        value = plain_rng_state(value)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return type(value)((key, safe_form(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(safe_form(item) for item in value)
    return value


def check_data_only(state, path: Path) -> None:
    """Raise UnsafeCheckpointError unless `state` loads back with weights_only=True."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as error:  # torch.save's own bytes: refused, not garbage
        raise UnsafeCheckpointError(f"{path} holds {refused_object(error)}, which has no data-only form: it cannot "
                                    "be converted; save what it holds as tensors, containers and numbers") from None


def convert_trusted(path: Path) -> str | None:
    """Rewrite one checkpoint file the user trusts in the data-only form: loaded once in full (the
    only place moetrain does so), made data-only (safe_form), written again through a temporary
    file. Returns the new sha256, or None when the file is data-only already (left as it is); the
    caller writes the checksum file (single-process) or its step directory's SHA256SUMS."""
    verify(path)
    try:
        load_data_only(path, path, map_location="cpu")
        return None
    except UnsafeCheckpointError:
        pass
    state = safe_form(torch.load(path, map_location="cpu", weights_only=False))  # trusted by the user's word
    check_data_only(state, path)
    return write(state, path)


def replace_directory(directory: Path, converted: Path) -> None:
    """Put the complete `converted` copy of a step directory in its place. The names used meanwhile
    (.converting, .replaced) are no step's: nothing ever reads a half-converted checkpoint, and one
    interrupted between the two renames leaves both complete copies beside each other."""
    replaced = directory.with_name(directory.name + ".replaced")
    shutil.rmtree(replaced, ignore_errors=True)
    directory.rename(replaced)
    converted.rename(directory)
    shutil.rmtree(replaced)


# ---- reading ------------------------------------------------------------------------------------
def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def read_checksums(path: Path) -> dict[str, str]:
    """A `sha256sum`-format file -> {file name: sha256}."""
    digests = {}
    for line in Path(path).read_text().splitlines():
        match = _CHECKSUM_LINE.match(line.strip())
        if match is None:
            raise CheckpointError(f"{path} is not a sha256sum listing (line {line[:80]!r}): the checkpoint is damaged")
        digests[match.group(2)] = match.group(1)
    return digests


def recorded_checksum(path: Path) -> str:
    """The sha256 saved for a checkpoint file: from its .sha256 file, or from its step directory's
    SHA256SUMS (one rank's file of a multi-process checkpoint)."""
    path = Path(path)
    for listing in (checksum_path(path), path.parent / MANIFEST):
        if listing.is_file():
            digests = read_checksums(listing)
            if path.name not in digests:
                raise CheckpointError(f"{listing} has no checksum for {path.name}: the checkpoint is damaged")
            return digests[path.name]
    # Nothing vouches for the file: say what is missing (for one rank's file, its directory's manifest).
    check_complete(path.parent if _RANK_FILE.match(path.name) else path)
    raise CheckpointError(f"{path} has no checksum saved with it")


def verify(path: Path) -> None:
    """Raise CheckpointError unless the file's bytes match the sha256 recorded when it was saved."""
    expected = recorded_checksum(path)
    if not Path(path).is_file():
        raise CheckpointError(f"{path} is missing although its checkpoint lists it")
    actual = sha256_of(path)
    if actual != expected:
        size = Path(path).stat().st_size
        raise CheckpointError(
            f"{path} is corrupted: its sha256 is {actual[:16]}..., not the {expected[:16]}... saved with it "
            f"({'empty' if size == 0 else f'{size} bytes'})")


def load(path: Path) -> dict:
    """A checkpoint file, once its checksum matches."""
    verify(path)
    # On the CPU: RNG states must stay CPU tensors; load_state_dict moves weights and optimizer
    # state to their parameters' device.
    try:
        return load_data_only(path, path, map_location="cpu")
    except CheckpointError:
        raise
    except Exception as error:  # the bytes are the ones saved, yet they do not load: say which and why
        message = " ".join(str(error).split())[:300]
        raise CheckpointError(f"{path} does not load ({type(error).__name__}: {message})") from None
