"""Checkpoints with expert shards per rank, and their conversion to another world size.

A distributed checkpoint is one file per rank (rank00000-of-00004.pt ...), each a dict:

    {"model": model.state_dict(),              # this rank's experts, all shared weights
     "optimizer": DistributedOptimizer.state_dict(),   # named; this rank's part
     "moe_parallel": {"world_size": W, "rank": i, "expert_parallel": bool,
                      "experts": {state key: number of experts}},
     ...}                                      # anything else (step, data position): rank 0's is kept

A step directory counts only once it holds SHA256SUMS, every rank's file and its sha256 (the
format of `sha256sum`), which rank 0 writes after all ranks have written theirs: a run killed while
saving leaves a directory without it (perhaps only .tmp files), which resuming and converting skip.

Converting gathers every expert tensor (and its optimizer state) into the full [E, ...] tensor,
then cuts it again for the new world size with the placement of layout.py, so a run can resume
on a different number of ranks:

    python -m moetrain.parallel.checkpoint SRC_DIR DST_DIR --world-size 2

SRC_DIR is a step directory, or a run directory (its newest complete checkpoint is converted).

Shared optimizer state (ZeRO-1 keeps it on its owner) is merged and written to every new rank;
each rank loads the part it updates.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moetrain.moe import MoELayer
from moetrain.parallel.layout import placement
from moetrain.train import checkpoint
from moetrain.train.checkpoint import MANIFEST, CheckpointError

SHARD_NAME = "rank{rank:05d}-of-{world:05d}.pt"
_SHARD_PATTERN = re.compile(r"rank(\d{5})-of-(\d{5})\.pt")


def parallel_metadata(model: nn.Module, world_size: int, rank: int) -> dict:
    """The "moe_parallel" entry describing how `model`'s experts are placed on this rank."""
    experts, sharded = {}, []
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            sharded.append(module.parallel is not None)
            prefix = f"{name}.experts." if name else "experts."
            for key, _ in module.experts.named_parameters():
                experts[prefix + key] = module.num_experts
    if len(set(sharded)) > 1:
        raise ValueError("all MoE layers must be parallelized the same way to be checkpointed")
    return {"world_size": world_size, "rank": rank, "expert_parallel": bool(sharded and sharded[0]),
            "experts": experts}


def check_world_size(shard: dict, world_size: int, source: str = "CHECKPOINT_DIR") -> None:
    """Fail before training if a checkpoint was written by a different number of ranks."""
    saved = shard.get("moe_parallel", {}).get("world_size", 1)
    if saved != world_size:
        raise ValueError(f"the checkpoint was written by {saved} rank(s) but this run has {world_size}: convert it "
                         f"first with `python -m moetrain.parallel.checkpoint {source} NEW_DIR --world-size {world_size}`")


def _is_expert_tensor(value, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == rows


def consolidate(shards: list[dict]) -> dict:
    """Per-rank checkpoints (in rank order) -> one checkpoint with full expert tensors (world size 1)."""
    meta = shards[0]["moe_parallel"]
    world = meta["world_size"]
    if len(shards) != world or [shard["moe_parallel"]["rank"] for shard in shards] != list(range(world)):
        raise ValueError(f"expected the {world} shards of a world-size-{world} checkpoint in rank order")
    experts = meta["experts"]

    def holders(key):
        """One shard per distinct block of experts, in expert order (replicas skipped)."""
        if not meta["expert_parallel"]:
            return [shards[0]], None
        first = {placement(experts[key], world, rank).start: shard for rank, shard in enumerate(shards)}
        return [first[start] for start in sorted(first)], placement(experts[key], world, 0).stop

    full = copy.copy(shards[0])
    full["model"] = {}
    for key, value in shards[0]["model"].items():
        if key in experts:
            parts, _ = holders(key)
            value = torch.cat([shard["model"][key] for shard in parts])
        full["model"][key] = value

    if "optimizer" in shards[0]:
        # Without expert parallelism expert weights are replicated like shared ones (and under
        # ZeRO-1 their state lives on one owner), so only sharded experts are gathered here.
        sharded = experts if meta["expert_parallel"] else {}
        state = {}
        for key in sharded:
            parts, rows = holders(key)
            if key not in parts[0]["optimizer"]["state"]:
                continue
            entry = dict(parts[0]["optimizer"]["state"][key])
            for item, value in entry.items():
                if rows is not None and _is_expert_tensor(value, rows):
                    entry[item] = torch.cat([shard["optimizer"]["state"][key][item] for shard in parts])
            state[key] = entry
        for shard in shards:  # shared state: wherever it lives (ZeRO-1 keeps it on its owner)
            for key, entry in shard["optimizer"]["state"].items():
                if key not in sharded:
                    state.setdefault(key, entry)
        groups = copy.deepcopy(shards[0]["optimizer"]["param_groups"])
        for index, group in enumerate(groups):
            for shard in shards[1:]:
                group["params"] += [name for name in shard["optimizer"]["param_groups"][index]["params"]
                                    if name not in group["params"]]
        full["optimizer"] = {"state": state, "param_groups": groups}
    full["moe_parallel"] = {**meta, "world_size": 1, "rank": 0}
    return full


def reshard(full: dict, world_size: int, expert_parallel: bool | None = None) -> list[dict]:
    """One full checkpoint -> world_size per-rank checkpoints (experts cut as layout.py places them)."""
    meta = full["moe_parallel"]
    if meta["world_size"] != 1:
        raise ValueError("reshard takes a consolidated checkpoint (world size 1): call consolidate() first")
    expert_parallel = meta["expert_parallel"] if expert_parallel is None else expert_parallel
    experts = meta["experts"]
    shards = []
    for rank in range(world_size):
        def cut(key, value, rows):
            if not expert_parallel or key not in experts or not _is_expert_tensor(value, rows):
                return value
            return value[placement(experts[key], world_size, rank)].clone()

        shard = copy.copy(full)
        shard["model"] = {key: cut(key, value, experts.get(key)) for key, value in full["model"].items()}
        if "optimizer" in full:
            shard["optimizer"] = {
                "state": {key: {item: cut(key, value, experts.get(key)) for item, value in entry.items()}
                          for key, entry in full["optimizer"]["state"].items()},
                "param_groups": copy.deepcopy(full["optimizer"]["param_groups"]),
            }
        shard["moe_parallel"] = {**meta, "world_size": world_size, "rank": rank, "expert_parallel": expert_parallel}
        shards.append(shard)
    return shards


def convert(shards: list[dict], world_size: int, expert_parallel: bool | None = None) -> list[dict]:
    return reshard(consolidate(shards), world_size, expert_parallel)


def indexed_optimizer_state(named: dict, optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """A named optimizer state (DistributedOptimizer.state_dict) as `optimizer` itself would save it,
    for resuming a converted world-size-1 checkpoint with a plain torch optimizer."""
    names = {param: name for name, param in model.named_parameters()}
    order = [names[param] for group in optimizer.param_groups for param in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    return {
        "state": {index[name]: state for name, state in named["state"].items() if name in index},
        "param_groups": [{**saved, "params": [index[names[param]] for param in group["params"]]}
                         for group, saved in zip(optimizer.param_groups, named["param_groups"])],
    }


# ---------------------------------------------------------------------- files


def shard_path(directory: str, rank: int, world_size: int) -> str:
    return os.path.join(directory, SHARD_NAME.format(rank=rank, world=world_size))


def save_shard(state: dict, directory: str) -> None:
    """This rank's file of a checkpoint, then (rank 0, once every rank's file is complete) the
    directory's SHA256SUMS. Collective: every rank of the default process group calls it, and it
    returns once the checkpoint is complete."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(directory, exist_ok=True)
    if rank == 0:  # the manifest of an earlier attempt at this step must not vouch for the new files
        Path(directory, MANIFEST).unlink(missing_ok=True)
    name = SHARD_NAME.format(rank=rank, world=world)
    digests = [None] * world
    dist.all_gather_object(digests, (name, checkpoint.write(state, Path(directory, name))))
    if rank == 0:
        checkpoint.write_checksums(Path(directory, MANIFEST), dict(digests))
    dist.barrier()


def write_shards(shards: list[dict], directory: str) -> None:
    """Per-rank checkpoints from one process (a conversion), then their SHA256SUMS."""
    os.makedirs(directory, exist_ok=True)
    digests = {}
    for rank, shard in enumerate(shards):
        name = SHARD_NAME.format(rank=rank, world=len(shards))
        digests[name] = checkpoint.write(shard, Path(directory, name))
    checkpoint.write_checksums(Path(directory, MANIFEST), digests)


def load_shards(directory: str) -> list[dict]:
    """Every rank's file of a complete checkpoint, each checked against its sha256."""
    return [checkpoint.load(Path(directory, name)) for name in _listed_shards(directory)]


def _listed_shards(directory: str) -> list[str]:
    """The names of every rank's file of a complete per-rank checkpoint, as its SHA256SUMS lists them."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory} is not a directory of per-rank checkpoint files")
    held = sorted(os.listdir(directory))
    if MANIFEST not in held and not any(_SHARD_PATTERN.fullmatch(name.removesuffix(".tmp")) for name in held):
        raise FileNotFoundError(f"no per-rank checkpoint files ({SHARD_NAME.format(rank=0, world=1)}, ...) "
                                f"in {directory} (it holds {', '.join(held) or 'nothing'})")
    checkpoint.check_complete(Path(directory))  # no SHA256SUMS: its save never finished
    listed = sorted(checkpoint.read_checksums(Path(directory, MANIFEST)))
    first = _SHARD_PATTERN.fullmatch(listed[0]) if listed else None
    expected = [SHARD_NAME.format(rank=rank, world=int(first.group(2))) for rank in range(int(first.group(2)))] \
        if first else []
    if not expected or listed != expected:
        raise CheckpointError(f"{directory}/{MANIFEST} should list the files of ranks 0 to N-1 of N, "
                              f"it lists {listed}: the checkpoint is damaged")
    return expected


def convert_trusted(directory: str) -> bool:
    """Rewrite a per-rank checkpoint the user trusts in the data-only form (checkpoint.convert_trusted,
    each rank's file, then SHA256SUMS), in a copy beside it that replaces it once complete; False when
    every file is data-only already (nothing is written)."""
    names = _listed_shards(directory)  # a complete checkpoint, every file as saved
    for name in names:
        checkpoint.verify(Path(directory, name))
    source = Path(directory)
    converted = source.with_name(source.name + ".converting")
    shutil.rmtree(converted, ignore_errors=True)
    shutil.copytree(source, converted)
    digests = checkpoint.read_checksums(converted / MANIFEST)
    changed = {name: digest for name in names
               if (digest := checkpoint.convert_trusted(converted / name)) is not None}
    if not changed:
        shutil.rmtree(converted)
        return False
    checkpoint.write_checksums(converted / MANIFEST, {**digests, **changed})
    checkpoint.replace_directory(source, converted)
    return True


def newest_complete(source: str) -> tuple[str, list[str]]:
    """The step directory to convert: `source` itself, or the newest complete checkpoint of a run
    directory (or its checkpoints/ folder); also one line for each newer, incomplete one skipped."""
    if any(_SHARD_PATTERN.fullmatch(name.removesuffix(".tmp")) for name in os.listdir(source)) or \
            os.path.isfile(os.path.join(source, MANIFEST)):
        return source, []
    folder = Path(source, checkpoint.CHECKPOINT_DIR)
    folder = folder if folder.is_dir() else Path(source)
    skipped = []
    for entry in reversed([entry for entry in checkpoint.checkpoints(folder) if entry.is_dir()]):
        if checkpoint.is_complete(entry):
            return str(entry), skipped
        skipped.append(f"skipping {entry}: incomplete (no {MANIFEST}: the run stopped while saving it)")
    raise FileNotFoundError(f"no complete per-rank checkpoint (step_*/ with {MANIFEST}) in {folder}"
                            + (f" ({len(skipped)} incomplete)" if skipped else ""))


def convert_checkpoint(source: str, destination: str, world_size: int, expert_parallel: bool | None = None) -> None:
    if os.path.abspath(source) == os.path.abspath(destination):
        raise ValueError("the destination directory must differ from the source")
    write_shards(convert(load_shards(source), world_size, expert_parallel), destination)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moetrain.parallel.checkpoint",
                                     description="Convert a per-rank MoE checkpoint to another world size.")
    parser.add_argument("source", help="a step directory with rankNNNNN-of-NNNNN.pt files, or a run directory "
                                       "(its newest complete checkpoint)")
    parser.add_argument("destination", help="new directory for the converted files")
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks of the new run")
    parser.add_argument("--expert-parallel", choices=("yes", "no"), default=None,
                        help="shard the experts in the output (default: as in the source)")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    expert_parallel = None if args.expert_parallel is None else args.expert_parallel == "yes"
    try:
        if not os.path.isdir(args.source):
            raise FileNotFoundError(f"{args.source} is not a directory")
        source, skipped = newest_complete(args.source)
        for line in skipped:
            print(line, file=sys.stderr)
        convert_checkpoint(source, args.destination, args.world_size, expert_parallel)
    except (ValueError, FileNotFoundError) as error:  # CheckpointError is a ValueError
        parser.exit(2, f"error: {error}\n")
    print(f"wrote {args.world_size} shard(s) of {source} to {args.destination}")


if __name__ == "__main__":
    main()
