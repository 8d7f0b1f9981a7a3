"""Every parallel layout trains like one process (Gloo, CPU, fp32): data, expert, fsdp (FSDP2) and
fsdp_expert (experts placed by expert parallelism, sharded over their replicas by FSDP2), on 1, 2
and 4 ranks, each without activation checkpointing and with it (selective and full), give the
losses, aux losses and gradient norms of one process that sees the same items, step by step for
STEPS = 20 steps (<= 1e-5 relative); activation checkpointing changes no number at all (bit-identical
to the same layout and world size without it).

The model is a small MoE ViT with 2 experts in each of its 2 blocks (on 4 ranks each expert has 2
replicas) behind a sigmoid gate whose bias moves, dropless routing, and the global-batch balance
loss and a z-loss in the loss (both equal the one-process losses when every rank has as many
tokens). Each world size is spawned once and runs every combination. The comparison can fail: the
learning rate keeps the model moving (a run whose learning rate is 1% off leaves the tolerance at
every step), and every rank routes tokens to both experts, so expert parallelism moves rows between
ranks. The spawned ranks also check how long expert parallelism's process groups wait, and that
fsdp_expert refuses the adaptive degree and the overlap it does not run.
"""

from __future__ import annotations

import os
from datetime import timedelta
from unittest import mock
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moetrain.config import (
    ActivationCheckpointing,
    Device,
    LoggerConfig,
    OptimConfig,
    ParallelConfig,
    Precision,
    SettingError,
    TrainerConfig,
)
from moetrain.data import synthetic
from moetrain.models import VisionMoE
from moetrain.parallel import spawn
from moetrain.parallel.expert import host_group, set_adaptive_r
from moetrain.parallel.fsdp import whole_world_mesh
from moetrain.parallel.layout import ExpertLayout, collective_timeout
from moetrain.parallel.processes import Distributed
from moetrain.train import Trainer, seed_everything

STEPS = 20
GLOBAL_BATCH = 8
LR = 1e-2
TOLERANCE = 1e-5  # relative, fp32
LAYOUTS = ("data", "expert", "fsdp", "fsdp_expert")
CHECKPOINTING = ("none", "selective", "full")
RUNS = [(layout, checkpointing) for layout in LAYOUTS for checkpointing in CHECKPOINTING]
# The layouts whose recomputation 4 ranks also run: 2 experts over 4 ranks are replicated (expert) or
# on a 2-D mesh (fsdp_expert), unlike on 2 ranks; data and fsdp recompute alike at any world size and
# are checked on 2 ranks (4 ranks share 2 cores in CI, where each run costs about 7 s).
RECOMPUTED_ON_4_RANKS = ("expert", "fsdp_expert")


def runs_on(world_size: int) -> list[tuple[str, str]]:
    return [(layout, checkpointing) for layout, checkpointing in RUNS
            if world_size <= 2 or checkpointing == "none" or layout in RECOMPUTED_ON_4_RANKS]
FP8_LAYOUTS = ("expert", "fsdp_expert")  # FP8 expert GEMMs (emulated on the CPU) with the experts placed
WORLD_TIMEOUT_S = 240  # the spawned ranks' collective timeout; torch gives a new Gloo group 1800 s


def tiny_model() -> VisionMoE:
    routing = dict(gate="sigmoid", top_k=1, capacity_factor=0.0, balance_loss_weight=0.1, balance_loss="global_batch",
                   z_loss_weight=0.01, gate_kwargs={"bias_update_rate": 0.05})
    return VisionMoE(image_size=8, in_channels=3, patch_size=4, num_classes=4, dim=16, depth=2, num_heads=2,
                     num_experts=2, expert_hidden_size=16, moe_every=1, moe_kwargs=routing)


def tiny_trainer(run_dir: Path, world_size: int = 1, strategy=None, max_steps: int = STEPS,
                 checkpointing: str = "none", lr: float = LR, **trainer_settings) -> Trainer:
    """Batch GLOBAL_BATCH / world_size per rank: together the ranks see one process's batches. A constant
    learning rate: a run stopped at step N and resumed follows the same schedule as one never stopped."""
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(0)
    model = tiny_model()
    data = synthetic(num_classes=4, image_size=8, train_size=64, eval_size=16, batch_size=GLOBAL_BATCH // world_size,
                     eval_batch_size=8)
    settings = dict(max_steps=max_steps, eval_every=0, eval_batches=1, checkpoint_every=0, keep_checkpoints=0,
                    progress_bar=False, device=Device.cpu,
                    activation_checkpointing=ActivationCheckpointing(checkpointing))
    settings.update(trainer_settings)
    optim = OptimConfig(lr=lr, warmup_steps=0, min_lr_ratio=1.0)
    return Trainer(model, data, trainer=TrainerConfig(**settings), optim=optim,
                   logger=LoggerConfig(tensorboard=False, log_every=max_steps), run_dir=run_dir, seed=0,
                   run_config={"model": {"name": "tiny"}}, processes=strategy)


def record_steps(trainer: Trainer, loads: list | None = None) -> list[tuple[float, float, float]]:
    """(loss, aux loss, grad norm) of every step the trainer takes; with `loads`, also this rank's
    tokens per expert of each MoE layer at every step."""
    steps = []
    take = trainer._train_step

    def recording():
        record = take().read()
        steps.append((record.loss, record.aux, record.grad_norm))
        if loads is not None:
            loads.append([layer.stats.tokens_per_expert.tolist() for layer in trainer.moe_layers.values()])
        return record

    trainer._train_step = recording
    return steps


def assert_close(got: list, want: list, first_step: int = 1) -> None:
    """Step by step, loss, aux loss and gradient norm within TOLERANCE of the reference's."""
    assert len(got) == len(want)
    for step, (got_step, want_step) in enumerate(zip(got, want), start=first_step):
        for name, a, b in zip(("loss", "aux loss", "grad norm"), got_step, want_step):
            assert abs(a - b) <= TOLERANCE * abs(b), (step, name, a, b)


def layouts_worker(rank: int, world_size: int, out_dir: str) -> None:
    results, loads, timeouts = {}, [], group_timeouts()
    for layout, checkpointing in runs_on(world_size):
        strategy = Distributed(ParallelConfig(nproc_per_node=world_size, strategy=layout))
        trainer = tiny_trainer(Path(out_dir) / f"{layout}-{checkpointing}", world_size, strategy,
                               checkpointing=checkpointing)
        steps = record_steps(trainer, loads if (layout, checkpointing) == ("expert", "none") else None)
        trainer.fit()
        results[(layout, checkpointing)] = steps
    for layout in FP8_LAYOUTS:
        strategy = Distributed(ParallelConfig(nproc_per_node=world_size, strategy=layout))
        trainer = tiny_trainer(Path(out_dir) / f"{layout}-fp8", world_size, strategy, precision=Precision.fp8)
        results[(layout, "fp8")] = record_steps(trainer)
        trainer.fit()
    # The last run is fsdp_expert's: its expert mesh's groups (on 2 ranks the expert dimension is the world).
    for name in ("replica", "expert"):
        timeouts[f"{name} mesh"] = collective_timeout(strategy.meshes[2][name].get_group())
    # Each expert's replicas really split it: this rank stores 1/replicas of each expert parameter.
    replicas = max(world_size // 2, 1)
    shards = {name: (param.to_local().numel(), param.numel()) for name, param in trainer.model.named_parameters()
              if ".experts." in name}
    torch.save({"steps": results, "loads": loads, "timeouts": timeouts, "shards": shards, "replicas": replicas,
                "refusals": sharded_experts_refusals(trainer.model, world_size)},
               os.path.join(out_dir, f"results{rank}.pt"))


def sharded_experts_refusals(sharded_model, world_size: int) -> list[str]:
    """What fsdp_expert says to the adaptive degree and the overlap it does not run: in the config,
    and on a sharded model."""
    messages = []
    for settings in (dict(adaptive_r=0), dict(a2a_ffn_overlap_degree=2)):
        strategy = Distributed(ParallelConfig(nproc_per_node=world_size, strategy="fsdp_expert", **settings))
        with pytest.raises(SettingError) as refused:
            strategy.build_optimizer(tiny_model(), OptimConfig())
        messages.append(str(refused.value))
    with pytest.raises(ValueError) as refused:
        set_adaptive_r(sharded_model, 0)
    messages.append(str(refused.value))
    return messages


def group_timeouts() -> dict[str, float]:
    """Seconds a collective waits in the process groups expert parallelism makes, left to inherit
    the timeout of the group they come from or told one."""
    # One expert on every rank: the expert-parallel group of r = 1 is a new group of one rank.
    inherited, told = ExpertLayout(1), ExpertLayout(1, timeout_s=100)
    # A group of another backend than "gloo" (as NCCL is), for which host_group makes a Gloo group.
    not_gloo = dist.new_group(backend="cpu:gloo", timeout=timedelta(seconds=150))
    # FSDP's mesh of the whole world: the world's group, and on a machine with CUDA (where torch
    # would make a new group with its default timeout) a group that waits as told.
    world = whole_world_mesh("cpu")
    with mock.patch("torch.cuda.is_available", return_value=True):
        world_with_cuda = whole_world_mesh("cpu", 120)
    return {"layout": collective_timeout(inherited.expert_group(1)),
            "layout told": collective_timeout(told.expert_group(1)),
            "host": collective_timeout(host_group(not_gloo)),
            "host told": collective_timeout(host_group(not_gloo, 100)),
            "world mesh is the world": world.get_group() == dist.group.WORLD,
            "world mesh with CUDA": collective_timeout(world_with_cuda.get_group())}


def one_process_runs(run_dir: Path) -> dict[str, list]:
    runs = {}
    for checkpointing in CHECKPOINTING:
        trainer = tiny_trainer(run_dir / checkpointing, checkpointing=checkpointing)
        runs[checkpointing] = record_steps(trainer)
        trainer.fit()
        bias = trainer.model.blocks[0].ffn.gate.expert_bias
        assert bias.abs().sum() > 0  # the gate's bias moved: comparing it through the losses is not vacuous
    trainer = tiny_trainer(run_dir / "fp8", precision=Precision.fp8)
    runs["fp8"] = record_steps(trainer)
    trainer.fit()
    return runs


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return one_process_runs(tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def ranks(request, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp(f"layouts{request.param}")
    spawn(layouts_worker, request.param, args=(str(out_dir),), backend="gloo", timeout_s=WORLD_TIMEOUT_S)
    return [torch.load(out_dir / f"results{rank}.pt") for rank in range(request.param)]


@pytest.mark.parametrize("layout, checkpointing", RUNS)
def test_layout_trains_like_one_process(ranks, one_process, layout, checkpointing):
    if (layout, checkpointing) not in runs_on(len(ranks)):
        pytest.skip(f"{layout} recomputes alike at any world size: checked on 2 ranks")
    for results in ranks:
        assert_close(results["steps"][(layout, checkpointing)], one_process["none"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_activation_checkpointing_changes_no_number(ranks, layout):
    if (layout, "full") not in runs_on(len(ranks)):
        pytest.skip(f"{layout} recomputes alike at any world size: checked on 2 ranks")
    for results in ranks:
        without = results["steps"][(layout, "none")]
        for checkpointing in CHECKPOINTING[1:]:
            assert results["steps"][(layout, checkpointing)] == without, checkpointing


@pytest.mark.parametrize("layout", FP8_LAYOUTS)
def test_fp8_with_placed_experts_trains_like_one_process(ranks, one_process, layout):
    """trainer.precision=fp8 (emulated on the CPU) with the experts placed by expert parallelism,
    FSDP-sharded or not. The E4M3 rows travel (tests/precision/test_fp8_exchange.py), so each expert's forward
    GEMM multiplies the operands it multiplies in one process: step 1's loss and aux loss match one
    process's fp8 run within TOLERANCE. Its gradient norm is within 1e-3 (measured: 2-4e-4): the
    first GEMM's weight gradient comes from the received FP8 rows (double quantization), and on 4
    ranks an expert's rows are split between its 2 replicas, whose weight-gradient scales each span
    their half. The FP8 GEMMs really ran: one process's fp8 gradient norm differs from its fp32 one
    by more than that."""
    fp8, full = one_process["fp8"], one_process["none"]
    assert abs(fp8[0][2] - full[0][2]) > 1e-3 * abs(full[0][2]), (fp8[0], full[0])
    for results in ranks:
        got = results["steps"][(layout, "fp8")]
        assert abs(got[0][0] - fp8[0][0]) <= TOLERANCE * abs(fp8[0][0]), (got[0], fp8[0])
        assert abs(got[0][1] - fp8[0][1]) <= TOLERANCE * abs(fp8[0][1]), (got[0], fp8[0])
        assert abs(got[0][2] - fp8[0][2]) <= 1e-3 * abs(fp8[0][2]), (got[0], fp8[0])


def test_one_process_activation_checkpointing_changes_no_number(one_process):
    for checkpointing in CHECKPOINTING[1:]:
        assert one_process[checkpointing] == one_process["none"], checkpointing


def test_every_rank_sends_tokens_to_both_experts(ranks):
    """Each rank holds one expert (2 ranks) or one replica of one (4 ranks): over the run, every rank
    routes tokens to both experts of both layers, so rows leave it for another rank."""
    for results in ranks:
        assert len(results["loads"]) == STEPS
        for layer, tokens_per_expert in enumerate(zip(*results["loads"])):
            assert min(map(sum, zip(*tokens_per_expert))) > 0, (layer, tokens_per_expert)


def test_fsdp_expert_shards_each_expert_over_its_replicas(ranks):
    """fsdp_expert's experts are FSDP-sharded over their replicas: with 2 experts on 4 ranks each
    rank stores half of its expert's parameters (not all on one replica and none on the other)."""
    for rank_results in ranks:
        replicas = rank_results["replicas"]
        assert rank_results["shards"]
        for name, (local, whole) in rank_results["shards"].items():
            assert local * replicas == whole, (name, local, whole, replicas)


def test_expert_parallel_groups_wait_as_configured(ranks):
    """The groups made for expert parallelism, and fsdp_expert's expert mesh, wait as long as the
    group they come from (the world's: parallel.timeout_s), or as long as they are told; never
    torch's default for new groups."""
    for results in ranks:
        assert results["timeouts"] == {"layout": WORLD_TIMEOUT_S, "layout told": 100, "host": 150, "host told": 100,
                                       "world mesh is the world": True, "world mesh with CUDA": 120,
                                       "replica mesh": WORLD_TIMEOUT_S, "expert mesh": WORLD_TIMEOUT_S}


def test_fsdp_expert_refuses_the_adaptive_degree_and_the_overlap(ranks):
    """parallel.strategy=fsdp_expert runs r = 1 without overlap: other settings are refused, in the
    config and on a sharded model, never silently run as r = 1."""
    for results in ranks:
        from_config_r, from_config_overlap, on_the_model = results["refusals"]
        assert "adaptive_r=1 and a2a_ffn_overlap_degree=1" in from_config_r and "strategy=expert" in from_config_r
        assert from_config_overlap == from_config_r
        assert on_the_model.startswith("adaptive_r=0, a2a_ffn_overlap_degree=1: experts sharded by FSDP")


def test_the_comparison_can_fail(tmp_path, one_process):
    """The model keeps moving for all STEPS steps: in a run whose learning rate is 1% off, every step
    after the first (whose numbers come before any update) leaves the tolerance by far."""
    trainer = tiny_trainer(tmp_path, lr=LR * 1.01)
    steps = record_steps(trainer)
    trainer.fit()
    reference = one_process["none"]
    assert steps[0] == reference[0]
    for step, (got, want) in enumerate(zip(steps[1:], reference[1:]), start=2):
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        assert worst > 10 * TOLERANCE, (step, got, want)


def offload_worker(rank: int, world_size: int, out_dir: str, device: str) -> None:
    results, out = {}, Path(out_dir)
    device = Device(device)
    offloaded = dict(strategy="fsdp", cpu_offload=True)
    for name, settings, steps in (("state on the device", dict(strategy="fsdp"), 5), ("state offloaded", offloaded, 5),
                                  ("offloaded, checkpointed", offloaded, 3)):
        trainer = tiny_trainer(out / name.replace(" ", "_"), world_size,
                               Distributed(ParallelConfig(nproc_per_node=world_size, **settings)), max_steps=steps,
                               device=device, precision=Precision.fp32, async_checkpoint=name.endswith("checkpointed"))
        results[name] = record_steps(trainer)
        trainer.fit()
    trainer = tiny_trainer(out / "resumed", world_size, Distributed(ParallelConfig(nproc_per_node=world_size,
                                                                                   **offloaded)),
                           max_steps=5, device=device, precision=Precision.fp32,
                           resume=str(out / "offloaded,_checkpointed" / "checkpoints" / "step_00000003"))
    results["offloaded, resumed at step 3"] = record_steps(trainer)
    trainer.fit()
    torch.save(results, out / f"offload{rank}.pt")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_cpu_offload_trains_like_the_state_on_the_device(tmp_path, device):
    """parallel.cpu_offload=true takes the steps of the same fsdp run with its state on the device
    (the optimizer steps on the CPU instead), and its sharded checkpoint (written asynchronously)
    resumes on the curve. On a GPU under NCCL the gradients wait in host memory while the group
    reduces CUDA tensors only (the gradient norm's all-reduce failed there)."""
    spawn(offload_worker, 1, args=(str(tmp_path), device), backend="nccl" if device == "cuda" else "gloo")
    results = torch.load(tmp_path / "offload0.pt")
    assert_close(results["state offloaded"], results["state on the device"])
    assert_close(results["offloaded, checkpointed"], results["state offloaded"][:3])
    assert_close(results["offloaded, resumed at step 3"], results["state offloaded"][3:], first_step=4)
