"""Expert parallelism with Tutel's adaptive degree r, plugged into MoELayer.run_experts.

    expert_parallels = parallelize(model, adaptive_r=1)  # every rank, after init_distributed()
    y = layer(x)                                       # r=1: tokens travel by all-to-all
    y = layer(x, adaptive_r=0)                         # this call data parallel, same weights
    y = layer(x, a2a_ffn_overlap_degree=4)             # all-to-all overlapped with experts in 4 chunks

parallelize() keeps only this rank's experts (see layout.py for where they live) and attaches an
ExpertParallel to each MoELayer. The expert parameters' gradients come out already divided by the
world size W (the optimizer's mean over ranks; see _mean_gradient_experts). Between dispatch and
combine, the expert-major buffer is exchanged so that each rank runs its own experts on every
rank's rows for them:

  padded layout (capacity_factor > 0): [E, C, D] blocks; one fixed-size all-to-all splits the
      expert dim and concatenates the capacity dim, so local expert l sees [G*C, D] rows
      (C is first made equal on all ranks: the largest capacity, agreed through a CPU (Gloo)
      group so that no GPU value is read back, rounded up to the overlap degree);
  packed layout (dropless): the per-expert row counts are exchanged first, then rows move by an
      uneven all-to-all and are regrouped expert-major.

exchange="peer_memory" (GPUs of one machine, NCCL group) moves the unchunked padded buffer through
collectives.PeerMemoryExchange instead: each rank reads its rows from the other GPUs' memory straight into
expert-major order and the results back into destination order, so neither the regrouping copies
nor NCCL kernels run (chunked calls, a2a_ffn_overlap_degree > 1, still use the all-to-all below).

With a2a_ffn_overlap_degree = n > 1 the capacity dim is cut into n chunks: all chunks'
all-to-alls are launched at once (collectives.all_to_all_start) and each chunk's experts wait, on the GPU
stream only, for that chunk's rows, so on GPUs communication overlaps expert compute; backward
overlaps the same way (see _padded). Chunking costs one more copy of the buffer each way and,
for experts whose weight gradient is a GEMM over all rows, one more addition of that gradient per
extra chunk, so it pays only where an exchange takes longer than those (on two NVLink H200s it
did not: docs/distributed.md). Only the padded layout is chunked; a dropless layer (whose row
counts are only known after an exchange) runs unchunked, so one model-wide degree works for
models that mix both.

In FP8 precision (MoELayer(precision="fp8" | "fp8_block")) a dropless layer with r = 1 and its
built-in experts hands run_experts the tokens (moetrain.moe.experts.TokenRows) instead of the bf16
buffer: each token is quantized once on its own rank and its E4M3 rows travel with their scales,
packed as bytes (ExchangedTokenRows; moetrain.precision.fp8_matmul.fp8_exchanged_matmul), about half the
bytes of bf16 rows. The input gradient returns in bf16; the weight gradient is taken from the
received FP8 rows, dequantized (with fp8_wgrad="fp8" quantized again: DeepSeek-V3's double
quantization).

Shape letters: E experts, V virtual experts (E*r), C capacity, D model dim, G ranks of the
expert-parallel group, R buffer rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from moetrain import collectives
from moetrain.moe.experts import Experts, FFNExperts, SwiGLUExperts, TokenRows, mark_expert
from moetrain.moe.recompute import checkpoint_call, checkpoint_experts
from moetrain.moe.routing import RoutingPlan
from moetrain.parallel.layout import ExpertLayout, group_timeout

# Which axis of each expert parameter is the hidden dimension (r > 1 splits it). None: a parameter
# without one (the output bias), added by slice 0 only so the summed slices add it once.
HIDDEN_AXES: dict[type[Experts], dict[str, int | None]] = {
    FFNExperts: {"w1": 2, "b1": 1, "w2": 1, "b2": None},
    SwiGLUExperts: {"w_gate_up": 2, "w_down": 1},  # w_gate_up alternates gate and up columns: a hidden slice is contiguous
}


# How padded rows travel between the ranks (see the top of this file).
EXCHANGES = ("all_to_all", "peer_memory")


def _check_exchange(exchange) -> str:
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {list(EXCHANGES)}, got {exchange!r}")
    return exchange


def _check_overlap(degree) -> int:
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"a2a_ffn_overlap_degree must be an integer >= 1, got {degree!r}")
    return degree


def host_group(group=None, timeout_s: float | None = None):
    """A Gloo group with the ranks of `group`, for agreeing on host-side values without touching a
    GPU: `group` itself when it is Gloo already. A new group's collectives wait at most timeout_s
    seconds (None: as long as `group`'s). Collective: every rank of the world must call it."""
    if dist.get_backend(group) == "gloo":
        return group
    return dist.new_group(dist.get_process_group_ranks(group or dist.group.WORLD), backend="gloo",
                          timeout=group_timeout(group, timeout_s))


def _swap_leading(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """x as [a, b, rest] -> [b, a, rest flattened], contiguous. The blocks are large and contiguous, but an
    elementwise copy of a permuted 16-bit tensor moves one element per load (about a third of the
    H200's copy bandwidth for these buffers); viewed as 8-byte words it moves four at a time."""
    x_ABZ = x.reshape(a, b, -1)
    words = x_ABZ.size(-1) and x_ABZ.stride(-1) == 1 and all(
        (value * x.element_size()) % 8 == 0 for value in (x_ABZ.size(-1), x_ABZ.stride(0), x_ABZ.stride(1),
                                                          x_ABZ.storage_offset()))
    if words:
        return x_ABZ.view(torch.int64).transpose(0, 1).contiguous().view(x.dtype)
    return x_ABZ.transpose(0, 1).contiguous()


class _SwapLeading(torch.autograd.Function):
    """_swap_leading with the reverse swap as its backward."""

    @staticmethod
    def forward(ctx, x, a, b):
        ctx.sizes, ctx.shape = (a, b), x.shape
        return _swap_leading(x, a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.sizes
        return _swap_leading(grad, b, a).view(ctx.shape), None, None


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient times `factor` in backward."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


@dataclass
class _PackedExchange:
    """The packed layout's uneven all-to-all in both directions, its splits agreed: rows leave this
    rank in expert order (send_rows[g] for rank g) and arrive regrouped expert-major (perm)."""

    group: object
    send_rows: list[int]
    recv_rows: list[int]
    perm: torch.Tensor  # expert-major row i is received row perm[i]
    back: torch.Tensor  # and received row j is expert-major row back[j]

    @property
    def sent_rows(self) -> int:
        return sum(self.send_rows)

    @property
    def received_rows(self) -> int:
        return sum(self.recv_rows)

    def to_experts(self, rows: torch.Tensor) -> torch.Tensor:
        arrived = collectives.all_to_all_single(rows, self.recv_rows, self.send_rows, group=self.group)
        return arrived.index_select(0, self.perm)

    def to_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        return collectives.all_to_all_single(rows.index_select(0, self.back), self.send_rows, self.recv_rows,
                                             group=self.group)


@dataclass
class ExchangedTokenRows(TokenRows):
    """TokenRows whose expert-major rows (the first exchange.sent_rows of them: dispatch's packed
    rows) belong to experts on other ranks: the rows this rank's experts receive. gather() exchanges
    the rows themselves (bf16); in FP8 the tokens are quantized once and the E4M3 rows travel."""

    exchange: _PackedExchange | None = None

    def gather(self) -> torch.Tensor:
        return self.exchange.to_experts(super().gather()[:self.exchange.sent_rows])

    def fp8_matmul(self, w_EIO: torch.Tensor, counts_E, capacity: int | None, precision: str,
                   wgrad: str) -> torch.Tensor:
        from moetrain.precision.fp8_matmul import fp8_exchanged_matmul  # noqa: PLC0415  (Triton: loaded in FP8 only)

        return fp8_exchanged_matmul(self.x_TD, self.dest_TK, self.num_rows, self.exchange, w_EIO, counts_E, precision,
                                    self.impl, wgrad)


def _mean_gradient_experts(experts, params, x_RD, counts, capacity, world_size, recompute=False):
    """The experts on x_RD with their weight gradients divided by world_size, as the optimizer's
    mean over ranks needs (see optimizer.py): the gradient entering their backward is divided and
    the one leaving towards the tokens multiplied back. Two passes over the activations here cost
    far less than one over every expert's weight gradient after the backward (on 2 GPUs of the
    benchmark: 2 x 67 MB a layer against 537 MB of bf16 weight gradients a layer).
    recompute: the experts' hidden activations are recomputed in backward (selective activation
    checkpointing); only the local computation is, never the exchange around it.
    params None: the experts' own parameters, through a module call (FSDP-sharded experts)."""
    def run(x_RD, *param_values, part="all"):
        kwargs = {} if part == "all" else {"part": part}
        if params is None:  # sharded by FSDP: calling the module lets its hooks gather the parameters
            return experts(x_RD, counts, capacity, **kwargs)
        return functional_call(experts, dict(zip(params, param_values)), (x_RD, counts, capacity), kwargs)

    values = () if params is None else tuple(params.values())

    def call(x_RD):
        if recompute and params is None:
            # FSDP gathers the parameters at each module call: one call, recomputed whole
            return checkpoint_call(run, x_RD)
        if recompute:
            return checkpoint_experts(run, experts, x_RD, *values)
        return run(x_RD, *values)

    if world_size == 1:
        return call(x_RD)
    if isinstance(x_RD, TokenRows):  # the tokens themselves: their gradient is the rows' summed
        x_RD = dataclasses.replace(x_RD, x_TD=_ScaleGradient.apply(x_RD.x_TD, float(world_size)))
    else:
        x_RD = _ScaleGradient.apply(x_RD, float(world_size))
    y_RD = call(x_RD)
    return _ScaleGradient.apply(y_RD, 1.0 / world_size)


def _takes_tokens(plan: RoutingPlan, r: int) -> bool:
    """The layout whose FP8 rows travel (ExchangedTokenRows): packed, at r = 1."""
    return plan.capacity is None and r == 1


_SHARDED_EXPERTS = ("adaptive_r={r}, a2a_ffn_overlap_degree={overlap}: experts sharded by FSDP "
                    "(ParallelConfig.strategy='fsdp_expert') run once per call with r = 1; the adaptive degree and "
                    "the chunked overlap need ParallelConfig.strategy='expert'")


class ExpertParallel:
    """Runs one layer's experts across ranks; holds the default degree and overlap of that layer.
    host_group: a Gloo group with the layout's ranks (see host_group()), shared by all layers."""

    def __init__(self, layout: ExpertLayout, host_group, adaptive_r: int = 1, a2a_ffn_overlap_degree: int = 1,
                 exchange: str = "all_to_all"):
        self.layout = layout
        self.host_group = host_group
        self.adaptive_r = layout.check_r(adaptive_r)
        self.a2a_ffn_overlap_degree = _check_overlap(a2a_ffn_overlap_degree)
        self.exchange = _check_exchange(exchange)
        # Set by moetrain.parallel.fsdp.shard_model: the experts are an FSDP unit, whose hooks
        # gather their parameters when the module is called (so r = 1 only, by a module call).
        self.experts_sharded = False

    def takes_token_rows(self, plan: RoutingPlan, adaptive_r: int | None = None) -> bool:
        """Whether run_experts takes this call's tokens (TokenRows) for FP8 rows to travel: the
        packed layout at r = 1."""
        return _takes_tokens(plan, self.adaptive_r if adaptive_r is None else self.layout.check_r(adaptive_r))

    def run_experts(self, experts: Experts, buf_RD: torch.Tensor | TokenRows, plan: RoutingPlan,
                    adaptive_r: int | None = None, a2a_ffn_overlap_degree: int | None = None,
                    recompute: bool = False) -> torch.Tensor:
        """recompute: the experts' hidden activations are recomputed in backward (not the exchange).
        buf_RD: the expert-major rows, or the tokens where takes_token_rows (not recomputed)."""
        r = self.adaptive_r if adaptive_r is None else self.layout.check_r(adaptive_r)
        overlap = self.a2a_ffn_overlap_degree if a2a_ffn_overlap_degree is None else _check_overlap(a2a_ffn_overlap_degree)
        if self.experts_sharded and (r, overlap) != (1, 1):
            raise ValueError(_SHARDED_EXPERTS.format(r=r, overlap=overlap))
        if isinstance(buf_RD, TokenRows):
            if recompute or not _takes_tokens(plan, r):
                raise ValueError("run_experts takes TokenRows for the packed layout at r = 1, not recomputed: "
                                 "pass the dispatched rows")
            params = None if self.experts_sharded else dict(experts.named_parameters())
            return self._packed(experts, params, buf_RD, plan.counts_E, 1, False)
        if r == 0:
            return _mean_gradient_experts(experts, self._all_experts(experts), buf_RD, plan.counts_E, plan.capacity,
                                          self.layout.world_size, recompute)
        if self.experts_sharded:
            params = None
        else:
            params = dict(experts.named_parameters()) if r == 1 else self._hidden_slices(experts, r)
        if plan.capacity is not None:
            return self._padded(experts, params, buf_RD, plan.capacity, r, overlap, recompute)
        return self._packed(experts, params, buf_RD, plan.counts_E, r, recompute)

    # ------------------------------------------------------------------ weights for each degree

    def _all_experts(self, experts: Experts) -> dict[str, torch.Tensor]:
        """r = 0: every expert on every rank, gathered (the backward reduce-scatters the gradients)."""
        layout = self.layout
        gathered = {}
        for name, param in experts.named_parameters():
            full = collectives.all_gather(param, 0, layout.group)
            gathered[name] = full[::layout.replicas] if layout.replicas > 1 else full
        return gathered

    def _hidden_slices(self, experts: Experts, r: int) -> dict[str, torch.Tensor]:
        """r > 1: this rank's hidden slice of its (single, replicated) expert."""
        axes = next((axes for cls, axes in HIDDEN_AXES.items() if type(experts) is cls), None)
        names = {name for name, _ in experts.named_parameters()}
        if axes is None or set(axes) != names:
            raise ValueError(f"adaptive_r > 1 splits the experts' hidden dimension, which moetrain knows for "
                             f"{[cls.__name__ for cls in HIDDEN_AXES]} only; got {type(experts).__name__}")
        if experts.hidden_size % r:
            raise ValueError(f"adaptive_r={r} must divide the experts' hidden_size={experts.hidden_size}")
        j = self.layout.shard_index(r)
        piece = experts.hidden_size // r
        sliced = {}
        for name, param in experts.named_parameters():
            axis = axes[name]
            if axis is None:
                sliced[name] = param if j == 0 else param * 0
            else:  # a fused parameter (w_gate_up: 2H columns) holds several columns per hidden unit
                per_unit = param.size(axis) // experts.hidden_size
                sliced[name] = param.narrow(axis, j * piece * per_unit, piece * per_unit)
        return sliced

    # ------------------------------------------------------------------ token exchange

    def _agreed_capacity(self, capacity: int) -> int:
        """The largest capacity of any rank, agreed on the host through the CPU group: a GPU
        all-reduce would have to be read back, and each read drains the GPU's queue. It runs on
        every call: a rank cannot tell from its own capacity whether another rank's changed, and a
        rank that skipped the exchange while another joined it would hang both."""
        if self.layout.world_size == 1:
            return capacity
        value = torch.tensor([capacity], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.host_group)
        return int(value[0])

    def _padded(self, experts, params, buf_RD, capacity, r, overlap, recompute):
        layout = self.layout
        group = layout.expert_group(r)
        members = dist.get_world_size(group)
        num_experts, dim = layout.num_experts, buf_RD.size(-1)
        # Every rank must send blocks of the same size: the largest capacity, cut into equal chunks.
        # (Agreed over the whole parallel group, a superset of this r's expert group, so any r works.)
        common = -(-self._agreed_capacity(capacity) // overlap) * overlap
        x_ECD = buf_RD.view(num_experts, capacity, dim)
        if common > capacity:
            x_ECD = nn.functional.pad(x_ECD, (0, 0, 0, common - capacity))
        x_VCD = x_ECD if r == 1 else x_ECD.unsqueeze(1).expand(num_experts, r, common, dim).reshape(-1, common, dim)
        local, chunk = x_VCD.size(0) // members, common // overlap
        if self.exchange == "peer_memory" and overlap == 1:
            y_VCD = self._through_peer_memory(experts, params, x_VCD, group, local, recompute)
            if r > 1:
                y_VCD = y_VCD.view(num_experts, r, common, -1).sum(1)
            return y_VCD[:, :capacity].reshape(num_experts * capacity, -1)

        def compute(recv_VcD):
            # Received source-major [G, L, c, D]; the experts want expert-major [L, G*c, D] rows, and
            # the results go back destination-major [G, L, c, D]: a copy each way.
            x_RD = _SwapLeading.apply(recv_VcD, members, local).view(-1, dim)
            counts = torch.full((local,), members * chunk, dtype=torch.long, device=x_RD.device)
            y_RD = _mean_gradient_experts(experts, params, x_RD, counts, members * chunk, layout.world_size,
                                          recompute)
            return _SwapLeading.apply(y_RD, local, members).view(local * members, chunk, -1)

        # Chunks of the capacity dim. Every dispatch exchange is launched first; chunk i's experts
        # wait (on the GPU stream, not the host) for chunk i only, and its results leave while
        # chunk i+1 computes. The waits for the returning chunks come last, so none of them holds
        # back a later chunk's experts. In backward the autograd engine runs the highest sequence
        # number first: the waits' backwards launch every returning chunk's reverse exchange at
        # once, then chunk n-1 to 0 run their expert backward, each launching its dispatch's
        # reverse exchange, which travels while the next chunk's expert backward runs.
        arriving = [collectives.all_to_all_start(x_VcD, group) for x_VcD in x_VCD.chunk(overlap, dim=1)]
        leaving = [collectives.all_to_all_start(compute(collectives.exchange_wait(flight)), group)
                   for flight in arriving]
        returned = [collectives.exchange_wait(flight) for flight in leaving]
        y_VCD = returned[0] if overlap == 1 else torch.cat(returned, dim=1)
        if r > 1:
            y_VCD = y_VCD.view(num_experts, r, common, -1).sum(1)
        return y_VCD[:, :capacity].reshape(num_experts * capacity, -1)

    def _through_peer_memory(self, experts, params, x_VCD, group, local, recompute):
        """Unchunked exchange through peer memory: the rows arrive expert-major ([L, G*C, D]) and
        the results leave from there, with no regrouping copies and no NCCL kernel."""
        exchange = self.layout.peer_exchanges.get(group)
        if exchange is None:
            exchange = self.layout.peer_exchanges[group] = collectives.PeerMemoryExchange(group)
        x_LRD = exchange.all_to_all(x_VCD, 0, 1)
        rows = x_LRD.size(1)
        counts = torch.full((local,), rows, dtype=torch.long, device=x_LRD.device)
        y_RD = _mean_gradient_experts(experts, params, x_LRD.view(-1, x_LRD.size(-1)), counts, rows,
                                      self.layout.world_size, recompute)
        return exchange.all_to_all(y_RD.view(local, rows, -1), 1, 0)

    def _packed(self, experts, params, buf_RD, counts_E, r, recompute):
        layout = self.layout
        group = layout.expert_group(r)
        members = dist.get_world_size(group)
        rows_E = counts_E.tolist()
        used = sum(rows_E)
        tokens = buf_RD if isinstance(buf_RD, TokenRows) else None
        if tokens is not None:  # r = 1 (run_experts)
            x_RD, counts_V, total = None, counts_E, tokens.num_rows
        elif r > 1:
            # Each expert's rows once per hidden slice: virtual expert e*r + j gets expert e's rows.
            starts = [sum(rows_E[:e]) for e in range(len(rows_E))]
            index = torch.cat([torch.arange(starts[e], starts[e] + n, device=buf_RD.device)
                               for e, n in enumerate(rows_E) for _ in range(r)])
            x_RD = buf_RD.index_select(0, index)
            counts_V, total = counts_E.repeat_interleave(r), buf_RD.size(0)
        else:
            x_RD, counts_V, total = buf_RD[:used], counts_E, buf_RD.size(0)
        local = counts_V.numel() // members
        send_counts_GL = counts_V.view(members, local)
        recv_counts_GL = collectives.all_to_all_single(send_counts_GL, group=group)
        send_rows = send_counts_GL.sum(1).tolist()
        recv_rows = recv_counts_GL.sum(1).tolist()

        # Received blocks are source-major (g, l); the experts want them expert-major (l, g).
        device = (buf_RD if tokens is None else tokens.x_TD).device
        sizes = recv_counts_GL.flatten().tolist()
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        order = [(g * local + l) for l in range(local) for g in range(members)]
        perm = torch.cat([torch.arange(offsets[b], offsets[b] + sizes[b], device=device) for b in order]
                         + [torch.empty(0, dtype=torch.long, device=device)])
        back = torch.empty_like(perm).index_copy_(0, perm, torch.arange(perm.numel(), device=device))
        exchange = _PackedExchange(group, send_rows, recv_rows, perm, back)
        rows = exchange.to_experts(x_RD) if tokens is None else ExchangedTokenRows(
            tokens.x_TD, tokens.dest_TK, tokens.num_rows, tokens.impl, exchange)
        y_RD = exchange.to_tokens(_mean_gradient_experts(experts, params, rows, recv_counts_GL.sum(0), None,
                                                         layout.world_size, recompute))

        if r > 1:
            y_RD = y_RD.new_zeros(used, y_RD.size(-1)).index_add(0, index, y_RD)
        pad = total - used
        return torch.cat([y_RD, y_RD.new_zeros(pad, y_RD.size(-1))]) if pad else y_RD


# ---------------------------------------------------------------------- attaching to a model


@torch.no_grad()
def _keep_local_experts(experts: Experts, layout: ExpertLayout) -> None:
    """Replace each [E, ...] expert parameter by this rank's rows (rank 0's values on every rank)."""
    for module in experts.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0 or param.size(0) != layout.num_experts:
                raise ValueError(f"expert parameter {name!r} has shape {tuple(param.shape)}; expert parallelism "
                                 f"needs every expert parameter stacked as [num_experts={layout.num_experts}, ...]")
            full = param.detach().clone()
            dist.broadcast(full, layout.ranks[0], group=layout.group)
            local = nn.Parameter(full[layout.local_slice].clone(), requires_grad=param.requires_grad)
            setattr(module, name, mark_expert(local))


def parallelize(model: nn.Module, adaptive_r: int = 1, a2a_ffn_overlap_degree: int = 1, group=None,
                exchange: str = "all_to_all", timeout_s: float | None = None) -> list[ExpertParallel]:
    """Shard the experts of every MoELayer in `model` over the ranks of `group` (in place; call on
    every rank with the same full model before building the optimizer). Returns the layers'
    ExpertParallel objects. exchange: how padded rows travel (see the top of this file); an
    ExpertParallel's `exchange` attribute may be changed between calls. timeout_s: how long the process groups made here wait in a
    collective (parallel.timeout_s; None: as long as `group`'s)."""
    from moetrain.moe import moe_layers

    layouts: dict[int, ExpertLayout] = {}
    expert_parallels = []
    cpu_group = host_group(group, timeout_s)
    for layer in moe_layers(model):
        if layer.parallel is not None:
            raise ValueError("this model is already parallelized")
        if layer.num_experts not in layouts:
            layouts[layer.num_experts] = ExpertLayout(layer.num_experts, group, timeout_s)
        layout = layouts[layer.num_experts]
        expert_parallel = ExpertParallel(layout, cpu_group, adaptive_r, a2a_ffn_overlap_degree, exchange)  # checks first
        _keep_local_experts(layer.experts, layout)
        layer.parallel = expert_parallel
        expert_parallels.append(expert_parallel)
    if not expert_parallels:
        raise ValueError("parallelize: the model has no MoELayer")
    return expert_parallels


def set_adaptive_r(model: nn.Module, adaptive_r: int) -> None:
    """Change the default degree of every parallelized MoELayer (weights stay where they are)."""
    from moetrain.moe import moe_layers

    for layer in moe_layers(model):
        if layer.parallel is not None:
            r = layer.parallel.layout.check_r(adaptive_r)
            if layer.parallel.experts_sharded and r != 1:
                raise ValueError(_SHARDED_EXPERTS.format(r=r, overlap=layer.parallel.a2a_ffn_overlap_degree))
            layer.parallel.adaptive_r = r
