"""One run per run directory: an advisory lock on <run dir>/.moetrain.lock, held for the life of the run.

Two runs started in one directory would interleave checkpoints and event files and overwrite each
other's saved config, so the second is refused before it writes anything there. The lock is
flock(2) on an open file: the kernel drops it when the process ends, however it ends, so the lock
file a dead run leaves behind blocks nothing. The file holds the holder's pid and host, for the message.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = ".moetrain.lock"
_held: dict[str, int] = {}  # real path of the run directory -> the open lock file (kept open = kept locked)


class RunDirectoryBusy(RuntimeError):
    """Another live process (`holder`: its pid and host) holds the lock of `run_dir`."""

    def __init__(self, run_dir: Path, holder: str):
        super().__init__(run_dir, holder)  # the arguments, so that it pickles
        self.run_dir, self.holder = run_dir, holder

    def __str__(self) -> str:
        return (f"{self.run_dir} is in use by another moetrain run (pid and host: {self.holder}): wait for it "
                "to end, or give this run another directory")


def lock_run_directory(run_dir: Path) -> None:
    """Take `run_dir`'s lock (making the directory) for the rest of this process; a second call for
    the same directory in this process does nothing. Raises RunDirectoryBusy when another process
    holds it."""
    run_dir = Path(run_dir)
    key = os.path.realpath(run_dir)
    if key in _held:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunDirectoryBusy(run_dir, holder) from None
        # Some network file systems have no locks: go on, but say that nothing guards the directory.
        log.warning("cannot lock %s (%s): a second run started there would not be refused", run_dir, error.strerror)
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    _held[key] = fd


def unlock_run_directory(run_dir: Path) -> None:
    """Release the lock this process holds on `run_dir` (ending the process releases it too)."""
    fd = _held.pop(os.path.realpath(run_dir), None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor of the open file drops the flock
