"""The asynchronous all-to-all and the chunked (overlapped) expert-parallel exchange, on 2 ranks:
Gloo on CPU, and NCCL on two GPUs where there are two (skipped otherwise).

One spawn runs every check (spawning is the slow part); each rank writes its largest differences
from a single-process reference, which the tests below read:
  - collectives.all_to_all_start / exchange_wait, three exchanges in flight, waited in reverse order,
    forward and backward, against an emulation of both ranks in one process;
  - a padded MoE layer whose ranks hold different token counts (so different capacities, agreed
    on the host) under a2a_ffn_overlap_degree 1, 2 and 4: outputs, input gradients and expert and
    router gradients against the same layer run whole in one process, and the degrees against each
    other; the number of exchanges shows the chunking really happened;
  - one expert replicated on both ranks with its hidden dim split (adaptive_r=2), chunked.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist

from moetrain import MoELayer, collectives
from moetrain.parallel import DistributedOptimizer, parallelize, spawn
from moetrain.parallel import expert as expert_parallel

WORLD = 2
TOKENS = (9, 14)  # per rank: capacities 2*ceil(9/4) = 6 and 2*ceil(14/4) = 8 with 4 experts, top-2
DEGREES = (1, 2, 4)
LIMIT = 1e-5


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _randn(*shape, generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(_device())


def _check_exchanges(results: dict, rank: int) -> None:
    gen = torch.Generator().manual_seed(5)
    inputs = [[_randn(4, 3, generator=gen) for _ in range(WORLD)] for _ in range(3)]
    upstream = [[_randn(4, 3, generator=gen) for _ in range(WORLD)] for _ in range(3)]
    leaves = [x[rank].clone().requires_grad_() for x in inputs]
    flights = [collectives.all_to_all_start(x) for x in leaves]
    outputs = [collectives.exchange_wait(flight) for flight in reversed(flights)][::-1]
    sum((y * g[rank]).sum() for y, g in zip(outputs, upstream)).backward()
    worst = 0.0
    for x_W, g_W, y, leaf in zip(inputs, upstream, outputs, leaves):
        # Rank i receives piece i of every rank; the gradient of piece j of x is piece rank of g's sender j.
        expected = torch.cat([x_W[source].chunk(WORLD)[rank] for source in range(WORLD)])
        expected_grad = torch.cat([g_W[target].chunk(WORLD)[rank] for target in range(WORLD)])
        worst = max(worst, _max_diff(y, expected), _max_diff(leaf.grad, expected_grad))
    results["async all_to_all"] = worst


def _counting_starts():
    """Patch collectives.all_to_all_start to count exchanges; returns the counter list."""
    calls = []
    start = collectives.all_to_all_start

    def counted(x, group=None):
        calls.append(x.shape)
        return start(x, group)

    collectives.all_to_all_start = counted
    return calls


def _compare_layer(results: dict, tag: str, layer: MoELayer, rank: int, calls: list, exchange: str = "all_to_all",
                   **call) -> None:
    """Run `layer` (one instance per process, seed 0) whole in this process on each rank's tokens,
    then parallelized under each degree, and record the largest differences."""
    gen = torch.Generator().manual_seed(7)
    xs = [_randn(tokens, layer.model_dim, generator=gen) for tokens in TOKENS]
    gs = [_randn(tokens, layer.model_dim, generator=gen) for tokens in TOKENS]

    reference = copy.deepcopy(layer)
    ref_out, ref_x_grad, ref_router_grad = [], [], []
    for x, g in zip(xs, gs):
        reference.zero_grad()
        leaf = x.clone().requires_grad_()
        y = reference(leaf)
        (y * g).sum().backward()
        ref_out.append(y.detach())
        ref_x_grad.append(leaf.grad)
        ref_router_grad.append(reference.gate.weight_ED.grad.clone())
    # Expert gradients: every rank's tokens reach the experts, so the sum over both runs, which
    # the strategy divides by the world size on the way (the optimizer's mean over ranks).
    ref_expert_grads = {name: torch.zeros_like(param) for name, param in reference.experts.named_parameters()}
    for x, g in zip(xs, gs):
        for name, grad in zip(ref_expert_grads, torch.autograd.grad(
                (reference(x) * g).sum(), list(reference.experts.parameters()))):
            ref_expert_grads[name] += grad

    strategy = parallelize(layer, exchange=exchange)[0]
    outputs = {}
    for degree in DEGREES:
        layer.zero_grad()
        calls.clear()
        leaf = xs[rank].clone().requires_grad_()
        y = layer(leaf, a2a_ffn_overlap_degree=degree, **call)
        (y * gs[rank]).sum().backward()
        outputs[degree] = y.detach()
        results[f"{tag} degree {degree}: exchanges"] = len(calls)
        errors = [_max_diff(y, ref_out[rank]), _max_diff(leaf.grad, ref_x_grad[rank]),
                  _max_diff(layer.gate.weight_ED.grad, ref_router_grad[rank])]
        for name, param in layer.experts.named_parameters():
            grad = param.grad
            if call.get("adaptive_r", 1) > 1:  # each replica holds its hidden slice's part: sum them
                grad = grad.clone()
                dist.all_reduce(grad)
            errors.append(_max_diff(grad, ref_expert_grads[name][strategy.layout.local_slice] / WORLD))
        results[f"{tag} degree {degree}: vs one process"] = max(errors)
        results[f"{tag} degree {degree}: vs degree 1"] = _max_diff(y, outputs[1])
    # The optimizer's reduction of the last degree's gradients: the mean of both ranks' gradients
    # (with replicas, each replica holds its slice's part until the replicas are summed).
    optimizer = DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=0.1), layer)
    optimizer.reduce_gradients()
    results[f"{tag}: reduced expert gradients"] = max(
        _max_diff(param.grad, ref_expert_grads[name][strategy.layout.local_slice] / WORLD)
        for name, param in layer.experts.named_parameters())


def worker(rank: int, world: int, out_dir: str) -> None:
    results = {}
    _check_exchanges(results, rank)
    calls = _counting_starts()
    torch.manual_seed(0)
    _compare_layer(results, "padded", MoELayer(8, 4, 12, top_k=2, capacity_factor=1.0).to(_device()), rank, calls)
    torch.manual_seed(0)
    _compare_layer(results, "hidden split", MoELayer(8, 1, 12, top_k=1, capacity_factor=1.0).to(_device()), rank,
                   calls, adaptive_r=2)
    results["agreed capacity"] = parallelize(MoELayer(8, 2, 4).to(_device()))[0]._agreed_capacity(3 + 5 * rank)
    cpu_group = expert_parallel.host_group()  # Gloo: the default group itself; NCCL: a new Gloo group
    results["host group"] = (cpu_group is None, dist.get_backend(cpu_group))
    if dist.get_backend() == "gloo":
        try:
            collectives.PeerMemoryExchange()
        except ValueError as error:
            results["peer memory on gloo"] = str(error)
    torch.save(results, os.path.join(out_dir, f"results{rank}.pt"))


def _check_peer_exchange(results: dict, rank: int) -> None:
    """PeerMemoryExchange against NCCL's all_to_all, both regroupings, forward and backward: the
    same bytes must arrive (exact), through 8-byte words and elementwise (odd trailing size)."""
    exchange = collectives.PeerMemoryExchange()
    gen = torch.Generator().manual_seed(11 + rank)
    worst = 0.0
    for dtype in (torch.bfloat16, torch.float32):
        for shape, dims in [((4, 6, 8), (0, 1)), ((2, 6, 8), (1, 0)), ((4, 5, 3), (0, 1)), ((2, 4, 3), (1, 0))]:
            x = torch.randn(shape, generator=gen).to(_device(), dtype)
            leaf, reference_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
            y = exchange.all_to_all(leaf, *dims)
            expected = collectives.all_to_all(reference_leaf, *dims)
            upstream = torch.randn(expected.shape, generator=gen).to(_device(), dtype)
            (y.float() * upstream.float()).sum().backward()
            (expected.float() * upstream.float()).sum().backward()
            worst = max(worst, _max_diff(y.float(), expected.float()), _max_diff(leaf.grad.float(), reference_leaf.grad.float()))
    results["peer exchange vs all_to_all"] = worst


def peer_worker(rank: int, world: int, out_dir: str) -> None:
    results = {}
    _check_peer_exchange(results, rank)
    calls = _counting_starts()
    torch.manual_seed(0)
    _compare_layer(results, "peer memory", MoELayer(8, 4, 12, top_k=2, capacity_factor=1.0).to(_device()), rank,
                   calls, exchange="peer_memory")
    torch.save(results, os.path.join(out_dir, f"results{rank}.pt"))


BACKENDS = [
    "gloo",
    pytest.param("nccl", marks=[pytest.mark.multigpu,
                                pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 CUDA GPUs")]),
]


@pytest.fixture(scope="module", params=BACKENDS)
def results(request, tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp(f"overlap_{request.param}"))
    spawn(worker, WORLD, args=(out_dir,), backend=request.param)
    return request.param, [torch.load(os.path.join(out_dir, f"results{rank}.pt")) for rank in range(WORLD)]


def test_async_all_to_all_matches_emulation(results):
    _, per_rank = results
    assert [rank_results["async all_to_all"] for rank_results in per_rank] == [0.0, 0.0]  # moved, not computed


@pytest.mark.parametrize("tag", ["padded", "hidden split"])
@pytest.mark.parametrize("degree", DEGREES)
def test_overlap_degrees_match_one_process(results, tag, degree):
    _, per_rank = results
    for rank_results in per_rank:
        errors = {key: value for key, value in rank_results.items() if key.startswith(f"{tag} degree {degree}: vs")}
        assert len(errors) == 2 and max(errors.values()) <= LIMIT, errors
        # One dispatch and one return exchange per chunk.
        assert rank_results[f"{tag} degree {degree}: exchanges"] == 2 * degree


@pytest.mark.parametrize("tag", ["padded", "hidden split"])
def test_optimizer_reduces_expert_gradients_to_the_mean(results, tag):
    """Expert gradients arrive divided by the world size (scaled inside the experts' backward); the
    optimizer sums replicas and must not scale them again."""
    _, per_rank = results
    for rank_results in per_rank:
        assert rank_results[f"{tag}: reduced expert gradients"] <= LIMIT


def test_peer_memory_refuses_a_gloo_group(results):
    backend, per_rank = results
    if backend != "gloo":
        pytest.skip("checks the Gloo group")
    assert all("PeerMemoryExchange needs an NCCL group" in rank_results["peer memory on gloo"]
               for rank_results in per_rank)


def test_exchange_setting_is_checked():
    with pytest.raises(ValueError, match=r"exchange must be one of \['all_to_all', 'peer_memory'\], got 'nvlink'"):
        expert_parallel._check_exchange("nvlink")


@pytest.fixture(scope="module")
def peer_results(tmp_path_factory):
    if torch.cuda.device_count() < WORLD:
        pytest.skip("needs 2 CUDA GPUs")
    out_dir = str(tmp_path_factory.mktemp("peer_memory"))
    spawn(peer_worker, WORLD, args=(out_dir,), backend="nccl")
    return [torch.load(os.path.join(out_dir, f"results{rank}.pt")) for rank in range(WORLD)]


@pytest.mark.multigpu
def test_nccl_peer_memory_exchange_moves_what_all_to_all_moves(peer_results):
    assert [rank_results["peer exchange vs all_to_all"] for rank_results in peer_results] == [0.0, 0.0]


@pytest.mark.multigpu
@pytest.mark.parametrize("degree", DEGREES)
def test_nccl_peer_memory_layer_matches_one_process(peer_results, degree):
    for rank_results in peer_results:
        errors = {key: value for key, value in rank_results.items() if key.startswith(f"peer memory degree {degree}: vs")}
        assert len(errors) == 2 and max(errors.values()) <= LIMIT, errors
        # Unchunked, the rows travel through peer memory; chunked, by the all-to-all pair per chunk.
        assert rank_results[f"peer memory degree {degree}: exchanges"] == (0 if degree == 1 else 2 * degree)
    assert max(rank_results["peer memory: reduced expert gradients"] for rank_results in peer_results) <= LIMIT


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 3, 5, 8), (2, 3, 5, 3)], ids=["8-byte rows", "odd rows"])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "one element into its storage"])
def test_block_swap_moves_the_blocks_exactly(dtype, shape, offset):
    """The regrouping copy (as 8-byte words where sizes and alignment allow, else elementwise) and
    its backward."""
    storage = torch.randn(math.prod(shape) + 1).to(dtype)
    x = storage[offset:offset + math.prod(shape)].view(shape)
    a, b = shape[0], shape[1]
    expected = x.transpose(0, 1).reshape(b, a, -1)
    assert torch.equal(expert_parallel._swap_leading(x, a, b), expected)
    leaf = x.clone().requires_grad_()
    y = expert_parallel._SwapLeading.apply(leaf, a, b)
    upstream = torch.randn_like(y)
    (y * upstream).sum().backward()
    assert torch.equal(y, expected)
    assert torch.equal(leaf.grad, upstream.view(b, a, *shape[2:]).transpose(0, 1).reshape(shape))


def test_capacity_is_agreed_on_the_host(results):
    backend, per_rank = results
    assert [rank_results["agreed capacity"] for rank_results in per_rank] == [8, 8]
    reused = backend == "gloo"  # a Gloo default group serves as the host group; an NCCL one gets a Gloo twin
    assert [rank_results["host group"] for rank_results in per_rank] == [(reused, "gloo")] * WORLD
