"""Multi-process checks on CPU with Gloo: communication primitives, every parallel strategy, the
distributed optimizer and checkpoint resharding, each against a single-process reference.

The workers are benchmarks/parallel_check.py (also a command, for NCCL on GPUs): each rank compares
every primitive with a one-process emulation and trains a small MoE model five steps next to a
single-process reference. Spawning is slow on a small machine, so each world size spawns once;
the tests below read the workers' measurements and checkpoints.
"""

from __future__ import annotations

import os

import pytest
import torch

from moetrain import MoELayer
from benchmarks import parallel_check
from moetrain.parallel import spawn
from moetrain.parallel import checkpoint as ckpt

TOLERANCE = dict(atol=2e-5, rtol=1e-4)
# Every run on 2 ranks; on 4 ranks the ones with replicated experts (r = 0, 1, 2; FSDP over the
# replicas), to save time.
RUNS = {2: ("dp", "ep", "replicas", "fsdp"), 4: ("replicas", "fsdp_ep")}


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def world(request, tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp(f"dist{request.param}"))
    spawn(parallel_check.worker, request.param, args=(out_dir, RUNS[request.param]), backend="gloo")
    results = [torch.load(os.path.join(out_dir, f"results{rank}.pt"), weights_only=False)
               for rank in range(request.param)]
    return request.param, out_dir, results


# ---------------------------------------------------------------------- the tests


def test_primitives_match_emulation(world):
    _, _, results = world
    for rank_results in results:
        primitives = {name for name in rank_results if name.startswith("primitive:")}
        assert {"primitive:zero_gather", "primitive:all_to_all(1,2)", "primitive:all_to_all_single(uneven)"} <= primitives
        assert not {name: value for name, value in parallel_check.failures(rank_results).items() if name in primitives}


def test_strategies_train_like_single_process(world):
    size, _, results = world
    for rank_results in results:
        for run in RUNS[size]:
            measured = {name for name in rank_results if name.startswith(f"{run}:")}
            assert len(measured) == (5 if run in parallel_check.FSDP_RUNS else 6), measured
        assert not parallel_check.failures(rank_results)


def test_router_bias_moved(world):
    size, out_dir, _ = world
    for run in set(RUNS[size]) - set(parallel_check.FSDP_RUNS):
        bias = torch.load(os.path.join(out_dir, run, "reference.pt"), weights_only=False)["model"]["moe2.gate.expert_bias"]
        if bias.numel() > 1:  # one expert is always balanced
            assert bias.abs().sum() > 0  # the bias comparison is not vacuous


def test_bad_setups_fail_clearly(world):
    size, _, results = world
    messages = results[0]["errors"]
    assert f"num_experts={size + 1}" in messages["experts not divisible"]
    assert "adaptive_r must be one of [0, 1, 2]" in messages["r not valid"]
    assert "adaptive_r must be one of [0, 1]" in messages["r without replicas"]


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_checkpoint_conversion_round_trips_exactly(world, tmp_path):
    size, out_dir, _ = world
    source = os.path.join(out_dir, "replicas")
    shards = ckpt.load_shards(source)
    other = 4 if size == 2 else 2
    ckpt.convert_checkpoint(source, str(tmp_path / "other"), other)
    ckpt.main([str(tmp_path / "other"), str(tmp_path / "back"), "--world-size", str(size)])
    back = ckpt.load_shards(str(tmp_path / "back"))
    assert [shard["moe_parallel"]["world_size"] for shard in ckpt.load_shards(str(tmp_path / "other"))] == [other] * other
    assert _equal(ckpt.consolidate(back), ckpt.consolidate(shards))
    if size == 2:  # without ZeRO-1 the files themselves come back unchanged
        ep_shards = ckpt.load_shards(os.path.join(out_dir, "ep"))
        back = ckpt.convert(ckpt.convert(ep_shards, 4), 2)
        for original, converted in zip(ep_shards, back):
            assert _equal(original, converted)


@pytest.mark.parametrize("run", ["dp", "ep", "replicas"])
def test_consolidated_checkpoint_is_the_single_process_state(world, run):
    size, out_dir, _ = world
    if run not in RUNS[size]:
        pytest.skip(f"run {run} is checked on 2 ranks")
    full = ckpt.consolidate(ckpt.load_shards(os.path.join(out_dir, run)))
    reference = torch.load(os.path.join(out_dir, run, "reference.pt"), weights_only=False)
    for key, value in reference["model"].items():
        torch.testing.assert_close(full["model"][key], value, **TOLERANCE)
    # Optimizer moments of every parameter, experts gathered back to [E, ...].
    for index, name in enumerate(reference["names"]):
        for item in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(full["optimizer"]["state"][name][item],
                                       reference["optimizer"]["state"][index][item], atol=1e-5, rtol=1e-3)
    model = parallel_check.TinyMoEModel(full["moe_parallel"]["experts"]["moe1.experts.w1"])
    model.load_state_dict(full["model"])  # loads into a plain single-process model


def test_wrong_world_size_is_refused():
    shard = {"moe_parallel": {"world_size": 4}}
    ckpt.check_world_size(shard, 4)
    with pytest.raises(ValueError, match="written by 4 rank.*this run has 2.*--world-size 2"):
        ckpt.check_world_size(shard, 2)


def test_parallel_arguments_need_expert_parallelism():
    layer = MoELayer(8, 4, 16)
    with pytest.raises(ValueError, match="adaptive_r and a2a_ffn_overlap_degree need expert parallelism"):
        layer(torch.randn(5, 8), adaptive_r=1)


def test_backend_choice_is_checked():
    with pytest.raises(ValueError, match="backend must be one of"):
        spawn(parallel_check.worker, 2, backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="'nccl' is not available"):
            spawn(parallel_check.worker, 2, backend="nccl")
