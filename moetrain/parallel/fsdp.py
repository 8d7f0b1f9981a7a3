"""FSDP2 (torch.distributed.fsdp.fully_shard) for MoE models, alone or composed with expert parallelism.

    meshes = shard_model(model)                              # every parameter sharded over all ranks
    meshes = shard_model(model, expert_parallel=True)        # experts placed by expert parallelism
    optimizer = torch.optim.AdamW(model.parameters())        # after sharding: it holds the shards
    sync_router_biases_after_step(optimizer, model)

Without expert parallelism every parameter, the experts' included, is sharded over the W ranks
(one FSDP unit per transformer block, one for the rest); each rank runs every expert on its own
tokens, and FSDP averages every gradient over the ranks (its reduce-scatter).

With expert parallelism (torchtitan's composition) the experts are first placed as
moetrain.parallel.expert places them (rank i holds experts [i*E/W, (i+1)*E/W), or with E < W
expert i // (W/E) on W/E consecutive ranks, its replicas) and tokens travel by all-to-all; each
layer's experts are then one FSDP unit sharded over the replicas of those experts only (the
"replica" dimension of expert_mesh; one rank when E >= W), along their second dimension (a rank
holds about one expert when there are replicas). The rest is sharded over all ranks.
The MoE rules hold: an expert's gradient already holds every rank's contribution, divided by W
on the way (expert.py), so FSDP sums it over that expert's replicas instead of averaging it;
shared gradients are averaged over all ranks.

global_grad_norm() is the norm of the whole model's gradient, each element counted once (every
element lives on exactly one rank once sharded); the sigmoid gate's load is summed over all ranks
before its bias moves (sync_router_biases_after_step). Mixed precision: bf16 parameters in
forward and backward, fp32 master weights, gradients reduced in fp32. CPU offload keeps the
sharded parameters, gradients and optimizer state on the CPU between uses.

Shape letters: E experts, W ranks, G expert groups (W / replicas), R replicas of each expert.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from moetrain.moe import moe_layers
from moetrain.moe.experts import is_expert_param, mark_expert
from moetrain.parallel.expert import parallelize
from moetrain.parallel.layout import group_timeout
from moetrain.train.optim import clip_factor


def device_type_of(model: nn.Module) -> str:
    return next(model.parameters()).device.type


def expert_mesh(num_experts: int, device_type: str, timeout_s: float | None = None) -> DeviceMesh:
    """The world as [G, R]: row g holds the ranks of expert group g (experts placed as layout.py
    places them), column q its q-th replica. Its groups' collectives wait at most timeout_s seconds
    (None: as long as the world's). Collective: every rank calls it."""
    world = dist.get_world_size()
    replicas = max(world // num_experts, 1)
    shape, names = (world // replicas, replicas), ("expert", "replica")
    # A dimension over the whole world reuses the world's group; the others get new groups.
    waiting = {name: _waiting(device_type, timeout_s) for name, size in zip(names, shape) if size != world}
    return init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=waiting)


def _waiting(device_type: str, timeout_s: float | None):
    """Options for a device mesh's new groups (torch's default for them, 30 minutes on Gloo, would
    ignore the configured timeout)."""
    if dist.Backend.default_device_backend_map.get(device_type) == "nccl":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
    else:
        from torch.distributed import ProcessGroupGloo

        options = ProcessGroupGloo._Options()
    options._timeout = group_timeout(None, timeout_s)
    return options


def whole_world_mesh(device_type: str, timeout_s: float | None = None) -> DeviceMesh:
    """The 1-D mesh of every rank (dimension "shard"). It reuses the world's group, except on a Gloo
    world where CUDA is available: there torch makes a new group (Gloo for CPU tensors, NCCL for CUDA
    ones) with its default timeout, so this mesh makes a Gloo group that waits timeout_s seconds
    instead (None: as long as the world's). Collective: every rank calls it."""
    waiting = {}
    if torch.cuda.is_available() and dist.get_backend() == "gloo":
        waiting = {"shard": _waiting("cpu", timeout_s)}
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("shard",),
                            backend_override=waiting)


@torch.no_grad()
def broadcast_from_first(tensors: list[torch.Tensor]) -> None:
    """Every rank starts from rank 0's values (as DDP does), whatever its seed."""
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for bucket in buckets.values():
        flat = _flatten_dense_tensors(bucket)
        dist.broadcast(flat, 0)
        for tensor, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            tensor.copy_(value)


def _policies(mixed_precision: bool, cpu_offload: bool) -> dict:
    return {
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision else MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy(),
    }


def _features_dim(param: nn.Parameter) -> Shard:
    """Where the replicas of an expert split its parameters: [E, D, H] weights and [E, H] biases
    along their second dimension."""
    return Shard(1)


def shard_model(model: nn.Module, expert_parallel: bool = False, mixed_precision: bool = False,
                cpu_offload: bool = False, timeout_s: float | None = None) -> dict[int, DeviceMesh]:
    """Shard `model` in place (see the top of this file); call on every rank with the same full
    model, before building the optimizer. Returns the expert mesh of each expert count (empty
    without expert parallelism). timeout_s: how long the process groups made for expert parallelism
    and the expert meshes wait in a collective (parallel.timeout_s; None: as long as the world's)."""
    from moetrain.models.layers import TransformerBlock

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("FSDP needs torch.distributed initialised first (moetrain.parallel.init_distributed)")
    layers = moe_layers(model)
    if any(layer.parallel is not None for layer in layers):
        raise ValueError("this model is parallelized already: shard_model places the experts itself")
    device_type = device_type_of(model)
    expert_names = {name for name, param in model.named_parameters() if is_expert_param(param)}
    broadcast_from_first([param.data for param in model.parameters()] + list(model.buffers()))
    policies = _policies(mixed_precision, cpu_offload)
    meshes: dict[int, DeviceMesh] = {}
    if expert_parallel:
        parallelize(model, adaptive_r=1, timeout_s=timeout_s)
        for layer in layers:
            if layer.num_experts not in meshes:
                meshes[layer.num_experts] = expert_mesh(layer.num_experts, device_type, timeout_s)
            # Along dim 1 (model or hidden features): a rank holds about one expert whenever the
            # experts have replicas, and FSDP's default dim 0 would leave it whole on one replica.
            fully_shard(layer.experts, mesh=meshes[layer.num_experts]["replica"],
                        shard_placement_fn=_features_dim, **policies)
            # Summed over the replicas, not averaged: expert.py divided by W already. Gloo has no
            # pre-scaled sum, so the reduction is a plain sum.
            layer.experts.set_gradient_divide_factor(1.0)
            layer.experts.set_force_sum_reduction_for_comms(True)
            layer.parallel.experts_sharded = True
    world_mesh = whole_world_mesh(device_type, timeout_s)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard(module, mesh=world_mesh, **policies)
    fully_shard(model, mesh=world_mesh, **policies)
    # fully_shard made new (DTensor) parameters: the expert tag travels by name.
    for name, param in model.named_parameters():
        if name in expert_names:
            mark_expert(param)
    return meshes


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def global_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The L2 norm of the whole sharded model's gradient, the same on every rank; scales every
    gradient so that it is at most max_norm (inf: only measure). Once sharded, each element of the
    model lives on exactly one rank, so the squares of the local shards sum to the whole."""
    grads = [_local(param.grad) for param in parameters if param.grad is not None]
    device = grads[0].device if grads else next(iter(parameters)).device
    squares = torch.zeros((), device=device, dtype=torch.float32)
    for grad in grads:
        if grad.numel():
            squares += torch.linalg.vector_norm(grad.float()) ** 2
    if squares.device.type == "cpu" and dist.get_backend() == "nccl":
        # cpu_offload keeps the gradients in host memory, and an NCCL group reduces CUDA tensors only
        squares = squares.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(squares)
    total = squares.sqrt()
    if max_norm != float("inf"):
        scale_to_norm_(parameters, max_norm, total)
    return total


@torch.no_grad()
def scale_to_norm_(parameters: list[nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
    """Scales this rank's gradient shards by clip_factor(max_norm, total), as
    torch.nn.utils.clip_grads_with_norm_ does (it takes parameters; these are local shards)."""
    grads = [grad for grad in (_local(param.grad) for param in parameters if param.grad is not None) if grad.numel()]
    if grads:
        torch._foreach_mul_(grads, clip_factor(max_norm, total).to(grads[0].device))


def sync_router_biases_after_step(optimizer: torch.optim.Optimizer, model: nn.Module):
    """After each optimizer step, every sigmoid gate's load is summed over all ranks and its bias
    moves from that (the same way on every rank). Returns the hook's handle."""
    layers = moe_layers(model)

    @torch.no_grad()
    def update(optimizer, args, kwargs) -> None:
        for layer in layers:
            pending = getattr(layer.gate, "pending_load", None)
            if pending is not None:
                dist.all_reduce(pending)
            layer.gate.update_bias()

    return optimizer.register_step_post_hook(update)
