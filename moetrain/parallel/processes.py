"""The processes of a multi-process run, for moetrain's Trainer (the counterpart of train.processes.SingleProcess).

    processes = Distributed(ParallelConfig(nproc_per_node=4, strategy="expert"))  # after init_distributed
    Trainer(model, data, ..., processes=processes).fit()

Four parallel strategies (ParallelConfig.strategy):
  data          every rank holds the whole model; DistributedOptimizer averages the gradients;
  expert        experts sharded by expert parallelism (adaptive degree and overlap of the config),
                the rest replicated; DistributedOptimizer (ZeRO-1 optional);
  fsdp          every parameter sharded over all ranks by FSDP2 (moetrain/parallel/fsdp.py);
  fsdp_expert   experts placed by expert parallelism and sharded over their replicas, the rest by
                FSDP2 over all ranks.
Every strategy clips by the global gradient norm (each expert counted once) and updates the sigmoid
gates' bias from the load summed over ranks.

Checkpoints: data and expert write one file per rank (moetrain/parallel/checkpoint.py); fsdp and
fsdp_expert write a sharded DCP checkpoint (moetrain/parallel/sharded_checkpoint.py, optionally
asynchronously). Either kind resumes under any strategy and at any number of ranks, with no
conversion step: DCP reads each rank's part of the global tensors, and per-rank files of another
world size or strategy are merged and cut again in memory.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from moetrain.config import OptimConfig, ParallelConfig, ParallelStrategy, SettingError
from moetrain.parallel import checkpoint as shards
from moetrain.parallel import sharded_checkpoint as sharded
from moetrain.parallel.expert import parallelize
from moetrain.parallel.fsdp import (
    device_type_of,
    expert_mesh,
    global_grad_norm,
    scale_to_norm_,
    shard_model,
    sync_router_biases_after_step,
)
from moetrain.parallel.optimizer import DistributedOptimizer
from moetrain.train import checkpoint
from moetrain.train.optim import _decays, build_optimizer

STRATEGIES = tuple(strategy.value for strategy in ParallelStrategy)
TRAINER_KEYS = ("step", "skipped_steps", "data", "config", "metrics")


class Distributed:
    def __init__(self, cfg: ParallelConfig):
        if not dist.is_initialized():
            raise RuntimeError("Distributed needs torch.distributed initialised (moetrain.parallel.launch)")
        self.cfg = cfg
        self.strategy = getattr(cfg.strategy, "value", cfg.strategy)  # a ParallelStrategy or its name
        if self.strategy not in STRATEGIES:
            raise SettingError(f"ParallelConfig.strategy must be one of {'|'.join(STRATEGIES)}, "
                               f"got {self.strategy!r}")
        self.fsdp = self.strategy.startswith("fsdp")
        self.expert_parallel = self.strategy in ("expert", "fsdp_expert")
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.is_main = self.rank == 0  # only the main process writes logs and TensorBoard
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.meshes: dict = {}
        self.async_checkpoint = False
        self.saver: sharded.Saver | None = None

    def enable_async_checkpoints(self) -> None:
        if not self.fsdp:
            raise SettingError("TrainerConfig.async_checkpoint writes sharded (DCP) checkpoints: use "
                               "ParallelConfig.strategy='fsdp'|'fsdp_expert' (ParallelConfig.strategy="
                               f"{self.strategy!r} writes one file per rank)")
        self.async_checkpoint = True

    def build_optimizer(self, model: nn.Module, cfg: OptimConfig, seed: int = 0) -> torch.optim.Optimizer:
        self.model = model
        try:
            if self.fsdp:
                if self.cfg.zero:
                    raise ValueError("zero applies to strategy=data|expert: FSDP shards the optimizer state already")
                if self.strategy == "fsdp_expert" and (self.cfg.adaptive_r, self.cfg.a2a_ffn_overlap_degree) != (1, 1):
                    raise ValueError("strategy=fsdp_expert runs adaptive_r=1 and a2a_ffn_overlap_degree=1 (FSDP shards "
                                     "the experts); the adaptive degree and the overlap need strategy=expert")
                self.meshes = shard_model(model, self.expert_parallel, self.cfg.mixed_precision, self.cfg.cpu_offload)
            elif self.expert_parallel:
                parallelize(model, self.cfg.adaptive_r, self.cfg.a2a_ffn_overlap_degree)
                self.meshes = {layer.num_experts: expert_mesh(layer.num_experts, device_type_of(model))
                               for layer in _moe_layers(model)}
        except ValueError as error:  # experts vs ranks, the degree, a combination: a setup mistake
            raise SettingError(f"ParallelConfig: {error}") from None
        if self.fsdp:
            self.optimizer = build_optimizer(model, cfg, seed)
            sync_router_biases_after_step(self.optimizer, model)
        else:
            self.optimizer = DistributedOptimizer(build_optimizer(model, cfg, seed), model, zero=self.cfg.zero)
        return self.optimizer

    def reduce_gradients(self, model: nn.Module) -> None:
        if not self.fsdp:  # FSDP reduce-scatters in backward
            self.optimizer.reduce_gradients()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The global norm (each expert counted once), the same on every rank; clips to max_norm."""
        if self.fsdp:
            return global_grad_norm(list(model.parameters()), max_norm)
        return self.optimizer.clip_grad_norm_(max_norm)

    def clip_grads_with_norm_(self, model: nn.Module, max_norm: float, total_norm: torch.Tensor) -> None:
        """Scales this rank's gradients as clip_grad_norm_ would, given the global norm it returned."""
        if self.fsdp:
            scale_to_norm_(list(model.parameters()), max_norm, total_norm)
        else:
            self.optimizer.clip_grads_with_norm_(max_norm, total_norm)

    def mean_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        total = values.detach().clone()
        dist.all_reduce(total)
        return total / self.world_size

    # ---- checkpoints ------------------------------------------------------------------------
    def _named_state(self) -> dict:
        """Model and optimizer state by parameter name, this rank's tensors (experts: its rows)."""
        if self.fsdp:
            return {"model": get_model_state_dict(self.model),
                    "optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def _metadata(self) -> dict:
        meta = shards.parallel_metadata(self.model, self.world_size, self.rank)
        return {**meta, "strategy": self.strategy}

    def save_checkpoint(self, state: dict, run_dir: Path, step: int, keep: int) -> Path:
        directory = Path(run_dir) / checkpoint.CHECKPOINT_DIR / f"step_{step:08d}"

        def prune():
            checkpoint.prune(directory.parent, keep)

        if not self.fsdp:  # checkpoints/step_<step>/rank<r>-of-<world>.pt
            directory.mkdir(parents=True, exist_ok=True)
            state = {**state, "moe_parallel": self._metadata()}
            shards.save_shard(state, str(directory))  # returns once every rank's file and SHA256SUMS are written
            if self.is_main:
                prune()
            return directory
        if self.saver is None:
            self.saver = sharded.Saver(self.async_checkpoint)
        self.saver.finish()  # the previous save completes (and prunes) before this one starts
        stored = sharded.global_views(self._named_state(), sharded.expert_views(self.model, self.meshes))
        stored["trainer"] = sharded.blob({**{key: state[key] for key in TRAINER_KEYS},
                                          "moe_parallel": self._metadata()})
        stored[sharded.rng_key(self.rank)] = sharded.blob(state["rng"])
        self.saver.save(stored, directory, on_complete=prune)
        return directory

    def finish_checkpoints(self) -> None:
        """The asynchronous save in flight, if any, completes (SHA256SUMS written)."""
        if self.saver is not None:
            self.saver.finish()

    def load_checkpoint(self, path: Path) -> dict:
        """The state the trainer loads: model and optimizer are loaded here already (under any strategy),
        so their entries are this rank's current state dicts."""
        path = Path(path)
        if not path.is_dir():
            full = checkpoint.load(path)  # a one-process checkpoint: the whole model
            full["moe_parallel"] = {**shards.parallel_metadata(self.model, 1, 0), "expert_parallel": False}
            full["optimizer"] = _named_optimizer_state(full["optimizer"], self.model)
            return self._load_full(full)
        if sharded.is_sharded_checkpoint(path):
            return self._load_sharded(path)
        names = sorted(name.name for name in path.glob("rank*-of-*.pt"))
        saved_world = int(names[0].split("-of-")[1][:-3]) if names else 0
        if saved_world == self.world_size and not self.fsdp:
            state = checkpoint.load(Path(shards.shard_path(str(path), self.rank, self.world_size)))
            if bool(state["moe_parallel"]["expert_parallel"]) == self.expert_parallel:
                return state
        # Another world size or strategy: every rank's file, merged and cut for this strategy in memory.
        return self._load_full(shards.consolidate(shards.load_shards(str(path))))

    def _load_full(self, full: dict) -> dict:
        """A world-size-1 checkpoint (named optimizer state) into this strategy's placement."""
        mine = shards.reshard(full, self.world_size, self.expert_parallel)[self.rank]
        if not self.fsdp:
            return mine
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, mine["model"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, mine["optimizer"], options=options)
        return {**mine, **self._current(mine["optimizer"]["param_groups"])}

    def _current(self, saved_groups: list[dict]) -> dict:
        """This rank's state dicts as loaded; the saved hyperparameters (the trainer logs a changed lr)."""
        optimizer = self.optimizer.state_dict()
        for group, saved in zip(optimizer["param_groups"], saved_groups):
            group.update({key: value for key, value in saved.items() if key != "params"})
        return {"model": self.model.state_dict(), "optimizer": optimizer}

    def _load_sharded(self, path: Path) -> dict:
        problem = None
        try:
            sharded.verify(path, self.rank, self.world_size)
        except checkpoint.CheckpointError as error:
            problem = str(error)
        failed = [None] * self.world_size
        dist.all_gather_object(failed, problem)  # nobody starts reading while another rank found damage
        problem = problem or next((f"rank {rank}: {message}" for rank, message in enumerate(failed) if message), None)
        if problem:
            raise checkpoint.CheckpointError(problem)
        if not self.fsdp:
            _init_optimizer_state(self.optimizer)
        named = self._named_state()
        request = sharded.global_views(named, sharded.expert_views(self.model, self.meshes))
        request["trainer"] = sharded.blob(None)
        rng_key = sharded.rng_to_load(path, self.rank)
        request[rng_key] = sharded.blob(None)
        loaded = sharded.load(request, path)
        saved_groups = loaded["optimizer"]["param_groups"]
        # The global views share storage with `named`: its tensors hold the loaded values now.
        if self.fsdp:
            set_model_state_dict(self.model, named["model"])
            set_optimizer_state_dict(self.model, self.optimizer, named["optimizer"])
        else:
            self.model.load_state_dict(named["model"])
            self.optimizer.load_state_dict({**named["optimizer"], "param_groups": [
                {**saved, "params": own["params"]}
                for saved, own in zip(saved_groups, named["optimizer"]["param_groups"])]})
        return {**loaded["trainer"], "rng": loaded[rng_key],
                **self._current(saved_groups)}


def _moe_layers(model: nn.Module):
    from moetrain.moe import moe_layers

    return moe_layers(model)


def _named_optimizer_state(indexed: dict, model: nn.Module) -> dict:
    """A one-process optimizer's state_dict (parameters by index, grouped as train.optim.build_optimizer
    groups them: decayed, then not) with the parameters named as in the model."""
    trained = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    groups = [[name for name, param in trained if _decays(param)],
              [name for name, param in trained if not _decays(param)]]
    if [len(group["params"]) for group in indexed["param_groups"]] != [len(group) for group in groups]:
        raise checkpoint.CheckpointError("the checkpoint's optimizer groups do not match this model's parameters: "
                                         "it was written for another model")
    names = {index: name for group, saved in zip(groups, indexed["param_groups"])
             for index, name in zip(saved["params"], group)}
    return {"state": {names[index]: entry for index, entry in indexed["state"].items()},
            "param_groups": [{**saved, "params": group} for group, saved in zip(groups, indexed["param_groups"])]}


def _init_optimizer_state(optimizer) -> None:
    """Allocate the optimizer's state (one step with zero gradients and lr 0), so DCP can read
    into it; DCP's state_dict helpers do the same for FSDP."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)
