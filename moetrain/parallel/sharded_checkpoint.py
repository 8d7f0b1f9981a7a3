"""Sharded checkpoints through torch.distributed.checkpoint (DCP), loadable by any parallel layout.

A step directory written here holds DCP's files (one or more __<rank>_<n>.distcp per rank and the
.metadata DCP writes once every rank's files are written) and, last, SHA256SUMS: the sha256 of
every file, written by rank 0 once the save has completed on every rank. As with per-rank
checkpoints, a directory without SHA256SUMS is incomplete and skipped.

What is saved, by name (model parameter names throughout):

    model.<name>                       every parameter and buffer as one global tensor;
    optimizer.state.<name>.<item>      the optimizer state of each parameter (exp_avg, ...);
    optimizer.param_groups             the hyperparameters (rank 0's);
    trainer                            step, data position, config, metrics (rank 0's);
    rng.<rank>                         each rank's random generators.

Tensors are saved in their global shape whatever the layout: FSDP-sharded ones are DTensors
already, and experts placed by expert parallelism (each rank holds [E/W, ...] rows of [E, ...])
are presented to DCP as DTensors over the expert mesh (moetrain.parallel.fsdp.expert_mesh),
sharded along the expert dimension and, with replicas, replicated (or FSDP-sharded) across them.
DCP then lets each rank of any other layout, world size, or a single process, read exactly the
part it holds: resuming needs no conversion step. The random generators of a rank that did not
exist in the saved run start from rank 0's.

Async saving (DCP's async_save) copies the state to host memory, returns, and writes in a
background thread over its own Gloo process group; the step becomes complete (SHA256SUMS) when
the next checkpoint starts or training ends (finish()).
"""

from __future__ import annotations

import io
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from moetrain.moe import MoELayer
from moetrain.train import checkpoint
from moetrain.train.checkpoint import MANIFEST, CheckpointError

METADATA = ".metadata"


def is_sharded_checkpoint(directory: Path) -> bool:
    """Whether `directory` is (or was being written as) a DCP checkpoint."""
    directory = Path(directory)
    return directory.is_dir() and ((directory / METADATA).exists() or any(directory.glob("*.distcp")))


# ---------------------------------------------------------------------- global views of expert tensors


def expert_views(model: nn.Module, meshes: dict[int, DeviceMesh]) -> dict[str, tuple]:
    """{parameter name: (mesh, placements, global shape)} for every expert parameter placed by
    expert parallelism: how DCP should see this rank's rows as part of the [E, ...] tensor.
    meshes: the expert mesh of each expert count (fsdp.expert_mesh)."""
    views = {}
    for name, module in model.named_modules():
        if isinstance(module, MoELayer) and module.parallel is not None:
            mesh = meshes[module.num_experts]
            # FSDP splits the replicas' copies along dim 1 (fsdp.shard_model)
            within_replicas = Shard(1) if module.parallel.experts_sharded else Replicate()
            for key, param in module.experts.named_parameters():
                # param.shape: this rank's rows (for an FSDP-sharded expert, the DTensor's whole shape)
                shape = (param.shape[0] * mesh.size(0),) + tuple(param.shape[1:])
                views[f"{name}.experts.{key}" if name else f"experts.{key}"] = (mesh, (Shard(0), within_replicas),
                                                                                torch.Size(shape))
    return views


def _global(tensor: torch.Tensor, view) -> torch.Tensor:
    """This rank's part of an expert tensor as a DTensor of the global shape (sharing its storage)."""
    if view is None or not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        return tensor
    mesh, placements, shape = view
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def global_views(state: dict, views: dict[str, tuple]) -> dict:
    """A copy of {"model": ..., "optimizer": {"state": ...}} whose expert tensors are global DTensors."""
    out = dict(state)
    out["model"] = {key: _global(value, views.get(key)) for key, value in state["model"].items()}
    if "optimizer" in state:
        out["optimizer"] = {
            "state": {name: {item: _global(value, views.get(name)) for item, value in entry.items()}
                      for name, entry in state["optimizer"]["state"].items()},
            "param_groups": state["optimizer"]["param_groups"],
        }
    return out


# ---------------------------------------------------------------------- saving


def _rank_files(directory: Path, rank: int) -> list[Path]:
    return sorted(directory.glob(f"__{rank}_*.distcp"))


class Saver:
    """Writes DCP checkpoints; at most one asynchronous save in flight. Collective: every rank."""

    def __init__(self, async_save: bool = False):
        self.async_save = async_save
        self.pending: tuple | None = None  # (future, directory, on_complete)
        # Async writes run collectives from a background thread: they get their own group.
        self.group = dist.new_group(backend="gloo") if async_save else None

    def save(self, state: dict, directory: Path, on_complete=None) -> None:
        """Write `state` (global views already) to `directory`; SHA256SUMS when complete, then
        on_complete() (rank 0's pruning). Synchronous unless async_save."""
        self.finish()
        directory = Path(directory)
        if dist.get_rank() == 0:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / MANIFEST).unlink(missing_ok=True)  # an earlier attempt's must not vouch for new files
        dist.barrier()
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(directory), process_group=self.group)
            self.pending = (future, directory, on_complete)
        else:
            dcp.save(state, checkpoint_id=str(directory))
            self._complete(directory, on_complete)

    def finish(self) -> None:
        """Wait for the save in flight, then mark it complete."""
        if self.pending is None:
            return
        future, directory, on_complete = self.pending
        self.pending = None
        (future.result() if hasattr(future, "result") else future.upload_completion.result())
        self._complete(directory, on_complete)

    @staticmethod
    def _complete(directory: Path, on_complete) -> None:
        rank = dist.get_rank()
        digests = {path.name: checkpoint.sha256_of(path) for path in _rank_files(directory, rank)}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, digests)
        if rank == 0:
            listed = {name: digest for part in everyone for name, digest in part.items()}
            listed[METADATA] = checkpoint.sha256_of(directory / METADATA)
            checkpoint.write_checksums(directory / MANIFEST, listed)
            if on_complete is not None:
                on_complete()
        dist.barrier()


# ---------------------------------------------------------------------- loading


def verify(directory: Path, rank: int = 0, world_size: int = 1) -> None:
    """Check the files this rank is asked to (every world_size-th listed one) against SHA256SUMS."""
    directory = Path(directory)
    checkpoint.check_complete(directory)
    listed = sorted(checkpoint.read_checksums(directory / MANIFEST))
    if METADATA not in listed:
        raise CheckpointError(f"{directory}/{MANIFEST} does not list {METADATA}: the checkpoint is damaged")
    for name in listed[rank::world_size]:
        checkpoint.verify(directory / name)


def saved_keys(directory: Path) -> set[str]:
    return set(FileSystemReader(str(directory)).read_metadata().state_dict_metadata)


def load(state: dict, directory: Path, distributed: bool = True) -> dict:
    """Fill `state` (global views; its tensors are written in place) from `directory`. Optimizer
    entries the checkpoint lacks (parameters that never had a gradient when it was saved) are left
    as they are; anything else missing is an error. Returns the filled dict (objects replaced)."""
    keys = saved_keys(directory)
    request = dict(state)
    if "optimizer" in state:
        request["optimizer"] = dict(state["optimizer"])
        request["optimizer"]["state"] = {
            name: {item: value for item, value in entry.items() if f"optimizer.state.{name}.{item}" in keys}
            for name, entry in state["optimizer"]["state"].items()}
    missing = sorted(key for key in request["model"] if f"model.{key}" not in keys)
    if missing:
        raise CheckpointError(f"{directory} has no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: "
                              "it was written for another model")
    try:
        dcp.load(request, checkpoint_id=str(directory), no_dist=not distributed)
    except Exception as error:  # DCP's own errors wrap the failing rank's: one line saying which checkpoint
        if isinstance(error, CheckpointError):
            raise
        message = " ".join(str(error).split())[:300]
        raise CheckpointError(f"{directory} does not load ({type(error).__name__}: {message})") from None
    return request


def named_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """A plain (one-process) optimizer's state by parameter name, its state allocated first (one
    step with zero gradients and lr 0, as DCP's own state_dict helpers do) so DCP can read into it."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)
    names = {param: name for name, param in model.named_parameters()}
    return {
        "state": {names[param]: optimizer.state[param] for group in optimizer.param_groups for param in group["params"]
                  if param in optimizer.state},
        "param_groups": [{**{key: value for key, value in group.items() if key != "params"},
                          "params": [names[param] for param in group["params"]]} for group in optimizer.param_groups],
    }


def blob(value) -> io.BytesIO:
    """An object DCP stores as one opaque item (loading gives the object back), whatever its
    structure: the trainer's extras and random states must not become DCP keys of their own."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def unblob(value):
    """The object a blob() held, once loaded (DCP reads a blob back into the stream it is given)."""
    if isinstance(value, io.BytesIO):
        value.seek(0)
        return torch.load(value, weights_only=False)
    return value


def rng_key(rank: int) -> str:
    return f"rng.{rank}"


def rng_to_load(directory: Path, rank: int) -> str:
    """This rank's saved generators, or rank 0's for a rank the saved run did not have."""
    keys = saved_keys(directory)
    return rng_key(rank) if rng_key(rank) in keys else rng_key(0)
