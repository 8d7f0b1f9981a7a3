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

Reading builds nothing but data, as for one-file checkpoints (moetrain.train.checkpoint): DCP
unpickles its .metadata and its non-tensor items in full, so here .metadata goes through an
unpickler that knows only DCP's own metadata classes (DataOnlyReader) and every item through
torch.load(weights_only=True) (DataOnlyLoadPlanner). A file needing anything else is an
UnsafeCheckpointError; convert_trusted rewrites a checkpoint of an earlier moetrain, whose random
states were NumPy and Python objects, once the user says they trust it.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from moetrain.moe import MoELayer
from moetrain.train import checkpoint
from moetrain.train.checkpoint import MANIFEST, CheckpointError, UnsafeCheckpointError

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
            with _disk_errors_named(directory):
                dcp.save(state, checkpoint_id=str(directory))
            self._complete(directory, on_complete)

    def finish(self) -> None:
        """Wait for the save in flight, then mark it complete."""
        if self.pending is None:
            return
        future, directory, on_complete = self.pending
        self.pending = None
        with _disk_errors_named(directory):
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


# ---------------------------------------------------------------------- reading data only


def _metadata_globals() -> dict[tuple[str, str], object]:
    """What DCP's .metadata may name: its own metadata classes, torch's sizes, dtypes and layouts, and
    the path it records. Each builds a plain value from plain arguments."""
    allowed = {(dcp_metadata.__name__, name): getattr(dcp_metadata, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    allowed[(dcp_filesystem.__name__, "_StorageInfo")] = dcp_filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed.update((("torch", name), value) for name, value in vars(torch).items() if isinstance(value, torch.dtype))
    allowed.update((("pathlib", cls.__name__), cls) for cls in (pathlib.Path, pathlib.PosixPath, pathlib.PurePosixPath,
                                                                pathlib.WindowsPath, pathlib.PureWindowsPath))
    return allowed


class _Refused(pickle.UnpicklingError):
    """A global that DCP's metadata does not name (so the file is not harmless DCP metadata)."""


class _MetadataUnpickler(pickle.Unpickler):
    allowed = None

    def find_class(self, module: str, name: str):
        if _MetadataUnpickler.allowed is None:
            _MetadataUnpickler.allowed = _metadata_globals()
        found = self.allowed.get((module, name))
        if found is None:
            raise _Refused(f"GLOBAL {module}.{name}")
        return found


class DataOnlyReader(FileSystemReader):
    """DCP's file reader, whose .metadata builds only DCP's metadata (its own reader unpickles it in full)."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        path = Path(self.path) / (METADATA if rank is None else f"__{rank}{METADATA}")
        try:
            with open(path, "rb") as file:
                metadata = _MetadataUnpickler(file).load()
        except _Refused as error:
            raise checkpoint.unsafe(path, checkpoint.refused_object(error)) from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as error:  # not a pickle of it
            raise CheckpointError(f"{path} is not DCP's metadata ({type(error).__name__}: {error})") from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP's metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DataOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, whose non-tensor items load with weights_only=True (its own loads them in full)."""

    def __init__(self, directory: Path, **options):
        super().__init__(**options)
        self.directory = Path(directory)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = checkpoint.load_data_only(value, self.directory)
        if isinstance(loaded, bytes):  # a blob(): the object it holds, data only as well
            loaded = checkpoint.load_data_only(io.BytesIO(loaded), self.directory)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def saved_keys(directory: Path) -> set[str]:
    return set(DataOnlyReader(str(directory)).read_metadata().state_dict_metadata)


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
        dcp.load(request, storage_reader=DataOnlyReader(str(directory)), planner=DataOnlyLoadPlanner(directory),
                 no_dist=not distributed)
    except (Exception, CheckpointException) as error:  # DCP's wraps each failing rank's: one line naming the checkpoint
        if isinstance(error, CheckpointError):
            raise
        refused = [failure for failure in _failures(error) if isinstance(failure, UnsafeCheckpointError)]
        if refused:  # a refused object on any rank: said as it is on every rank
            raise UnsafeCheckpointError(str(refused[0])) from None
        message = " ".join(str(error).split())[:300]
        raise CheckpointError(f"{directory} does not load ({type(error).__name__}: {message})") from None
    return request


@contextlib.contextmanager
def _disk_errors_named(directory: Path):
    """A write that a rank's disk or folder refused (DCP gathers each rank's failure into its
    CheckpointException, itself not an Exception) as the one-line CheckpointError of a single-file
    checkpoint; the step gets no manifest, so resuming skips it."""
    try:
        yield
    except CheckpointException as error:
        causes = [cause for cause in map(checkpoint.os_error_behind, _failures(error)) if cause is not None]
        if causes:
            raise checkpoint.cannot_write(directory, causes[0]) from None
        raise


def _failures(error: Exception) -> list:
    """The exceptions of each rank that DCP's CheckpointException gathered (the error itself otherwise)."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict):
        return [error]
    return [failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()]


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


def blob(value) -> bytes:
    """An object DCP stores as one opaque item, whatever its structure (the trainer's extras and
    random states must not become DCP keys of their own): its torch.save bytes, which load()
    gives back as the object (DataOnlyLoadPlanner reads them data-only). A blob(None) in a load
    request stands for the item to read."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _bytes_items(reader: FileSystemReader, planner: DefaultLoadPlanner) -> dict:
    """Every non-tensor item of a DCP checkpoint by its DCP key, read by `reader` and `planner` (which
    must not flatten: the request is DCP's keys already)."""
    request = {key: blob(None) for key, item in reader.read_metadata().state_dict_metadata.items()
               if isinstance(item, dcp_metadata.BytesStorageMetadata)}
    dcp.load(request, storage_reader=reader, planner=planner, no_dist=True)
    return planner.state_dict


_FLAT = dict(flatten_state_dict=False, flatten_sharded_tensors=False)


def _trusted_item(value, directory: Path):
    """A non-tensor item loaded in full, made data-only (checkpoint.safe_form): a blob (an earlier
    moetrain stored it as a pickled BytesIO) again as a blob of the object it holds."""
    if isinstance(value, io.BytesIO):
        value = value.getvalue()
    if isinstance(value, bytes):
        held = checkpoint.safe_form(torch.load(io.BytesIO(value), weights_only=False))
        checkpoint.check_data_only(held, directory)
        return blob(held)
    value = checkpoint.safe_form(value)
    checkpoint.check_data_only(value, directory)
    return value


def convert_trusted(directory: Path) -> bool:
    """Rewrite a DCP checkpoint the user trusts in the data-only form, or leave one that is data-only
    already (False). Its non-tensor items are loaded once in full, made data-only
    (checkpoint.safe_form: the random states of an earlier moetrain), and the whole checkpoint is
    written again by this process, tensors in their global shape (any layout loads it), to a folder
    beside it that replaces it once complete, with its SHA256SUMS. Reads every tensor into memory."""
    directory = Path(directory)
    verify(directory)
    try:
        _bytes_items(DataOnlyReader(str(directory)), DataOnlyLoadPlanner(directory, **_FLAT))
        return False
    except UnsafeCheckpointError:
        pass
    except CheckpointException as error:
        if not any(isinstance(failure, UnsafeCheckpointError) for failure in _failures(error)):
            raise CheckpointError(f"{directory} does not load ({' '.join(str(error).split())[:300]})") from None
    trusted = FileSystemReader(str(directory))  # the user's word: DCP's own reader, in full
    metadata = trusted.read_metadata()
    state = {key: _trusted_item(value, directory) for key, value in
             _bytes_items(FileSystemReader(str(directory)), DefaultLoadPlanner(**_FLAT)).items()}
    tensors = {key: torch.empty(item.size, dtype=item.properties.dtype)
               for key, item in metadata.state_dict_metadata.items()
               if isinstance(item, dcp_metadata.TensorStorageMetadata)}
    dcp.load(tensors, storage_reader=trusted, planner=DefaultLoadPlanner(**_FLAT), no_dist=True)
    converted = directory.with_name(directory.name + ".converting")
    shutil.rmtree(converted, ignore_errors=True)
    dcp.save({**tensors, **state}, checkpoint_id=str(converted), no_dist=True,
             planner=DefaultSavePlanner(**_FLAT))
    checkpoint.write_checksums(converted / MANIFEST, {path.name: checkpoint.sha256_of(path) for path in
                                                      sorted(converted.glob("*.distcp")) + [converted / METADATA]})
    checkpoint.replace_directory(directory, converted)
    return True


def rng_key(rank: int) -> str:
    return f"rng.{rank}"


def rng_to_load(directory: Path, rank: int) -> str:
    """This rank's saved generators, or rank 0's for a rank the saved run did not have."""
    keys = saved_keys(directory)
    return rng_key(rank) if rng_key(rank) in keys else rng_key(0)
