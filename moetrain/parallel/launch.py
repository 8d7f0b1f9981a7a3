"""Starting N workers on this machine, or joining a torchrun job, with bounded failures.

    spawn(train_fn, nprocs=4, args=(config,))   # runs train_fn(rank, world_size, config) in 4 processes
    init_from_torchrun()                        # inside a process started by torchrun

The backend follows the device: NCCL when CUDA is available (one GPU per local rank), Gloo
otherwise. Single-machine rendezvous uses a free TCP port on 127.0.0.1 only.

No failure hangs the job or leaves a process behind:
- every collective waits at most `timeout_s` (default 300 s), so a frozen rank turns into an error
  on the others instead of a silent wait (Gloo's own default is 30 minutes);
- the launcher watches its workers: once one fails (an exception, an exit code, a signal) or the
  others give up on one that stopped answering, it stops the rest and raises WorkerFailed, which
  names that rank, how it ended, and its exception with the traceback;
- workers die with the launcher (PR_SET_PDEATHSIG on Linux, a watchdog thread elsewhere), so killing
  it never leaves workers training;
- SIGTERM sent to the launcher (what job schedulers send) is forwarded to every worker; the launcher
  waits for them (a trainer saves its checkpoint first) and raises WorkersTerminated.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKENDS = ("nccl", "gloo")
DEFAULT_TIMEOUT_S = 300.0
# After the first failure, how long the others get to end on their own (they fail fast when a peer
# died) before they are stopped: long enough to see which rank failed first.
SETTLE_S = 2.0
# How long a worker asked to stop (SIGTERM) gets before SIGKILL.
KILL_GRACE_S = 5.0
# A rank that lost a peer fails in its next collective. Gloo raises a plain RuntimeError, so such
# errors are told from the rank's own failures by their message; this only decides which rank the
# report blames, never whether the job stops.
_COMMUNICATION_ERROR = re.compile(r"gloo|nccl|connection (reset|closed|refused)|timed out|broken pipe", re.IGNORECASE)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def choose_backend(backend: str | None = None, device: str | None = None) -> str:
    """None picks NCCL on CUDA, Gloo on CPU; an explicit backend is checked against this torch."""
    if backend is None:
        backend = "nccl" if (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda" else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (or None to choose by device), got {backend!r}")
    available = {"nccl": dist.is_nccl_available(), "gloo": dist.is_gloo_available()}[backend]
    if not available or (backend == "nccl" and not torch.cuda.is_available()):
        raise RuntimeError(f"backend {backend!r} is not available here (this torch or machine lacks it); "
                           f"use backend='gloo' on CPU or 'nccl' with CUDA GPUs")
    return backend


def check_timeout(timeout_s: float) -> None:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")


def init_distributed(rank: int, world_size: int, master_port: int, backend: str | None = None,
                     master_addr: str = "127.0.0.1", local_rank: int | None = None,
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Join a process group over TCP; returns this rank's device (cuda:local_rank with NCCL).
    timeout_s bounds the rendezvous and every collective."""
    check_timeout(timeout_s)
    backend = choose_backend(backend)
    local_rank = rank if local_rank is None else local_rank
    device = torch.device("cpu")
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {local_rank} needs GPU {local_rank}, but only "
                               f"{torch.cuda.device_count()} are visible: start at most that many workers per machine")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s),
                            device_id=device if backend == "nccl" else None)
    return device


def init_from_torchrun(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Join the job torchrun describes (its rendezvous variables); returns this rank's device."""
    check_timeout(timeout_s)
    backend = choose_backend(backend)
    device = torch.device("cpu")
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    if backend == "nccl":
        device = torch.device("cuda", dist.get_node_local_rank())
        torch.cuda.set_device(device)
    return device


# ---- how a worker ended, and what the launcher raises ----------------------------------------------
@dataclass
class WorkerExit:
    """One worker's end: its exit code (negative: killed by that signal), and the exception it raised."""

    rank: int
    pid: int
    exitcode: int | None = None  # None while it runs
    error: BaseException | None = None  # the worker's exception, when it raised one (and it pickles)
    error_text: str = ""  # "Type: message" of that exception, even when the object did not pickle
    traceback: str = ""
    stopped: bool = False  # still running when the others gave up waiting for it
    frozen: bool = False  # and in the stopped state (SIGSTOP), as the launcher found it

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def communication_error(self) -> bool:
        """It raised because a collective failed: usually the sign of another rank's failure."""
        if isinstance(self.error, dist.DistError):
            return True
        # Gloo's errors are plain RuntimeErrors (subclasses are the rank's own: NonFiniteLoss, ...).
        plain = self.error is None or type(self.error) is RuntimeError
        return plain and bool(_COMMUNICATION_ERROR.search(self.error_text))

    def describe(self) -> str:
        who = f"worker rank {self.rank} (pid {self.pid})"
        if self.stopped:
            return f"{who} stopped responding" + (" (it was frozen, as by SIGSTOP)" if self.frozen else "")
        if self.signal_name == "SIGKILL":  # what the kernel's out-of-memory killer sends
            return f"{who} was killed by SIGKILL (out of host memory? the kernel's OOM killer sends it)"
        if self.signal_name:
            return f"{who} was killed by {self.signal_name}"
        if self.error_text:
            return f"{who} failed: {self.error_text}"
        return f"{who} exited with code {self.exitcode}"


class WorkerFailed(RuntimeError):
    """A worker failed, or stopped answering; the others were stopped. `failed` is the rank blamed:
    the first to fail on its own (a rank failing only because it lost a peer is blamed last), or
    one that was still running when the others timed out waiting for it."""

    def __init__(self, failed: WorkerExit, exits: list[WorkerExit], timeout_s: float):
        self.failed, self.exits, self.timeout_s = failed, exits, timeout_s
        message = failed.describe()
        if failed.stopped:
            message += f": the other ranks gave up waiting for it after the collective timeout ({timeout_s:g} s)"
        super().__init__(message + (f"\n{failed.traceback}" if failed.traceback else ""))


class WorkersTerminated(RuntimeError):
    """The launcher received SIGTERM, forwarded it to every worker and waited for them to end."""

    def __init__(self, exits: list[WorkerExit]):
        self.exits = exits
        super().__init__("stopped by SIGTERM: " + "; ".join(f"rank {w.rank} {_ending(w)}" for w in exits))


def _ending(worker: WorkerExit) -> str:
    if worker.signal_name:
        return f"ended by {worker.signal_name}"
    if worker.error_text:
        return f"raised {worker.error_text}"
    return "ended" if worker.exitcode == 0 else f"exited with code {worker.exitcode}"


def _is_stopped(pid: int) -> bool:
    """Whether the process is in the stopped state (Linux /proc; False where that cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


# ---- the worker side ---------------------------------------------------------------------------------
def _die_with_parent(parent_pid: int) -> None:
    """End this worker (SIGKILL) as soon as the launcher dies, however it dies. (Linux sends the
    signal when the launcher's thread that started the worker ends: spawn from the main thread.)"""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
            if os.getppid() != parent_pid:  # the launcher died before prctl took effect
                os._exit(1)
            return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="moetrain-parent-watchdog", daemon=True).start()


def _report(connection, error: BaseException) -> None:
    """Send the worker's exception to the launcher (the object when it pickles, its text always)."""
    try:
        pickled = pickle.dumps(error)
    except Exception:  # an exception holding unpicklable state: its text still goes
        pickled = None
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    try:
        connection.send((pickled, text, traceback.format_exc()))
    except OSError:  # the launcher is gone; nothing is left to tell
        pass


def _worker(rank: int, world_size: int, port: int, backend: str | None, timeout_s: float, parent_pid: int,
            connection, fn, args) -> None:
    _die_with_parent(parent_pid)
    # The launcher forwards SIGTERM itself; a Ctrl-C reaches every process of the terminal's group,
    # and the launcher reports it once.
    if choose_backend(backend) == "gloo":
        # CPU workers share the machine's cores: more threads than cores makes every collective
        # wait for descheduled threads (steps run many times slower), as torchrun's default of
        # one thread per worker also avoids.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    # Every ending is os._exit, after the streams are flushed. Not sys.exit: after a failed
    # collective the interpreter's shutdown may wait on threads that never end, and after a clean
    # run the C++ destructors that shutdown runs (the rendezvous store's and Gloo's threads) could
    # abort the finished worker ("terminate called without an active exception", SIGABRT), which
    # fails a job whose work is done. After a clean run the atexit handlers still run; the
    # interpreter's own shutdown (joining threads, finalizing modules) does not, so fn must finish
    # its work (close files, join its threads) before it returns.
    code = 0
    try:
        init_distributed(rank, world_size, port, backend, timeout_s=timeout_s)
        try:
            fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except SystemExit as exit_request:
        if isinstance(exit_request.code, int):  # as the interpreter ends on sys.exit(code)
            code = exit_request.code
        elif exit_request.code is not None:
            print(exit_request.code, file=sys.stderr)
            code = 1
    except BaseException as error:  # the launcher reports it (one line, or the traceback for a bug)
        _report(connection, error)
        code = 130 if isinstance(error, KeyboardInterrupt) else 1
    connection.close()
    if code == 0:
        # The interpreter's own exit functions (logging, multiprocessing's finalizers, torch.compile's
        # worker pools) still run: only the C++ teardown after them is skipped.
        atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- the launcher side -------------------------------------------------------------------------------
@dataclass
class _Running:
    exit: WorkerExit
    process: mp.Process
    reader: object  # the launcher's end of the worker's pipe
    ended_at: float | None = None


def _receive(worker: _Running) -> None:
    try:
        while worker.reader.poll():
            pickled, text, trace = worker.reader.recv()
            worker.exit.error_text, worker.exit.traceback = text, trace
            if pickled is not None:
                try:
                    worker.exit.error = pickle.loads(pickled)
                except Exception:  # a class the launcher cannot import: the text says what it was
                    worker.exit.error = None
    except (EOFError, OSError):
        pass


def _join(workers: list[_Running], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))


def _stop(workers: list[_Running], grace_s: float) -> None:
    """SIGTERM the workers still running, SIGKILL those that outlive `grace_s` (a frozen process
    only ends by SIGKILL)."""
    running = [w for w in workers if w.process.is_alive()]
    for worker in running:
        if not worker.exit.stopped:
            worker.process.terminate()
    _join([w for w in running if not w.exit.stopped], grace_s)
    for worker in running:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join()


def _blame(ended: list[_Running], still_running: list[_Running]) -> WorkerExit:
    """The worker whose failure stopped the job (see WorkerFailed)."""
    failed = [w for w in ended if w.exit.exitcode != 0]
    own = [w for w in failed if not w.exit.communication_error]
    if own:  # killed, or failed on its own: the earliest, the lowest rank among those seen together
        return min(own, key=lambda w: (w.ended_at, w.exit.rank)).exit
    if still_running:  # the others timed out waiting for these
        return min(still_running, key=lambda w: w.exit.rank).exit
    return min(failed, key=lambda w: (w.ended_at, w.exit.rank)).exit


def spawn(fn, nprocs: int, args: tuple = (), backend: str | None = None,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Run fn(rank, world_size, *args) in nprocs fresh processes joined in one process group whose
    collectives wait at most timeout_s. fn must be importable (a module-level function), and have
    finished its work when it returns (files closed, its threads joined): a worker then runs the
    atexit handlers and ends with os._exit, without the interpreter's shutdown.
    Raises WorkerFailed when a worker fails (the others are stopped), WorkersTerminated after a
    SIGTERM, KeyboardInterrupt after Ctrl-C; every worker has ended when it returns or raises."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    check_timeout(timeout_s)
    choose_backend(backend)
    context = mp.get_context("spawn")
    port = free_port()
    workers: list[_Running] = []
    try:
        for rank in range(nprocs):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(target=_worker, name=f"moetrain-rank{rank}",
                                      args=(rank, nprocs, port, backend, timeout_s, os.getpid(), writer, fn, args))
            process.start()
            writer.close()
            workers.append(_Running(WorkerExit(rank, process.pid), process, reader))
    except BaseException:
        _stop(workers, 0.0)  # a later rank did not start (fork failed): the others would wait until the timeout
        raise

    terminated_at: list[float] = []  # set when SIGTERM arrives

    def forward_sigterm(signum, frame) -> None:
        if not terminated_at:
            terminated_at.append(time.monotonic())
        for worker in workers:
            if worker.process.is_alive():
                worker.process.terminate()

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, forward_sigterm) if in_main_thread else None
    interrupted = False
    first_failure: float | None = None
    try:
        while True:
            running = [w for w in workers if w.ended_at is None]
            if not running:
                break
            now = time.monotonic()
            if first_failure is not None and now - first_failure > SETTLE_S:
                break
            # A worker stopped by SIGTERM saves its checkpoint, which may wait one collective timeout.
            if terminated_at and now - terminated_at[0] > timeout_s + KILL_GRACE_S:
                break
            try:
                ready = wait([w.process.sentinel for w in running] + [w.reader for w in running], timeout=0.5)
            except KeyboardInterrupt:  # Ctrl-C reached the workers too: let them end, then report it once
                interrupted = True
                break
            for worker in running:
                _receive(worker)
                if worker.process.sentinel in ready:
                    worker.process.join()
                    _receive(worker)
                    worker.ended_at = time.monotonic()
                    worker.exit.exitcode = worker.process.exitcode
                    if worker.exit.exitcode != 0 and first_failure is None and not terminated_at:
                        first_failure = worker.ended_at
        still_running = [w for w in workers if w.ended_at is None]
        ended = [w for w in workers if w.ended_at is not None]
        if first_failure is not None and not terminated_at and not interrupted:
            blamed = _blame(ended, still_running)
            blamed.stopped = any(w.exit is blamed for w in still_running)
            blamed.frozen = blamed.stopped and _is_stopped(blamed.pid)
            _stop(workers, KILL_GRACE_S)
        else:
            if interrupted:  # Ctrl-C reached the workers as well: they end on their own
                _join(workers, KILL_GRACE_S)
            _stop(workers, KILL_GRACE_S)
            blamed = None
    except BaseException:
        _stop(workers, 0.0)
        raise
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
        for worker in workers:
            _receive(worker)
            if worker.exit.exitcode is None:
                worker.exit.exitcode = worker.process.exitcode
            worker.reader.close()
    exits = [w.exit for w in workers]
    if interrupted:
        raise KeyboardInterrupt
    if terminated_at:
        raise WorkersTerminated(exits)
    if blamed is not None:
        raise WorkerFailed(blamed, exits, timeout_s)
