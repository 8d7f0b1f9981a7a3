"""Checkpoints: one file per saved step under <run dir>/checkpoints, written atomically.

A checkpoint holds everything a resumed run needs to continue as if it had never stopped: model,
optimizer, LR scheduler, data position, every random generator, the step, and the composed config.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import torch

from moetrain.config import ConfigError

CHECKPOINT_DIR = "checkpoints"
# A file, or (multi-process runs) a directory with one file per rank: moetrain.parallel.checkpoint.
_NAME = re.compile(r"^step_(\d+)(\.pt)?$")


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(state: dict, run_dir: Path, step: int, keep: int) -> Path:
    """Write <run_dir>/checkpoints/step_<step>.pt; keep the newest `keep` (0 = all)."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:08d}.pt"
    temporary = path.with_name(path.name + ".tmp")
    torch.save(state, temporary)
    # A crash while writing leaves only the .tmp file: the previous checkpoint stays the latest.
    os.replace(temporary, path)
    if keep:
        for old in checkpoints(directory)[:-keep]:
            old.unlink()
    return path


def checkpoints(directory: Path) -> list[Path]:
    """The checkpoint files in `directory`, oldest step first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [path for _, path in sorted(found)]


def find(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint that trainer.resume names: "auto" = the latest of this run (None when the run
    has none yet), a run directory = its latest, or a checkpoint file."""
    if resume == "auto":
        found = checkpoints(Path(run_dir) / CHECKPOINT_DIR)
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if path.is_file() or any(path.glob("rank*-of-*.pt")):
        return path
    found = checkpoints(path / CHECKPOINT_DIR) or checkpoints(path)
    if not found:
        raise ConfigError(
            f"trainer.resume={resume}: no checkpoint there; pass a run directory, a checkpoint file, or auto"
        )
    return found[-1]


def load(path: Path) -> dict:
    # On the CPU: RNG states must stay CPU tensors; load_state_dict moves weights and optimizer
    # state to their parameters' device. Our own files hold Python and NumPy objects (RNG states),
    # so they are loaded in full.
    return torch.load(path, map_location="cpu", weights_only=False)
