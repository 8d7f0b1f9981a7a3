"""MoELayer: gate -> routing plan -> dispatch -> experts -> gate-weighted combine (+ shared experts).

    layer = MoELayer(model_dim=512, num_experts=8, hidden_size=1024, top_k=2, gate="top",
                     capacity_factor=1.0, activation="relu")
    y = layer(x)                               # x [..., model_dim] -> y, same shape
    y = layer(x, top_k=1, capacity_factor=0)   # sparsity and capacity switchable per call
    loss = task_loss + 0.01 * layer.aux_loss   # aux_loss of the last call
    layer.stats.tokens_per_expert, layer.stats.dropped_fraction

Dispatch and combine run the compiled kernels (impl="kernel", the default) or the pure-torch
reference (impl="torch"); both compute the same function. An empty batch (no tokens) gives an empty
output and zero losses, forward and backward, on every path.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
from torch import nn

import torch.distributed as dist

from moetrain import ops
from moetrain.moe import losses, recompute
from moetrain.moe.experts import DenseFeedForward, FFNExperts, SwiGLUExperts, TokenRows, activation_fn, build_experts
from moetrain.moe.gates import Gate, build_gate
from moetrain.moe.routing import RoutingPlan, make_plan
from moetrain.precision.recipes import check_fp8_wgrad, check_precision

# Where the balance loss counts its tokens per expert (moetrain/moe/losses.py).
BALANCE_LOSSES = ("micro_batch", "global_batch", "sequence")

# Importing the built-in gates registers them by name.
from moetrain.moe import top_gate, cosine_gate, sigmoid_gate  # noqa: F401,E402  isort: skip  (this order: GATES)


@dataclass
class RoutingStats:
    """Routing statistics of one forward call (tensors stay on the device until read)."""

    tokens_per_expert: torch.Tensor  # int64 [E] routing choices per expert, before dropping
    kept_per_expert: torch.Tensor  # int64 [E] choices that got a slot
    padded_capacity: int | None  # rows per expert block in the padded layout, None when packed
    balance_loss: torch.Tensor
    router_logits: torch.Tensor  # [T, E] fp32, detached
    z_loss_value: torch.Tensor | None = None  # computed by the forward call when its weight is not 0

    @property
    def z_loss(self) -> torch.Tensor:
        """The router z-loss of the call (computed on first read when the layer did not need it)."""
        if self.z_loss_value is None:
            self.z_loss_value = losses.z_loss(self.router_logits)
        return self.z_loss_value

    @property
    def capacity(self) -> int:
        """Rows per expert: the padded block size, or the largest expert's rows when packed.
        Computed on read, so a forward call on the GPU never waits for it."""
        return self.padded_capacity if self.padded_capacity is not None else int(self.kept_per_expert.max())

    @property
    def dropped_fraction(self) -> float:
        total = int(self.tokens_per_expert.sum())
        return 1.0 - int(self.kept_per_expert.sum()) / total if total else 0.0


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _own_class(module: nn.Module) -> type:
    """The module's class, seen through FSDP2's wrapper: fully_shard turns a module's class into a
    subclass (FSDP<Name>) of FSDPModule and it. FSDP is not imported for this: a module can only be
    wrapped once something else imported it."""
    cls = type(module)
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and issubclass(cls, fsdp.FSDPModule):
        return next(base for base in cls.__bases__ if base is not fsdp.FSDPModule)
    return cls


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward layer: each token goes to top_k of num_experts experts, and
    its output is their outputs weighted by the gate (plus the shared experts' output, if any).

        layer = MoELayer(model_dim=512, num_experts=8, hidden_size=1024, top_k=2)
        y_BTD = layer(x_BTD)                              # any [..., model_dim] -> the same shape
        loss = task_loss + layer.aux_loss                 # the last call's weighted auxiliary losses
        layer.stats.dropped_fraction                      # and its routing statistics

    One forward call, T tokens (x flattened to [T, model_dim]), E experts, k = top_k:
      1. the gate scores the tokens in fp32 and picks k experts per token, with their weights;
      2. the routing plan gives every choice a row of the expert-major buffer (moetrain/moe/routing.py),
         dropping the choices over an expert's capacity;
      3. dispatch copies the tokens into those rows, each expert runs on its own rows (batched or
         grouped GEMMs; under expert parallelism on the ranks holding it);
      4. combine sums each token's expert outputs weighted by the gate; a dropped choice adds nothing.

    Arguments:
      model_dim, hidden_size  D, the token width, and H, each expert's hidden width.
      num_experts, top_k      E routed experts, k of them per token (1 <= k <= E).
      gate                    "top" (softmax top-k), "cosine", "sigmoid" (DeepSeek-V3's, with group-limited
                              routing and the aux-loss-free bias), a Gate subclass or instance;
                              gate_kwargs are its own settings (moetrain.moe.GATES, docs/extending.md).
      capacity_factor         cf, the expert capacity (Tutel's semantics, moetrain/moe/routing.py):
                                cf > 0   at most C = k * int(cf * ceil(T / E)) rows an expert, the
                                         layout padded to E blocks of C rows; choices past C are dropped;
                                cf = 0   dropless: every choice kept, rows packed back to back;
                                cf < 0   dropless layout, capped at k * int(|cf| * ceil(T / E)) rows.
                              Which choices keep a slot when an expert overflows: first choices
                              before second ones, in token order, or with batch_prioritized=True the
                              most confident tokens first (V-MoE).
      expert, activation      "ffn" (two matrices with biases, activation between: relu, gelu or
                              silu) or "swiglu" (three bias-free matrices, silu), an Experts subclass
                              or an instance (docs/extending.md).
      num_shared_experts      dense experts every token passes through (DeepSeekMoE), each
                              shared_hidden_size wide (default hidden_size), added to the output.
      balance_loss_weight, balance_loss
                              the load-balancing loss (Switch's f_e * P_e, summed over experts and
                              scaled by E) and over which tokens f_e counts: "micro_batch" (this
                              call), "global_batch" (summed over the ranks) or "sequence" (each
                              sequence alone; x then [..., sequence, model_dim]).
      z_loss_weight           the router z-loss (ST-MoE) added to aux_loss; 0 leaves it out.
      impl                    "kernel" (moetrain's compiled dispatch, combine and routing kernels)
                              or "torch" (their pure-torch references): the same function.
      precision, fp8_wgrad    how the experts' GEMMs multiply: "bf16", "fp8" or "fp8_block" (see the
                              properties below); settable between calls.

    forward(x, top_k=None, capacity_factor=None, adaptive_r=None, a2a_ffn_overlap_degree=None): x of
    shape [..., model_dim] in any float dtype (autocast applies to the experts, not the router);
    returns the same shape. top_k and capacity_factor override the layer's for this call; under
    expert parallelism (moetrain.parallel.parallelize) adaptive_r and a2a_ffn_overlap_degree override
    the strategy's. An empty batch gives an empty output and zero losses.

    After each call:
      aux_loss  balance_loss_weight * balance loss + z_loss_weight * z-loss, a scalar in the graph:
                add it to the training loss (the trainer does).
      stats     RoutingStats, tensors left on the device until read:
                  tokens_per_expert  int64 [E], the choices routed to each expert before dropping;
                  kept_per_expert    int64 [E], those that got a row;
                  padded_capacity    C in the padded layout, None when packed (cf <= 0);
                  capacity           rows an expert: C, or the largest kept_per_expert when packed;
                  dropped_fraction   1 - kept / routed choices, over all experts;
                  balance_loss, z_loss   the unweighted losses (z_loss computed on first read);
                  router_logits      [T, E] fp32, detached.
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        hidden_size: int,
        top_k: int = 2,
        gate="top",
        capacity_factor: float = 1.0,
        activation: str = "relu",
        expert="ffn",
        num_shared_experts: int = 0,
        shared_hidden_size: int | None = None,
        balance_loss_weight: float = 1.0,
        balance_loss: str = "micro_batch",
        z_loss_weight: float = 0.0,
        batch_prioritized: bool = False,
        impl: str = "kernel",
        gate_kwargs: dict | None = None,
        precision: str = "bf16",
        fp8_wgrad: str = "bf16",
    ):
        super().__init__()
        self.model_dim = _positive_int("model_dim", model_dim)
        self.num_experts = _positive_int("num_experts", num_experts)
        _positive_int("hidden_size", hidden_size)
        self.top_k = self._check_top_k(top_k)
        self.capacity_factor = self._check_capacity_factor(capacity_factor)
        if num_shared_experts < 0 or isinstance(num_shared_experts, bool) or not isinstance(num_shared_experts, int):
            raise ValueError(f"num_shared_experts must be an integer >= 0, got {num_shared_experts!r}")
        activation_fn(activation)
        self.impl = ops.check_impl(impl)
        if self.impl == "kernel":
            ops.load()  # now, not inside the first (possibly compiled) forward: fails early if unavailable
        self.batch_prioritized = bool(batch_prioritized)
        self.balance_loss_weight = float(balance_loss_weight)
        if balance_loss not in BALANCE_LOSSES:
            raise ValueError(f"balance_loss must be one of {list(BALANCE_LOSSES)}, got {balance_loss!r}")
        self.balance_loss = balance_loss
        # global_batch sums the token counts over this process group (None: every rank, when
        # torch.distributed is initialised; one process alone has nothing to sum).
        self.balance_group = None
        self.z_loss_weight = float(z_loss_weight)
        self.gate: Gate = build_gate(gate, model_dim, num_experts, gate_kwargs)
        self.experts = build_experts(expert, num_experts, model_dim, hidden_size, activation)
        # Compiled kernels inside the gate and the experts follow the layer's choice.
        self.gate.impl = self.experts.impl = self.impl
        self.precision = precision
        self.fp8_wgrad = fp8_wgrad
        self.shared = None
        if num_shared_experts:
            kind = "swiglu" if expert == "swiglu" else "ffn"
            self.shared = DenseFeedForward(
                model_dim,
                num_shared_experts * (shared_hidden_size or hidden_size),
                kind=kind,
                activation="silu" if kind == "swiglu" and activation == "relu" else activation,
            )
        self.aux_loss: torch.Tensor | None = None
        self.stats: RoutingStats | None = None
        # Set by moetrain.parallel.parallelize: runs the experts across ranks (None: all local).
        self.parallel = None
        # Set by moetrain.moe.set_activation_checkpointing (selective mode): the experts'
        # hidden activations are recomputed in backward from the dispatched buffer.
        self.recompute_experts = False

    @property
    def precision(self) -> str:
        """How the routed experts' GEMMs multiply: "bf16" (in the operands' dtype), "fp8" (the
        forward and input-gradient GEMMs in FP8, row-wise scales) or "fp8_block" (the same with
        DeepSeek-V3's 1x128 / 128x128 block scales); moetrain.precision.fp8_matmul. Settable."""
        return self.experts.precision

    @precision.setter
    def precision(self, precision: str) -> None:
        self.experts.precision = check_precision(precision)

    @property
    def fp8_wgrad(self) -> str:
        """In FP8 precision, the weight gradient's GEMM: "bf16" (bf16 operands, the bf16 layer's
        arithmetic; on the shapes measured faster than FP8 with its per-expert column
        quantization) or "fp8" (by the precision's recipe, DeepSeek-V3's). Ignored in bf16.
        Settable."""
        return self.experts.fp8_wgrad

    @fp8_wgrad.setter
    def fp8_wgrad(self, fp8_wgrad: str) -> None:
        self.experts.fp8_wgrad = check_fp8_wgrad(fp8_wgrad)

    def _check_top_k(self, top_k) -> int:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= self.num_experts:
            raise ValueError(f"top_k must be an integer in [1, num_experts={self.num_experts}], got {top_k!r}")
        return top_k

    @staticmethod
    def _check_capacity_factor(capacity_factor) -> float:
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
            raise ValueError(f"capacity_factor must be a number (>0 padded, 0 dropless, <0 capped), got {capacity_factor!r}")
        return float(capacity_factor)

    def extra_repr(self) -> str:
        return (f"model_dim={self.model_dim}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, impl={self.impl!r}, precision={self.precision!r}"
                + (f", fp8_wgrad={self.fp8_wgrad!r}" if self.precision != "bf16" else ""))

    def forward(self, x: torch.Tensor, top_k: int | None = None, capacity_factor: float | None = None,
                adaptive_r: int | None = None, a2a_ffn_overlap_degree: int | None = None) -> torch.Tensor:
        """adaptive_r and a2a_ffn_overlap_degree override the parallel strategy's for this call."""
        if x.size(-1) != self.model_dim:
            raise ValueError(f"x's last dimension must be model_dim={self.model_dim}, got shape {tuple(x.shape)}")
        top_k = self.top_k if top_k is None else self._check_top_k(top_k)
        cf = self.capacity_factor if capacity_factor is None else self._check_capacity_factor(capacity_factor)
        x_TD = x.reshape(-1, self.model_dim)

        # Routers compute in fp32 (Switch Transformer's selective precision), under autocast too:
        # a bf16 router matmul would flip near-tied choices.
        # (Leaving autocast costs a context switch, so only when it is on.)
        device = x_TD.device.type
        # Inside a block recomputed by full activation checkpointing, the routing recorded by the
        # first forward is replayed (moetrain/moe/recompute.py): same plan, gate state untouched.
        phase = recompute.routing_phase()
        replaying = phase is not None and phase[1]
        gate_state = [buffer.clone() for buffer in self.gate.buffers()] if replaying else None
        with torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext():
            routed = self.gate(x_TD, top_k)
        if replaying:
            with torch.no_grad():
                for buffer, value in zip(self.gate.buffers(), gate_state):
                    buffer.copy_(value)
        priority_T = routed.priority() if self.batch_prioritized else None
        if replaying:
            plan, global_load_E, global_choices = phase[0].next(self)
        else:
            plan = make_plan(routed.topk_idx_TK, priority_T, self.num_experts, cf, self.batch_prioritized, self.impl)
            global_load_E, global_choices = self._global_load(plan.load_E, routed.topk_idx_TK.numel())
            if phase is not None:
                phase[0].add(self, (plan, global_load_E, global_choices))
        # Under autocast the expert GEMMs multiply in the autocast dtype, so the tokens are cast once,
        # here, instead of after dispatch: a copy commutes with the cast (same forward bit for bit),
        # and dispatch, its backward, expert parallelism's all-to-all and each GEMM's input move half
        # the bytes of fp32 activations. The router above still reads them in fp32.
        x_experts_TD = x_TD
        if x_TD.dtype == torch.float32 and torch.is_autocast_enabled(device):
            x_experts_TD = x_TD.to(torch.get_autocast_dtype(device))
        if self._first_gemm_gathers(plan, adaptive_r, a2a_ffn_overlap_degree):
            tokens = TokenRows(x_experts_TD, plan.dest_TK, plan.num_rows, self.impl)
            if self.parallel is None:
                out_RD = self.experts(tokens, plan.counts_E, plan.capacity)
            else:
                out_RD = self.parallel.run_experts(self.experts, tokens, plan, adaptive_r, a2a_ffn_overlap_degree)
        else:
            buf_RD = ops.dispatch(x_experts_TD, plan.dest_TK, plan.num_rows, impl=self.impl)
            out_RD = self.run_experts(buf_RD, plan, adaptive_r, a2a_ffn_overlap_degree)
        y_TD = ops.combine(out_RD, plan.dest_TK, routed.topk_weight_TK, impl=self.impl)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD).to(y_TD.dtype)

        # The plan already counts the choices per expert (before dropping): the balance loss's f_e.
        if self.balance_loss == "sequence":
            if x.dim() < 3:
                raise ValueError(f"balance_loss='sequence' needs x shaped [..., sequence, model_dim], got shape "
                                 f"{tuple(x.shape)}: pass sequences, or use micro_batch or global_batch")
            sequence_shape = (-1, x.size(-2))
            balance = losses.sequence_balance_loss(routed.probs_TE.view(*sequence_shape, self.num_experts),
                                                   routed.topk_idx_TK.view(*sequence_shape, top_k))
        elif self.balance_loss == "global_batch":
            balance = losses.balance_loss(routed.probs_TE, global_load_E, global_choices)
        else:
            balance = losses.balance_loss(routed.probs_TE, plan.load_E, routed.topk_idx_TK.numel())
        # Weight 1 (the default) returns the loss itself: torch.compile (torch 2.14's inductor) failed
        # in backward when a graph returned both `1.0 * balance` and `balance.detach()`.
        aux_loss = balance if self.balance_loss_weight == 1.0 else self.balance_loss_weight * balance
        z = None
        if self.z_loss_weight:  # otherwise computed only if someone reads stats.z_loss
            z = losses.z_loss(routed.logits_TE)
            aux_loss = aux_loss + self.z_loss_weight * z
        if not replaying:  # a recomputation's losses feed its backward only; the first forward's stand
            self.aux_loss = aux_loss
            self.stats = RoutingStats(
                tokens_per_expert=plan.load_E.detach(),
                kept_per_expert=plan.counts_E.detach(),
                padded_capacity=plan.capacity,
                balance_loss=balance.detach(),
                router_logits=routed.logits_TE.detach(),
                z_loss_value=None if z is None else z.detach(),
            )
        return y_TD.view(x.shape[:-1] + (y_TD.size(-1),))

    def _global_load(self, load_E: torch.Tensor, choices: int) -> tuple[torch.Tensor | None, int]:
        """global_batch: the choices per expert and their number, summed over the ranks of
        balance_group (one all-reduce of E + 1 counts on the tokens' device: no host sync)."""
        if self.balance_loss != "global_batch":
            return None, choices
        if not (dist.is_available() and dist.is_initialized()):
            return load_E, choices
        counts = torch.cat([load_E, load_E.new_full((1,), choices)])
        dist.all_reduce(counts, group=self.balance_group)
        return counts[:-1], counts[-1]

    def _first_gemm_gathers(self, plan: RoutingPlan, adaptive_r: int | None,
                            a2a_ffn_overlap_degree: int | None) -> bool:
        """FP8 with the built-in experts: their first GEMM quantizes each token once and gathers the
        FP8 rows (TokenRows) instead of quantizing each dispatched copy: half the bytes moved, the
        same numbers bit for bit. Under expert parallelism (the packed layout at r = 1) the FP8 rows
        travel to the experts' ranks (moetrain.parallel.expert.ExchangedTokenRows). Custom experts,
        recomputed experts and the other expert-parallel modes take the dispatched rows."""
        if (self.precision == "bf16" or _own_class(self.experts) not in (SwiGLUExperts, FFNExperts)
                or (self.recompute_experts and torch.is_grad_enabled())):
            return False
        if self.parallel is None:
            return adaptive_r is None and a2a_ffn_overlap_degree is None
        return self.parallel.takes_token_rows(plan, adaptive_r)

    def run_experts(self, buf_RD: torch.Tensor, plan: RoutingPlan, adaptive_r: int | None = None,
                    a2a_ffn_overlap_degree: int | None = None) -> torch.Tensor:
        """The experts on the expert-major buffer; expert parallelism plugs in here."""
        recompute_experts = self.recompute_experts and torch.is_grad_enabled()
        if self.parallel is not None:
            return self.parallel.run_experts(self.experts, buf_RD, plan, adaptive_r, a2a_ffn_overlap_degree,
                                             recompute=recompute_experts)
        if adaptive_r is not None or a2a_ffn_overlap_degree is not None:
            raise ValueError("adaptive_r and a2a_ffn_overlap_degree need expert parallelism: call "
                             "moetrain.parallel.parallelize(model) after initialising torch.distributed")
        if recompute_experts:
            return recompute.checkpoint_experts(self.experts, self.experts, buf_RD, plan.counts_E, plan.capacity)
        return self.experts(buf_RD, plan.counts_E, plan.capacity)


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [module for module in model.modules() if isinstance(module, MoELayer)]


def set_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Set the mode (moetrain/moe/recompute.py) on every checkpointed block and MoE layer of `model`."""
    recompute.check_mode(mode)
    blocks = [module for module in model.modules() if isinstance(module, recompute.CheckpointedBlock)]
    if mode == "full" and not blocks:
        raise ValueError("activation_checkpointing=full recomputes transformer blocks and this model has none: "
                         "use selective (MoE layers' experts) or none")
    if mode == "selective" and not blocks and not moe_layers(model):
        raise ValueError("activation_checkpointing=selective recomputes attention and experts and this model has "
                         "neither transformer blocks nor MoE layers: use none")
    for block in blocks:
        block.activation_checkpointing = mode
    for layer in moe_layers(model):
        layer.recompute_experts = mode == "selective"
