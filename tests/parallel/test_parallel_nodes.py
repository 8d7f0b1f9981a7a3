"""Two "machines" of two processes on one host: two torchrun launchers, each `--nnodes 2
--nproc_per_node 2`, meet at a c10d rendezvous on localhost (Gloo), as docs/distributed.md's
several-machines example does across hosts. The four ranks train fsdp_expert (experts sharded over
their replicas across the two "machines") and match one process's losses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from test_parallel_fsdp import assert_close, record_steps, tiny_trainer

from moetrain.parallel import free_port

TESTS = Path(__file__).resolve().parent
STEPS = 4  # the rendezvous is under test here; tests/parallel/test_parallel_fsdp.py trains every layout for longer

SCRIPT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    import torch
    import torch.distributed as dist
    from test_parallel_fsdp import record_steps, tiny_trainer
    from moetrain.config import ParallelConfig
    from moetrain.parallel import init_from_torchrun
    from moetrain.parallel.processes import Distributed

    init_from_torchrun("gloo", timeout_s=120)
    out, rank, world = Path(sys.argv[1]), dist.get_rank(), dist.get_world_size()
    strategy = Distributed(ParallelConfig(nproc_per_node=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="fsdp_expert"))
    trainer = tiny_trainer(out / "run", world, strategy, max_steps=int(sys.argv[3]))
    steps = record_steps(trainer)
    trainer.fit()
    torch.save({"steps": steps, "node": int(os.environ["GROUP_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"])},
               out / f"rank{rank}.pt")
    dist.destroy_process_group()
""")


def test_two_nodes_of_two_processes_train_like_one(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
               "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two_nodes",
               "--max_restarts", "0", str(script), str(tmp_path), str(TESTS), str(STEPS)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    launchers = [subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=environment) for _ in range(2)]
    outputs = []
    try:
        for launcher in launchers:
            outputs.append(launcher.communicate(timeout=400)[0])
    finally:
        for launcher in launchers:
            launcher.kill()
    assert [launcher.returncode for launcher in launchers] == [0, 0], outputs[-1][-3000:]

    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(4)]
    assert sorted((rank["node"], rank["local_rank"]) for rank in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    single = tiny_trainer(tmp_path / "single", max_steps=STEPS)
    reference = record_steps(single)
    single.fit()
    for rank in ranks:
        assert_close(rank["steps"], reference)
