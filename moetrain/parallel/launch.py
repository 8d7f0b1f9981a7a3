"""Starting N workers on this machine, or joining a torchrun job.

    spawn(train_fn, nprocs=4, args=(config,))   # runs train_fn(rank, world_size, config) in 4 processes
    init_from_torchrun()                        # inside a process started by torchrun

The backend follows the device: NCCL when CUDA is available (one GPU per local rank), Gloo
otherwise. Single-machine rendezvous uses a free TCP port on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKENDS = ("nccl", "gloo")


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


def init_distributed(rank: int, world_size: int, master_port: int, backend: str | None = None,
                     master_addr: str = "127.0.0.1", local_rank: int | None = None,
                     timeout_s: float = 600.0) -> torch.device:
    """Join a process group over TCP; returns this rank's device (cuda:local_rank with NCCL)."""
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


def init_from_torchrun(backend: str | None = None) -> torch.device:
    """Join the job torchrun describes (its rendezvous variables); returns this rank's device."""
    backend = choose_backend(backend)
    device = torch.device("cpu")
    dist.init_process_group(backend)
    if backend == "nccl":
        device = torch.device("cuda", dist.get_node_local_rank())
        torch.cuda.set_device(device)
    return device


def _worker(rank: int, world_size: int, port: int, backend: str | None, fn, args) -> None:
    if choose_backend(backend) == "gloo":
        # CPU workers share the machine's cores: more threads than cores makes every collective
        # wait for descheduled threads (steps run many times slower), as torchrun's default of
        # one thread per worker also avoids.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    init_distributed(rank, world_size, port, backend)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, nprocs: int, args: tuple = (), backend: str | None = None) -> None:
    """Run fn(rank, world_size, *args) in nprocs fresh processes joined in one process group.
    fn must be importable (a module-level function); an exception in any worker is raised here."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    choose_backend(backend)
    mp.spawn(_worker, args=(nprocs, free_port(), backend, fn, args), nprocs=nprocs, join=True)
