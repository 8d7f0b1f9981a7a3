"""`python -m moetrain.parallel.memory`: training-state bytes per rank against a count by hand.

Under fsdp rank 0 holds ceil(d0 / W) rows of every parameter (FSDP2 cuts dim 0 as torch.chunk does),
their gradients, AdamW's two moments of the same size and one fp32 step count per parameter; under
data parallelism every rank holds everything, whatever W."""

from __future__ import annotations

import math

import pytest

from moetrain.models import build_lm
from moetrain.parallel import memory

PRESET, OVERRIDES = "qwen3_moe_tiny", {"depth": 1}


def by_hand(world: int) -> tuple[int, int]:
    """(parameter bytes on rank 0 under fsdp at `world` ranks, number of parameters)."""
    model = build_lm(PRESET, max_seq_len=16, **OVERRIDES)
    total = 0
    for param in model.parameters():
        rows = param.shape[0]
        total += math.ceil(rows / world) * (param.numel() // rows) * param.element_size()
    return total, len(list(model.parameters()))


@pytest.fixture(scope="module")
def table():
    return memory.run([1, 2], ["data", "fsdp"], PRESET, batch=1, seq_len=16, steps=1, overrides=OVERRIDES,
                      backend="gloo")


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp_holds_one_wth_of_the_state(table, world):
    params, count = by_hand(world)
    figures = table[(world, "fsdp")]
    assert figures["params"] == params and figures["grads"] == params
    assert figures["optimizer"] == 2 * params + 4 * count  # exp_avg, exp_avg_sq, an fp32 step each
    assert figures["total"] == 4 * params + 4 * count


def test_data_parallel_holds_everything(table):
    full, count = by_hand(1)
    assert table[(1, "data")]["total"] == table[(2, "data")]["total"] == 4 * full + 4 * count
    assert table[(2, "fsdp")]["total"] < 0.6 * table[(2, "data")]["total"]
    text = memory.format_table(table)
    assert "| fsdp | 2 |" in text and "peak: CPU peak RSS growth" in text


def test_cpu_offload_keeps_the_state_sizes():
    """--cpu-offload moves the state to host memory; its size per rank is the same (one rank here:
    on a CPU the offload only changes where FSDP keeps what it already keeps there)."""
    offloaded = memory.run([1], ["fsdp"], PRESET, batch=1, seq_len=16, steps=1, overrides=OVERRIDES, backend="gloo",
                           settings={"cpu_offload": True})
    params, count = by_hand(1)
    assert offloaded[(1, "fsdp")]["total"] == 4 * params + 4 * count


def test_bad_arguments_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        memory.main(["--preset", "nope"])
    assert exit_info.value.code == 2 and "--preset must be one of" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        memory.main(["--steps", "0"])
    assert exit_info.value.code == 2 and "--steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        memory.main(["--cpu-offload", "--strategies", "data", "fsdp"])
    assert exit_info.value.code == 2
    assert "--cpu-offload applies to the fsdp strategies, not data: add --strategies fsdp fsdp_expert" in \
        capsys.readouterr().err


def test_a_killed_worker_is_one_line(monkeypatch):
    """A worker the kernel kills (a model whose offloaded state outgrows host memory) ends the tool
    with one line that says so, not a traceback."""
    from moetrain.parallel import launch

    killed = launch.WorkerExit(rank=0, pid=123, exitcode=-9)

    def run(*args, **kwargs):
        raise launch.WorkerFailed(killed, [killed], 60.0)

    monkeypatch.setattr(memory, "run", run)
    with pytest.raises(SystemExit) as exit_info:
        memory.main(["--world-sizes", "1", "--strategies", "fsdp", "--cpu-offload"])
    assert exit_info.value.code == ("python -m moetrain.parallel.memory: worker rank 0 (pid 123) was killed by "
                                    "SIGKILL (out of host memory? the kernel's OOM killer sends it)")
