"""Communication primitives over torch.distributed, differentiable where they carry activations.

Every function takes an optional process group (None: the default world group) and works on any
backend that implements the underlying collective (NCCL on GPUs, Gloo on CPUs).

Gradients follow one rule: the loss being differentiated is the sum of every rank's local loss.
So a collective whose output is replicated on all ranks (all_gather, simple_all_reduce) sums the
ranks' gradients on the way back, and one that hands each rank a piece of a logical tensor
(reduce_scatter, zero_scatter) gathers the pieces' gradients back:

    all_to_all          <-> all_to_all with split and concat dims swapped
    all_to_all_single   <-> all_to_all_single with input and output splits swapped
    all_to_all_start + exchange_wait <-> the same all-to-all, launched by exchange_wait's
                        backward and waited for by all_to_all_start's backward
    all_gather          <-> reduce_scatter        zero_gather <-> reduce-scatter of the flat tensor
    reduce_scatter      <-> all_gather            zero_scatter <-> all-gather of the flat tensor
    simple_all_reduce   <-> simple_all_reduce (sum)

zero_gather / zero_scatter work on flattened tensors cut into equal, zero-padded shards, the
layout ZeRO uses for parameters: zero_gather(zero_scatter(x), x.numel()) == x.flatten().

all_to_all_start launches an equal-split all_to_all_single and exchange_wait reads its result, so
work can be queued in between (on NCCL the wait only makes the current CUDA stream wait; the host
never blocks). Their backward is split the same way: the backward of exchange_wait launches the
reverse exchange and the backward of all_to_all_start waits for it, so the autograd engine can run
other nodes while a gradient travels.

PeerMemoryExchange moves the same data as all_to_all(x, 0, 1) / all_to_all(x, 1, 0) between the
GPUs of one machine without NCCL: each rank copies what its peers need once into memory every rank
can read (torch's symmetric memory, over NVLink), and each rank reads its pieces from every peer
straight into their final, regrouped place, so the expert-major regrouping needs no copy of its own.

Hierarchical all-to-all (`TwoLevelGroups`, `hierarchical_all_to_all`) exchanges within a node
first and across nodes second, so each pair of nodes exchanges one large message instead of
local_size^2 small ones; it computes exactly what all_to_all_single computes on equal splits.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

__all__ = [
    "ExchangeInFlight", "PeerMemoryExchange", "TwoLevelGroups", "all_gather", "all_to_all", "all_to_all_single",
    "all_to_all_start", "exchange_wait", "get_rank", "get_world_size", "hierarchical_all_to_all", "reduce_scatter",
    "simple_all_reduce", "zero_gather", "zero_scatter",
]


# torch 2.14 renamed the single-tensor collectives; older releases (down to 2.4) have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def get_world_size(group=None) -> int:
    return dist.get_world_size(group)


def get_rank(group=None) -> int:
    return dist.get_rank(group)


def _split_evenly(size: int, world: int, what: str) -> int:
    if size % world:
        raise ValueError(f"{what}: size {size} is not divisible by the group size {world}")
    return size // world


# --------------------------------------------------------------------------- all-to-all


def _all_to_all_dims(x: torch.Tensor, split_dim: int, concat_dim: int, group) -> torch.Tensor:
    world = get_world_size(group)
    split_dim %= x.dim()
    concat_dim %= x.dim()
    piece = _split_evenly(x.size(split_dim), world, f"all_to_all(split_dim={split_dim})")
    # [W, *piece_shape]: piece i (to rank i) first, so one all_to_all_single moves everything.
    send = x.unflatten(split_dim, (world, piece)).movedim(split_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[i] came from rank i: concatenate the pieces along concat_dim in rank order.
    return recv.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, concat_dim, group):
        ctx.dims, ctx.group = (split_dim, concat_dim), group
        return _all_to_all_dims(x, split_dim, concat_dim, group)

    @staticmethod
    def backward(ctx, grad):
        split_dim, concat_dim = ctx.dims
        return _AllToAll.apply(grad, concat_dim, split_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, split_dim: int = 0, concat_dim: int = 0, group=None) -> torch.Tensor:
    """Cut x into W equal pieces along split_dim, send piece i to rank i, and concatenate the W
    received pieces (in rank order) along concat_dim."""
    return _AllToAll.apply(x, split_dim, concat_dim, group)


def _sizes(value) -> list[int] | None:
    return None if value is None else [int(v) for v in value]


class _AllToAllSingle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):
        ctx.splits, ctx.group = (output_split_sizes, input_split_sizes), group
        if output_split_sizes is None:
            _split_evenly(x.size(0), get_world_size(group), "all_to_all_single")
            rows = x.size(0)
        else:
            rows = sum(output_split_sizes)
        out = x.new_empty((rows,) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_split_sizes, input_split_sizes = ctx.splits
        return _AllToAllSingle.apply(grad.contiguous(), input_split_sizes, output_split_sizes, ctx.group), None, None, None


def all_to_all_single(x: torch.Tensor, output_split_sizes=None, input_split_sizes=None, group=None) -> torch.Tensor:
    """Rows input_split_sizes[i] of x go to rank i; output_split_sizes[i] rows come from rank i
    (None: equal splits of dim 0)."""
    if (output_split_sizes is None) != (input_split_sizes is None):
        raise ValueError("all_to_all_single: give both output_split_sizes and input_split_sizes, or neither")
    return _AllToAllSingle.apply(x, _sizes(output_split_sizes), _sizes(input_split_sizes), group)


# --------------------------------------------------------------------------- asynchronous exchanges


class ExchangeInFlight:
    """An all-to-all started by all_to_all_start and not yet read. It holds the handle of whichever
    exchange of the pair is running: the forward one until exchange_wait, then, in backward, the
    reverse one from exchange_wait's backward until all_to_all_start's backward."""

    def __init__(self, group):
        self.group = group
        self.work = None
        self.sending: torch.Tensor | None = None
        self.output: torch.Tensor | None = None

    def launch(self, x: torch.Tensor) -> torch.Tensor:
        # The input stays referenced until finish(): until then the caching allocator must not hand
        # its memory to kernels of the current stream while the exchange may still read it.
        self.sending = x.contiguous()
        out = torch.empty_like(self.sending)
        self.work = dist.all_to_all_single(out, self.sending, group=self.group, async_op=True)
        return out

    def finish(self) -> None:
        self.work.wait()
        self.work, self.sending = None, None


class _StartExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, flight):
        ctx.flight = flight
        return flight.launch(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        ctx.flight.finish()  # grad is the buffer that _WaitExchange.backward's exchange fills
        return grad, None


class _WaitExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, flight):
        ctx.flight = flight
        flight.finish()
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return ctx.flight.launch(grad), None  # an equal-split all-to-all is its own reverse


def all_to_all_start(x: torch.Tensor, group=None) -> ExchangeInFlight:
    """Launch all_to_all_single(x) (equal splits of dim 0) and return at once; read the result with
    exchange_wait. Every rank must start (and wait for) its exchanges in the same order."""
    _split_evenly(x.size(0), get_world_size(group), "all_to_all_start")
    flight = ExchangeInFlight(group)
    flight.output = _StartExchange.apply(x, flight)
    return flight


def exchange_wait(flight: ExchangeInFlight) -> torch.Tensor:
    """The result of a started exchange. On CUDA only the current stream waits for it."""
    if flight.output is None:
        raise ValueError("exchange_wait: this exchange was already waited for")
    out, flight.output = flight.output, None
    return _WaitExchange.apply(out, flight)


# --------------------------------------------------------------------------- exchange through peer memory


def _as_words(x: torch.Tensor) -> torch.Tensor:
    """x viewed as 8-byte words where its sizes, strides and offset allow (a strided copy then moves
    8 bytes per element instead of 2 for bf16), else x itself."""
    size = x.element_size()
    fits = x.dim() and x.stride(-1) == 1 and (x.size(-1) * size) % 8 == 0 and (x.storage_offset() * size) % 8 == 0 \
        and all((stride * size) % 8 == 0 for stride in x.stride()[:-1])
    return x.view(torch.int64) if fits and size < 8 else x


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst_words, src_words = _as_words(dst), _as_words(src)
    if dst_words.dtype == src_words.dtype:
        dst_words.copy_(src_words)
    else:
        dst.copy_(src)


class PeerMemoryExchange:
    """Equal-split all-to-all between the GPUs of one machine through symmetric memory, for the two
    regroupings expert parallelism needs (see all_to_all):

        exchange.all_to_all(x, 0, 1)   # [G*L, C, ...] -> [L, G*C, ...]
        exchange.all_to_all(y, 1, 0)   # [L, G*C, ...] -> [G*L, C, ...]

    Each call copies the pieces of x meant for the peers into a buffer every rank maps, waits on the
    GPU (a device-side barrier; the host never blocks) until every rank has, reads the pieces meant
    for this rank from every peer (its own from x) straight into their regrouped place, and waits
    again so that no rank overwrites its buffer while a peer still reads it. Build one on every rank
    of `group` together (an NCCL group: one GPU per rank, peer access between them); the buffer
    grows, collectively, to the largest exchange."""

    def __init__(self, group=None):
        if dist.get_backend(group) != "nccl":
            raise ValueError(f"PeerMemoryExchange needs an NCCL group (GPUs of one machine), got backend "
                             f"{dist.get_backend(group)!r}: use exchange='all_to_all' there")
        from torch.distributed import _symmetric_memory as symmetric_memory

        self.symmetric_memory = symmetric_memory
        self.group_name = (group or dist.group.WORLD).group_name
        self.world, self.rank = get_world_size(group), get_rank(group)
        self.buffer: torch.Tensor | None = None
        self.handle = None
        if hasattr(symmetric_memory, "enable_symm_mem_for_group"):
            # Older torch releases need it before a rendezvous; newer ones deprecate it as a no-op.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symmetric_memory.enable_symm_mem_for_group(self.group_name)

    def _shared_view(self, rank: int, like: torch.Tensor) -> torch.Tensor:
        """Rank `rank`'s shared buffer (this rank's own, or a peer's mapped here) viewed like `like`."""
        nbytes = like.numel() * like.element_size()
        if rank == self.rank:
            return self.buffer[:nbytes].view(like.dtype).view(like.shape)
        return self.handle.get_buffer(rank, (nbytes,), torch.uint8).view(like.dtype).view(like.shape)

    def exchange(self, x: torch.Tensor, split_dim: int, concat_dim: int) -> torch.Tensor:
        """all_to_all(x, split_dim, concat_dim) for (0, 1) and (1, 0), without autograd."""
        if (split_dim, concat_dim) not in ((0, 1), (1, 0)) or x.dim() < 2 or not x.is_cuda:
            raise ValueError(f"PeerMemoryExchange moves CUDA tensors of 2 or more dims with (split_dim, concat_dim) "
                             f"(0, 1) or (1, 0), got {(split_dim, concat_dim)} on {x.device} with {x.dim()} dims")
        world, rows = self.world, x.size(0)
        x = x.contiguous()
        # Both regroupings as 4-dim blocks: piece(x_view, g) is what x sends to rank g, and what
        # arrives from rank g lands in piece(out_view, g).
        if split_dim == 0:  # x [G*L, C, rest] -> out [L, G*C, rest]
            local = _split_evenly(rows, world, "PeerMemoryExchange(split_dim=0)")
            x_view = x.view(world, local, x.size(1), -1)  # [G, L, C, rest]
            out = x.new_empty((local, world * x.size(1)) + tuple(x.shape[2:]))
            out_view = out.view(local, world, x.size(1), -1)  # [L, G, C, rest]

            def piece(view, g, sending=True):
                return view[g] if sending else view[:, g]
        else:  # x [L, G*C, rest] -> out [G*L, C, rest]
            width = _split_evenly(x.size(1), world, "PeerMemoryExchange(split_dim=1)")
            x_view = x.view(rows, world, width, -1)  # [L, G, C, rest]
            out = x.new_empty((world * rows, width) + tuple(x.shape[2:]))
            out_view = out.view(world, rows, width, -1)  # [G, L, C, rest]

            def piece(view, g, sending=True):
                return view[:, g] if sending else view[g]

        nbytes = x.numel() * x.element_size()
        if self.buffer is None or self.buffer.numel() < nbytes:  # grown together: every rank has these sizes
            self.buffer = self.symmetric_memory.empty(nbytes, dtype=torch.uint8, device=x.device)
            self.handle = self.symmetric_memory.rendezvous(self.buffer, self.group_name)
        shared = self._shared_view(self.rank, x_view)
        for peer in range(world):  # publish what the peers will read; this rank's own piece stays in x
            if peer != self.rank:
                _copy(piece(shared, peer), piece(x_view, peer))
        self.handle.barrier(channel=0)  # every rank's buffer is written
        for peer in range(world):
            source = x_view if peer == self.rank else self._shared_view(peer, x_view)
            _copy(piece(out_view, peer, sending=False), piece(source, self.rank))
        self.handle.barrier(channel=0)  # every rank has read its pieces: buffers may be reused
        return out

    def all_to_all(self, x: torch.Tensor, split_dim: int, concat_dim: int) -> torch.Tensor:
        """Differentiable: the backward is the reverse exchange (concat and split dims swapped)."""
        return _PeerAllToAll.apply(x, self, split_dim, concat_dim)


class _PeerAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, exchange, split_dim, concat_dim):
        ctx.exchange, ctx.dims = exchange, (split_dim, concat_dim)
        return exchange.exchange(x, split_dim, concat_dim)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        split_dim, concat_dim = ctx.dims
        return ctx.exchange.exchange(grad, concat_dim, split_dim), None, None, None


# --------------------------------------------------------------------------- gather / scatter


def _all_gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = get_world_size(group)
    dim %= x.dim()
    # Gloo wants the ranks' tensors stacked along dim 0, not on a new leading dim.
    out = x.new_empty((world * x.size(0),) + tuple(x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=group)
    return out.unflatten(0, (world, x.size(0))).movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = get_world_size(group)
    dim %= x.dim()
    piece = _split_evenly(x.size(dim), world, f"reduce_scatter(dim={dim})")
    send = x.unflatten(dim, (world, piece)).movedim(dim, 0).contiguous()
    out = x.new_empty(send.shape[1:])
    _reduce_scatter_single(out, send.flatten(0, 1), group=group)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatter.apply(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _AllGather.apply(grad, ctx.dim, ctx.group), None, None


def all_gather(x: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """Concatenate every rank's x (equal shapes) along dim, in rank order."""
    return _AllGather.apply(x, dim, group)


def reduce_scatter(x: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """Sum x over ranks and keep this rank's piece: piece i of W equal pieces along dim."""
    return _ReduceScatter.apply(x, dim, group)


def _padded_flat(x: torch.Tensor, world: int) -> torch.Tensor:
    flat = x.reshape(-1)
    pad = -flat.numel() % world
    return torch.nn.functional.pad(flat, (0, pad)) if pad else flat


class _ZeroGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, numel, group):
        ctx.group, ctx.padded = group, shard.numel() * get_world_size(group)
        return _all_gather_dim(shard.reshape(-1), 0, group)[:numel]

    @staticmethod
    def backward(ctx, grad):
        padded = torch.nn.functional.pad(grad, (0, ctx.padded - grad.numel()))
        return _reduce_scatter_dim(padded, 0, ctx.group), None, None


class _ZeroScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        world = get_world_size(group)
        ctx.group, ctx.shape = group, x.shape
        flat = _padded_flat(x, world)
        piece = flat.numel() // world
        rank = get_rank(group)
        return flat[rank * piece:(rank + 1) * piece].clone()

    @staticmethod
    def backward(ctx, grad):
        numel = ctx.shape.numel()
        return _all_gather_dim(grad.contiguous(), 0, ctx.group)[:numel].view(ctx.shape), None


def zero_gather(shard: torch.Tensor, numel: int, group=None) -> torch.Tensor:
    """Rebuild a flat tensor of `numel` elements from every rank's equal-size shard."""
    if shard.numel() * get_world_size(group) < numel:
        raise ValueError(f"zero_gather: {get_world_size(group)} shards of {shard.numel()} cannot hold numel={numel}")
    return _ZeroGather.apply(shard, numel, group)


def zero_scatter(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's shard of x flattened and zero-padded to a multiple of the group size."""
    return _ZeroScatter.apply(x, group)


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllReduceSum.apply(grad, ctx.group), None


def simple_all_reduce(x: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """All-reduce into a new tensor. op: "sum" (differentiable), "max" or "min" (not differentiable)."""
    if op not in _REDUCE_OPS:
        raise ValueError(f"simple_all_reduce: op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    if op == "sum":
        return _AllReduceSum.apply(x, group)
    out = x.detach().clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=_REDUCE_OPS[op], group=group)
    return out


# --------------------------------------------------------------------------- hierarchical all-to-all


class TwoLevelGroups:
    """The world as nodes x local ranks (rank = node * local_size + local_rank): one group per node
    (intra) and one group per local index across nodes (inter). Every rank must build it, together."""

    def __init__(self, local_size: int, group=None):
        world = get_world_size(group)
        if local_size < 1 or world % local_size:
            raise ValueError(f"local_size must divide the group size {world}, got {local_size}")
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        nodes = world // local_size
        self.local_size, self.num_nodes = local_size, nodes
        self.intra, _ = dist.new_subgroups_by_enumeration(
            [ranks[n * local_size:(n + 1) * local_size] for n in range(nodes)])
        self.inter, _ = dist.new_subgroups_by_enumeration(
            [ranks[local::local_size] for local in range(local_size)])


class _HierarchicalAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups: TwoLevelGroups):
        ctx.groups = groups
        nodes, local = groups.num_nodes, groups.local_size
        piece = _split_evenly(x.size(0), nodes * local, "hierarchical_all_to_all")
        rest = tuple(x.shape[1:])
        # Pieces by destination (node, local) -> (local, node): the intra-node step hands every
        # piece to the local rank whose index matches its destination's.
        send = x.view((nodes, local, piece) + rest).transpose(0, 1).contiguous()
        step1 = torch.empty_like(send)
        dist.all_to_all_single(step1, send, group=groups.intra)
        # step1[source local, destination node]: the inter-node step sends each node its pieces.
        send = step1.transpose(0, 1).contiguous()
        step2 = torch.empty_like(send)
        dist.all_to_all_single(step2, send, group=groups.inter)
        # step2[source node, source local] = pieces in source-rank order, as a flat all-to-all.
        return step2.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _HierarchicalAllToAll.apply(grad.contiguous(), ctx.groups), None


def hierarchical_all_to_all(x: torch.Tensor, groups: TwoLevelGroups) -> torch.Tensor:
    """all_to_all_single(x) with equal splits, done as intra-node then inter-node exchanges."""
    return _HierarchicalAllToAll.apply(x, groups)
