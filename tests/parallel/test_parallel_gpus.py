"""Two GPUs over NCCL (marker multigpu): fsdp_expert training, with its sharded checkpoints
written asynchronously, takes the steps of one GPU that sees the same items (fp32, <= 1e-5
relative), and a one-GPU run resumed from the two-GPU checkpoint continues that curve. The same
checks on CPU ranks over Gloo live in tests/parallel/test_parallel_fsdp.py and tests/parallel/test_parallel_resume.py;
these are the ones the CPU cannot make: NCCL, CUDA tensors, DCP from GPU memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_parallel_fsdp import assert_close, record_steps, tiny_trainer

from moetrain.config import Device, ParallelConfig, Precision
from moetrain.parallel import spawn
from moetrain.parallel.processes import Distributed

FIRST, TOTAL = 3, 6  # the checkpoint resumed; the last step


def exact_fp32() -> None:
    """cuDNN's TF32 convolutions (torch's default) would round the patch embedding differently for
    the different batch sizes of one and two GPUs."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def run_kwargs(device: str) -> dict:
    return dict(device=Device(device), precision=Precision.fp32)


def two_rank_writer(rank: int, world_size: int, out_dir: str, device: str) -> None:
    exact_fp32()
    strategy = Distributed(ParallelConfig(nproc_per_node=world_size, strategy="fsdp_expert"))
    trainer = tiny_trainer(Path(out_dir) / "fsdp_expert", world_size, strategy, max_steps=TOTAL,
                           checkpoint_every=FIRST, async_checkpoint=True, **run_kwargs(device))
    steps = record_steps(trainer)
    trainer.fit()
    torch.save(steps, Path(out_dir) / f"two{rank}.pt")


def two_ranks_then_one(out: Path, device: str) -> tuple[list, list, list]:
    """(one process's steps, each of the two ranks' steps, the steps of one process resumed from
    the two ranks' checkpoint of step FIRST)."""
    exact_fp32()
    reference = tiny_trainer(out / "one", max_steps=TOTAL, **run_kwargs(device))
    uninterrupted = record_steps(reference)
    reference.fit()
    spawn(two_rank_writer, 2, args=(str(out), device), backend="nccl" if device == "cuda" else "gloo")
    ranks = [torch.load(out / f"two{rank}.pt") for rank in range(2)]
    resumed = tiny_trainer(out / "resumed", max_steps=TOTAL, **run_kwargs(device),
                           resume=str(out / "fsdp_expert" / "checkpoints" / f"step_{FIRST:08d}"))
    resumed_steps = record_steps(resumed)
    resumed.fit()
    return uninterrupted, ranks, resumed_steps


@pytest.mark.multigpu
def test_two_gpus_train_like_one_and_their_checkpoint_resumes_on_one(tmp_path):
    uninterrupted, ranks, resumed = two_ranks_then_one(tmp_path, "cuda")
    for steps in ranks:
        assert_close(steps, uninterrupted)
    assert_close(resumed, uninterrupted[FIRST:], first_step=FIRST + 1)
