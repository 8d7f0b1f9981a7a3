"""MoE-aware distributed optimizer: wraps any torch optimizer for data + expert parallel training.

    parallelize(model, adaptive_r=1)                      # optional: shard the experts
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), model,
                                     max_grad_norm=1.0, zero=True)
    loss.backward(); optimizer.step(); optimizer.zero_grad()

Each rank's loss is the mean over its own batch, and step() makes the update equal to the
single-process update on the mean of all ranks' losses (the DDP convention):

  shared parameters (attention, embeddings, routers, shared experts, and routed experts that
      are not sharded): gradients averaged over all ranks;
  sharded expert parameters: the expert-parallel all-to-all already brought every rank's
      contribution to the rank holding the expert, and ExpertParallel divided it by the rank count
      on the way (moetrain.parallel.expert scales the gradient as it enters the experts' backward,
      not in a pass over every expert weight gradient here), so gradients are only summed over
      the replicas of the same expert (none when experts >= ranks);
  max_grad_norm: clips by the global norm, each expert counted once however many replicas;
  zero=True (ZeRO-1): each shared parameter's optimizer state lives on one rank, which updates
      it and broadcasts the new values; expert parameters keep their state where they live;
  routers with an aux-loss-free bias (sigmoid gate) update it from the load summed over ranks,
      so every rank moves the bias the same way (calling update_router_biases() is not needed);
  an optimizer that rounds stochastically (moetrain.train.optim.MasterWeightAdamW without master
      weights) keeps one rounding key per shared parameter on every rank, and gets keys of their own
      for each rank's sharded experts (the replicas of an expert share them).

Users never tag parameters: expert parameters are found through the MoE layers' ExpertParallel (layer.parallel).
state_dict() names parameters by their model names, so checkpoints survive resharding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from moetrain.moe import moe_layers
from moetrain.parallel.expert import host_group


@dataclass
class _ExpertGroup:
    params: list[nn.Parameter]
    replicas: int
    replica_group: object  # process group of the replicas; None when replicas == 1


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    return list(buckets.values())


def _all_reduce_coalesced(tensors: list[torch.Tensor], group, scale: float) -> None:
    """Sum each tensor over `group` (in place) through one flat buffer per dtype, then scale."""
    for bucket in _by_dtype(tensors):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        for tensor, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            tensor.copy_(reduced)


class DistributedOptimizer(torch.optim.Optimizer):
    """A torch Optimizer (LR schedulers accept it) whose step runs the wrapped one on reduced gradients.

    Its param_groups hold every parameter and are what schedulers change; the wrapped optimizer's
    groups (only the owned shared parameters under ZeRO-1) take their hyperparameters before each step.
    Every rank of the world constructs it (on NCCL it creates a Gloo group for host-side flags).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, max_grad_norm: float | None = None,
                 zero: bool = False, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedOptimizer needs torch.distributed initialised first "
                               "(moetrain.parallel.init_distributed or torch.distributed.init_process_group)")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        if any(optimizer.state.values()):
            raise ValueError("wrap an optimizer that has not stepped yet (load its state through the wrapper)")
        super().__init__([dict(param_group) for param_group in optimizer.param_groups], optimizer.defaults)
        self.optimizer, self.model, self.group = optimizer, model, group
        self.max_grad_norm = max_grad_norm
        self._reduced = False
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.last_grad_norm: torch.Tensor | None = None
        # Which shared parameters got a gradient on any rank is agreed on the host: a GPU flag
        # tensor read back each step would drain the GPU queue before the reduction.
        self.host_group = host_group(group)
        self.names = {param: name for name, param in model.named_parameters()}

        params = [param for param_group in optimizer.param_groups for param in param_group["params"]]
        unknown = [param for param in params if param not in self.names]
        if unknown:
            raise ValueError(f"the optimizer holds {len(unknown)} parameter(s) that are not in the model")
        in_optimizer = set(params)
        rounding_keys = getattr(optimizer, "rounding_keys", None)  # an optimizer that rounds stochastically
        expert_groups: dict[int, _ExpertGroup] = {}
        for layer in moe_layers(model):
            if layer.parallel is None:
                continue  # experts replicated on every rank: plain shared parameters
            layout = layer.parallel.layout
            if layout.world_size != self.world_size:
                raise ValueError(f"the experts are sharded over {layout.world_size} ranks but the optimizer's group "
                                 f"has {self.world_size}: use the same process group for both")
            entry = expert_groups.setdefault(id(layout), _ExpertGroup([], layout.replicas, layout.replica_group))
            local = [param for param in layer.experts.parameters() if param in in_optimizer]
            entry.params.extend(local)
            if rounding_keys is not None:  # the same place on another rank is another expert: other bits
                offset = len(rounding_keys) * (1 + layout.local_slice.start)
                for param in local:
                    optimizer.set_rounding_key(param, rounding_keys[param] + offset)
        self.expert_groups = list(expert_groups.values())
        sharded = {param for entry in self.expert_groups for param in entry.params}
        self.shared = [param for param in params if param not in sharded]
        self._broadcast_from_first(self.shared + self._shared_buffers())

        self.zero = bool(zero)
        self.owner: dict[nn.Parameter, int] = {}
        if self.zero:
            self._shard_shared_state()

    # ------------------------------------------------------------------ setup

    def _shared_buffers(self) -> list[torch.Tensor]:
        sharded_modules = {id(module) for layer in moe_layers(self.model) if layer.parallel is not None
                           for module in layer.experts.modules()}
        return [buffer for module in self.model.modules() if id(module) not in sharded_modules
                for buffer in module.buffers(recurse=False)]

    @torch.no_grad()
    def _broadcast_from_first(self, tensors: list[torch.Tensor]) -> None:
        """Every rank starts from rank 0's values (as DDP does), whatever their seeds."""
        for bucket in _by_dtype([tensor.data for tensor in tensors]):
            flat = _flatten_dense_tensors(bucket)
            dist.broadcast(flat, self.ranks[0], group=self.group)
            for tensor, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                tensor.copy_(value)

    def _shard_shared_state(self) -> None:
        """ZeRO-1: give each shared parameter an owner (largest first, to the least loaded rank) and
        keep only owned shared parameters in this rank's optimizer."""
        load = [0] * self.world_size
        for param in sorted(self.shared, key=lambda p: (-p.numel(), self.names[p])):
            owner = min(range(self.world_size), key=lambda rank: (load[rank], rank))
            self.owner[param] = owner
            load[owner] += param.numel()
        for param_group in self.optimizer.param_groups:
            param_group["params"] = [param for param in param_group["params"]
                                     if self.owner.get(param, self.rank) == self.rank]

    # ------------------------------------------------------------------ the step

    def _parameters(self) -> list[nn.Parameter]:
        return self.shared + [param for entry in self.expert_groups for param in entry.params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._reduced = False
        for param in self._parameters():
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    @torch.no_grad()
    def _reduce(self, params: list[nn.Parameter], group, scale: float, flags_group=None) -> None:
        """flags_group: a Gloo group with group's ranks to agree on the used flags on the host
        (None: agree through group itself, on the parameters' device)."""
        # A parameter unused on some ranks still takes part in the reduction: zeros stand in for
        # its missing gradient; one that no rank used keeps grad None (the optimizer skips it).
        device = torch.device("cpu") if flags_group is not None else (params[0].device if params else None)
        used = torch.tensor([param.grad is not None for param in params], dtype=torch.int32, device=device)
        if params:
            dist.all_reduce(used, op=dist.ReduceOp.MAX, group=flags_group if flags_group is not None else group)
        taking_part = []
        for param, any_rank in zip(params, used.tolist()):
            if any_rank and param.grad is None:
                param.grad = torch.zeros_like(param)
            if any_rank:
                taking_part.append(param.grad)
        _all_reduce_coalesced(taking_part, group, scale)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the gradients as described at the top; once per step (step() calls it if needed)."""
        if self._reduced:
            return
        self._reduce(self.shared, self.group, 1.0 / self.world_size, flags_group=self.host_group)
        # Expert gradients arrive divided by the world size already (see the top of this file);
        # without replicas there is nothing left to do.
        for entry in self.expert_groups:
            if entry.replicas > 1:
                self._reduce(entry.params, entry.replica_group, 1.0)
        self._reduced = True

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Reduce, then scale every gradient so the global norm is at most max_norm (inf: only
        measure it); returns the norm before clipping, the same on every rank."""
        self.reduce_gradients()
        total = self.global_grad_norm()
        if max_norm != float("inf"):  # (scaling by 1 would be a pass over every gradient for nothing)
            self.clip_grads_with_norm_(max_norm, total)
        return total

    def clip_grads_with_norm_(self, max_norm: float, total_norm: torch.Tensor) -> None:
        """Scales this rank's gradients as clip_grad_norm_ does, given the global norm it returned."""
        torch.nn.utils.clip_grads_with_norm_([param for param in self._parameters() if param.grad is not None],
                                             max_norm, total_norm)

    @torch.no_grad()
    def global_grad_norm(self) -> torch.Tensor:
        """The L2 norm of the whole model's gradient, each expert counted once (after reduction)."""
        def square_sum(params):
            grads = [param.grad.float() for param in params if param.grad is not None]
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) ** 2 \
                if grads else torch.zeros(())

        device = next((param.device for param in self._parameters()), torch.device("cpu"))
        experts = sum((square_sum(entry.params).to(device) / entry.replicas for entry in self.expert_groups),
                      torch.zeros((), device=device))
        dist.all_reduce(experts, group=self.group)  # every rank holds different experts
        return (square_sum(self.shared).to(device) + experts).sqrt()

    @torch.no_grad()
    def _sync_router_biases(self) -> None:
        for layer in moe_layers(self.model):
            pending = getattr(layer.gate, "pending_load", None)
            if pending is not None:
                dist.all_reduce(pending, group=self.group)
            layer.gate.update_bias()

    @torch.no_grad()
    def _broadcast_owned(self) -> None:
        """ZeRO-1: each owner sends the shared parameters it updated, one flat message per dtype."""
        for owner in range(self.world_size):
            mine = [param.data for param in self.shared if self.owner[param] == owner]
            for bucket in _by_dtype(mine):
                flat = _flatten_dense_tensors(bucket)
                dist.broadcast(flat, self.ranks[owner], group=self.group)
                for tensor, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    tensor.copy_(value)

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("DistributedOptimizer.step does not take a closure: call backward() before step()")
        self.reduce_gradients()
        if self.max_grad_norm is not None:
            self.last_grad_norm = self.clip_grad_norm_(self.max_grad_norm)
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({key: value for key, value in outer.items() if key != "params"})
        self.optimizer.step()
        if self.zero:
            self._broadcast_owned()
        self._sync_router_biases()
        self._reduced = False

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """The wrapped optimizer's state with parameters named as in the model (this rank's part)."""
        inner = self.optimizer.state_dict()
        order = [param for param_group in self.optimizer.param_groups for param in param_group["params"]]
        names = [self.names[param] for param in order]
        # Hyperparameters from this wrapper's groups: schedulers change those between steps.
        return {
            "state": {names[index]: state for index, state in inner["state"].items()},
            "param_groups": [{**{key: value for key, value in outer.items() if key != "params"},
                              "params": [names[index] for index in group["params"]]}
                             for outer, group in zip(self.param_groups, inner["param_groups"])],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a named state; entries of parameters this rank does not update (ZeRO) are skipped."""
        order = [param for param_group in self.optimizer.param_groups for param in param_group["params"]]
        index = {self.names[param]: i for i, param in enumerate(order)}
        groups = state_dict["param_groups"]
        if len(groups) != len(self.optimizer.param_groups):
            raise ValueError(f"the state has {len(groups)} parameter groups, the optimizer {len(self.optimizer.param_groups)}")
        for param_group, saved in zip(self.optimizer.param_groups, groups):
            for param in param_group["params"]:
                if self.names[param] not in saved["params"]:
                    raise ValueError(f"parameter {self.names[param]!r} is missing from the optimizer state's groups")
        self.optimizer.load_state_dict({
            "state": {index[name]: state for name, state in state_dict["state"].items() if name in index},
            "param_groups": [{**saved, "params": [index[self.names[param]] for param in param_group["params"]]}
                             for param_group, saved in zip(self.optimizer.param_groups, groups)],
        })
        for outer, saved in zip(self.param_groups, groups):
            outer.update({key: value for key, value in saved.items() if key != "params"})
