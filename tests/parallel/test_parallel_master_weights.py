"""bf16 parameters without master weights (optim.master_weights=false) on 2 ranks (Gloo, CPU): the
stochastic rounding's bits keep data-parallel replicas equal bit for bit, under ZeRO-1 as well, and
give each rank's experts bits of their own under expert parallelism.

Each rank trains the same tiny language model (bf16 parameters, 3 steps of AdamW whose updates are
rounded stochastically) on its own half of the batch, then saves its parameters and the optimizer's
rounding keys. A replica whose bits came from anything rank-dependent would differ from the other
rank's after the first step (the test that would catch it: torch's generator seeded by rank, or keys
counted over the ZeRO-narrowed groups)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetrain.config import LoggerConfig, OptimConfig, ParallelConfig, ParamDtype, TrainerConfig
from moetrain.data.text import synthetic_lm
from moetrain.models import build_lm
from moetrain.moe import is_expert_param
from moetrain.parallel import spawn
from moetrain.parallel.processes import Distributed
from moetrain.train import Trainer, seed_everything

WORLD = 2
LAYOUTS = {"data": dict(strategy="data"), "data_zero": dict(strategy="data", zero=True),
           "expert": dict(strategy="expert")}


def _trainer(run_dir: Path, layout: dict) -> Trainer:
    seed_everything(0)
    model = build_lm("qwen3_moe_tiny", vocab_size=64, dim=32, depth=2, max_seq_len=16)
    data = synthetic_lm(vocab_size=64, seq_len=16, train_size=64, eval_size=8, batch_size=4 // WORLD,
                        eval_batch_size=4)
    trainer = TrainerConfig(max_steps=3, eval_every=0, eval_batches=1, checkpoint_every=0, keep_checkpoints=0,
                            progress_bar=False, param_dtype=ParamDtype.bfloat16)
    optim = OptimConfig(lr=3e-3, warmup_steps=0, moment_dtype=ParamDtype.bfloat16, master_weights=False)
    return Trainer(model, data, trainer=trainer, optim=optim, logger=LoggerConfig(tensorboard=False, log_every=1),
                   run_dir=run_dir, seed=0, run_config={"model": {"name": "tiny"}},
                   processes=Distributed(ParallelConfig(nproc_per_node=WORLD, **layout)))


def worker(rank: int, world_size: int, out_dir: str) -> None:
    out = Path(out_dir)
    results = {}
    for name, layout in LAYOUTS.items():
        trainer = _trainer(out / name, layout)
        before = {key: p.detach().clone() for key, p in trainer.model.named_parameters()}
        trainer.fit()
        inner = trainer.optimizer.optimizer  # the rounding optimizer inside DistributedOptimizer
        names = {p: key for key, p in trainer.model.named_parameters()}
        results[name] = dict(
            before=before,
            after={key: p.detach().clone() for key, p in trainer.model.named_parameters()},
            keys={names[p]: key for p, key in inner.rounding_keys.items()},
            experts=[key for key, p in trainer.model.named_parameters() if is_expert_param(p)],
            owned=[names[p] for group in inner.param_groups for p in group["params"]],
        )
    torch.save(results, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("masterless")
    spawn(worker, WORLD, args=(str(out),), backend="gloo")
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replicas_stay_equal_bit_for_bit(ranks, layout):
    first, second = ranks[0][layout], ranks[1][layout]
    replicated = [name for name in first["after"] if name not in first["experts"]]
    assert replicated and first["after"][replicated[0]].dtype == torch.bfloat16
    for name in replicated:
        assert torch.equal(first["after"][name], second["after"][name]), name
    # the run trained: every bf16 weight moved (a replica that never stepped would be equal too)
    moved = [name for name in replicated if first["after"][name].dtype == torch.bfloat16]
    assert moved and all(not torch.equal(first["before"][name], first["after"][name]) for name in moved)
    if layout == "data_zero":  # each rank stepped only its own share: the equality came through the broadcast
        assert set(first["owned"]).isdisjoint(second["owned"])
        assert set(first["owned"]) | set(second["owned"]) == set(first["after"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rounding_keys_are_the_parameters_places_and_experts_get_their_own(ranks, layout):
    # the places among the parameters the optimizer was built with: one key each, 0 .. n-1 on data
    places = ranks[0]["data"]["keys"]
    count = len(places)
    assert sorted(places.values()) == list(range(count))
    for rank in range(WORLD):
        result = ranks[rank][layout]
        assert len(set(result["keys"].values())) == count  # distinct on each rank
        for name, key in result["keys"].items():
            if layout == "expert" and name in result["experts"]:
                # offset by the rank's first expert (8 of qwen3_moe_tiny's 16 on each of the 2 ranks)
                assert key == places[name] + count * (1 + 8 * rank), name
            else:  # shared parameters: their place, on every rank, narrowed by ZeRO-1 or not
                assert key == places[name], name
    if layout == "expert":
        experts = ranks[0]["expert"]["experts"]
        assert experts and all(ranks[0]["expert"]["keys"][name] != ranks[1]["expert"]["keys"][name]
                               for name in experts)
