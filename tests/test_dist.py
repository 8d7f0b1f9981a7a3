"""Multi-process checks on CPU with Gloo: communication primitives, every parallel strategy, the
distributed optimizer and checkpoint resharding, each against a single-process reference.

Spawning is slow on a small machine, so each world size spawns once: the workers run every check,
write their measurements to a file, and the tests below read them. References are computed in
every worker from the same seeds: the "single-process" model sees each rank's batch in turn.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moetrain import MoELayer, net
from moetrain.moe import update_router_biases
from moetrain.parallel import DistributedOptimizer, parallelize, set_adaptive_r, spawn
from moetrain.parallel import checkpoint as ckpt

STEPS = 5
TOLERANCE = dict(atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------------- primitives vs a one-process emulation


def _grads_of(emulate, inputs, upstream):
    """Reference outputs and input gradients: emulate every rank in one process."""
    leaves = [x.clone().requires_grad_() for x in inputs]
    outputs = emulate(leaves)
    sum((y * g).sum() for y, g in zip(outputs, upstream)).backward()
    return [y.detach() for y in outputs], [x.grad for x in leaves]


def _check_primitive(results, name, run, emulate, shapes, out_shapes, seed):
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(shape, generator=gen) for shape in shapes]
    upstream = [torch.randn(shape, generator=gen) for shape in out_shapes]
    ref_out, ref_grad = _grads_of(emulate, inputs, upstream)
    x = inputs[rank].clone().requires_grad_()
    y = run(x)
    (y * upstream[rank]).sum().backward()
    results[name] = max((y - ref_out[rank]).abs().max().item(), (x.grad - ref_grad[rank]).abs().max().item())
    assert world == len(shapes)


def _primitive_checks(results):
    world = dist.get_world_size()
    same = [(2 * world, 3, world * 2)] * world

    def a2a(xs, split_dim, concat_dim):
        return [torch.cat([x.chunk(world, split_dim)[i] for x in xs], concat_dim) for i in range(world)]

    for split_dim, concat_dim in ((0, 0), (0, 1), (2, 0), (1, 2)):
        shape = list(same[0])
        shape[1] = world  # dim 1 must split too
        shapes = [tuple(shape)] * world
        out_shape = list(shape)
        out_shape[split_dim] //= world
        out_shape[concat_dim] *= world
        _check_primitive(results, f"all_to_all({split_dim},{concat_dim})",
                         lambda x: net.all_to_all(x, split_dim, concat_dim),
                         lambda xs: a2a(xs, split_dim, concat_dim), shapes, [tuple(out_shape)] * world, 10 + split_dim)

    # Uneven all_to_all_single: rank j sends (i + j + 1) rows to rank i (some ranks send 0).
    splits = [[(i + j) % 3 for i in range(world)] for j in range(world)]
    rank = dist.get_rank()
    received = [[splits[j][i] for j in range(world)] for i in range(world)]
    _check_primitive(results, "all_to_all_single(uneven)",
                     lambda x: net.all_to_all_single(x, received[rank], splits[rank]),
                     lambda xs: [torch.cat([x.split(splits[j])[i] for j, x in enumerate(xs)]) for i in range(world)],
                     [(sum(s), 5) for s in splits], [(sum(r), 5) for r in received], 20)
    for dim in (0, 1):
        _check_primitive(results, f"all_gather(dim={dim})", lambda x: net.all_gather(x, dim),
                         lambda xs: [torch.cat(xs, dim)] * world, [(3, 4)] * world,
                         [(3 * world, 4) if dim == 0 else (3, 4 * world)] * world, 30 + dim)
        _check_primitive(results, f"reduce_scatter(dim={dim})", lambda x: net.reduce_scatter(x, dim),
                         lambda xs: list(sum(xs).chunk(world, dim)), [(2 * world, 3 * world)] * world,
                         [(2, 3 * world) if dim == 0 else (2 * world, 3)] * world, 40 + dim)
    _check_primitive(results, "simple_all_reduce", lambda x: net.simple_all_reduce(x),
                     lambda xs: [sum(xs)] * world, [(4, 3)] * world, [(4, 3)] * world, 50)
    numel = 4 * world - 1  # not a multiple of the world size: the last shard is padded
    piece = -(-numel // world)
    _check_primitive(results, "zero_gather", lambda x: net.zero_gather(x, numel),
                     lambda xs: [torch.cat(xs)[:numel]] * world, [(piece,)] * world, [(numel,)] * world, 60)

    # zero_scatter hands each rank a piece of one replicated tensor: all ranks hold the same x.
    gen = torch.Generator().manual_seed(70)
    x_full = torch.randn(3, numel, generator=gen)
    upstream = [torch.randn(-(-3 * numel // world), generator=gen) for _ in range(world)]
    leaf = x_full.clone().requires_grad_()
    flat = F.pad(leaf.flatten(), (0, -leaf.numel() % world))
    sum((piece_ * g).sum() for piece_, g in zip(flat.chunk(world), upstream)).backward()
    x = x_full.clone().requires_grad_()
    y = net.zero_scatter(x)
    (y * upstream[rank]).sum().backward()
    results["zero_scatter"] = max((y - flat.chunk(world)[rank]).abs().max().item(), (x.grad - leaf.grad).abs().max().item())
    roundtrip = net.zero_gather(net.zero_scatter(x_full), x_full.numel())
    results["zero_gather(zero_scatter)"] = (roundtrip - x_full.flatten()).abs().max().item()

    if world == 4:
        groups = net.TwoLevelGroups(local_size=2)
        _check_primitive(results, "hierarchical_all_to_all", lambda x: net.hierarchical_all_to_all(x, groups),
                         lambda xs: a2a(xs, 0, 0), [(world * 3, 5)] * world, [(world * 3, 5)] * world, 80)


# ---------------------------------------------------------------------- training equivalence


class TinyMoEModel(nn.Module):
    """Shared layers around two MoE layers: a softmax-gated FFN one (padded, capacity 1.0) and a
    sigmoid-gated SwiGLU one with a shared expert (dropless, aux-loss-free bias)."""

    def __init__(self, num_experts: int, dim: int = 8):
        super().__init__()
        self.embed = nn.Linear(6, dim)
        self.moe1 = MoELayer(dim, num_experts, hidden_size=12, top_k=2, capacity_factor=1.0)
        self.norm = nn.LayerNorm(dim)
        self.moe2 = MoELayer(dim, num_experts, hidden_size=8, top_k=1, gate="sigmoid", expert="swiglu",
                             capacity_factor=0.0, num_shared_experts=1,
                             gate_kwargs={"bias_update_rate": 0.05})
        self.head = nn.Linear(dim, 3)

    def forward(self, x, **kwargs):
        h = self.embed(x)
        h = h + self.moe1(h, **kwargs)
        h = h + self.moe2(self.norm(h), **kwargs)
        return self.head(h)


def _loss(model, x, target, **kwargs):
    logits = model(x, **kwargs)
    aux = model.moe1.aux_loss + model.moe2.aux_loss
    return F.cross_entropy(logits, target) + 0.01 * aux, logits.detach()


def _batches(world, step):
    """Every rank's batch of one step (ranks get different sizes: capacities differ per rank)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(9 + 2 * rank, 6, generator=gen), torch.randint(0, 3, (9 + 2 * rank,), generator=gen))
            for rank in range(world)]


def _distributed_setup(num_experts, r_schedule, zero, trainer_clips):
    torch.manual_seed(2 + dist.get_rank())  # a different init per rank: rank 0's weights must win
    model = TinyMoEModel(num_experts)
    if r_schedule is not None:
        parallelize(model, adaptive_r=r_schedule[0])
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01, eps=1e-6), model,
                                     max_grad_norm=None if trainer_clips else 0.5, zero=zero)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)
    return model, optimizer, scheduler


def _run_training(results, tag, num_experts, r_schedule, zero, checkpoint_dir, trainer_clips=False):
    """STEPS steps against the reference; after step 2 the run restarts from its state dicts.
    trainer_clips: clip through optimizer.clip_grad_norm_ (as the trainer does) instead of step()."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer, scheduler = _distributed_setup(num_experts, r_schedule, zero, trainer_clips)
    torch.manual_seed(2)
    reference = TinyMoEModel(num_experts)  # rank 0's initial weights
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, eps=1e-6)
    ref_scheduler = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda step: 0.8**step)
    output_err = norm_err = 0.0
    for step in range(STEPS):
        batches = _batches(world, step)
        ref_opt.zero_grad()
        ref_runs = [_loss(reference, x, t) for x, t in batches]  # also sums every rank's router load
        (sum(loss for loss, _ in ref_runs) / world).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_scheduler.step()
        update_router_biases(reference)

        if r_schedule is not None:
            set_adaptive_r(model, r_schedule[step])
        overlap = {"a2a_ffn_overlap_degree": 2} if r_schedule is not None and step % 2 else {}
        optimizer.zero_grad()
        loss, out = _loss(model, *batches[rank], **overlap)
        loss.backward()
        if trainer_clips:
            norm_err = max(norm_err, abs(optimizer.clip_grad_norm_(0.5).item() - ref_norm.item()))
        optimizer.step()
        scheduler.step()
        output_err = max(output_err, (out - ref_runs[rank][1]).abs().max().item())
        if step == 2:  # restart from the state dicts into fresh objects
            states = model.state_dict(), optimizer.state_dict(), scheduler.state_dict()
            model, optimizer, scheduler = _distributed_setup(num_experts, r_schedule, zero, trainer_clips)
            model.load_state_dict(states[0])
            optimizer.load_state_dict(states[1])
            scheduler.load_state_dict(states[2])
    results[f"{tag}:grad norm"] = norm_err
    results[f"{tag}:outputs"] = output_err

    # Compare the weights after STEPS steps: shared ones whole, experts by this rank's slice.
    ref_params = dict(reference.named_parameters())
    meta = ckpt.parallel_metadata(model, world, rank)
    shared_err = expert_err = 0.0
    for name, param in model.named_parameters():
        expected = ref_params[name]
        if name in meta["experts"] and meta["expert_parallel"]:
            expected = expected[ckpt.placement(meta["experts"][name], world, rank)]
            expert_err = max(expert_err, (param - expected).abs().max().item())
        else:
            shared_err = max(shared_err, (param - expected).abs().max().item())
            everyone = net.all_gather(param.detach().reshape(1, -1))
            results[f"{tag}:shared identical"] = results.get(f"{tag}:shared identical", True) and bool(
                (everyone == everyone[0]).all())
    results[f"{tag}:shared params"] = shared_err
    results[f"{tag}:expert params"] = expert_err
    results[f"{tag}:router bias"] = (model.moe2.gate.expert_bias - reference.moe2.gate.expert_bias).abs().max().item()

    shard = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "moe_parallel": meta, "step": STEPS}
    os.makedirs(checkpoint_dir, exist_ok=True)
    torch.save(shard, ckpt.shard_path(checkpoint_dir, rank, world))
    if rank == 0:
        torch.save({"model": reference.state_dict(), "optimizer": ref_opt.state_dict(),
                    "names": [name for name, _ in reference.named_parameters()]},
                   os.path.join(checkpoint_dir, "reference.pt"))


def _error_checks(results):
    """Bad setups must fail with a message naming the problem (world size 4)."""
    messages = {}
    for label, build in {
        "experts not divisible": lambda: parallelize(TinyMoEModel(3)),
        "r not valid": lambda: parallelize(TinyMoEModel(2), adaptive_r=3),
        "r without replicas": lambda: parallelize(TinyMoEModel(8), adaptive_r=2),
    }.items():
        try:
            build()
            messages[label] = None
        except ValueError as error:
            messages[label] = str(error)
    results["errors"] = messages


def _worker(rank, world, out_dir):
    results = {}
    _primitive_checks(results)
    if world == 2:
        _run_training(results, "data parallel", 4, None, True, os.path.join(out_dir, "dp"))
        # E >= W: experts sharded whole; r switches between expert parallel and data parallel.
        _run_training(results, "adaptive E=4", 4, [1, 0, 1, 0, 1], False, os.path.join(out_dir, "ep"),
                      trainer_clips=True)
    else:
        # E < W: two replicas per expert; r switches through 0, 1 and 2 (hidden dim split in two).
        _run_training(results, "adaptive E=2", 2, [2, 1, 0, 2, 1], True, os.path.join(out_dir, "ep"))
        _error_checks(results)
    torch.save(results, os.path.join(out_dir, f"results{rank}.pt"))


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def world(request, tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp(f"dist{request.param}"))
    spawn(_worker, request.param, args=(out_dir,), backend="gloo")
    results = [torch.load(os.path.join(out_dir, f"results{rank}.pt"), weights_only=False)
               for rank in range(request.param)]
    return request.param, out_dir, results


# ---------------------------------------------------------------------- the tests


def test_primitives_match_emulation(world):
    _, _, results = world
    for rank_results in results:
        errors = {name: value for name, value in rank_results.items()
                  if ":" not in name and name != "errors" and value > 1e-5}
        assert not errors, errors
    assert "zero_gather" in results[0] and "all_to_all(1,2)" in results[0]


def test_strategies_train_like_single_process(world):
    size, _, results = world
    tags = ["data parallel", "adaptive E=4"] if size == 2 else ["adaptive E=2"]
    for rank_results in results:
        for tag in tags:
            for what in ("outputs", "shared params", "expert params", "router bias", "grad norm"):
                assert rank_results[f"{tag}:{what}"] < 1e-4, (tag, what, rank_results[f"{tag}:{what}"])
            assert rank_results[f"{tag}:shared identical"], tag


def test_router_bias_moved(world):
    _, out_dir, _ = world
    reference = torch.load(os.path.join(out_dir, "ep", "reference.pt"), weights_only=False)
    assert reference["model"]["moe2.gate.expert_bias"].abs().sum() > 0  # the bias check above is not vacuous


def test_bad_setups_fail_clearly(world):
    size, _, results = world
    if size != 4:
        pytest.skip("the error cases are checked on 4 ranks")
    messages = results[0]["errors"]
    assert "num_experts=3" in messages["experts not divisible"]
    assert "adaptive_r must be one of [0, 1, 2]" in messages["r not valid"]
    assert "adaptive_r must be one of [0, 1]" in messages["r without replicas"]


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_checkpoint_conversion_round_trips_exactly(world, tmp_path):
    size, out_dir, _ = world
    source = os.path.join(out_dir, "ep")
    shards = ckpt.load_shards(source)
    other = 4 if size == 2 else 2
    ckpt.convert_checkpoint(source, str(tmp_path / "other"), other)
    ckpt.main([str(tmp_path / "other"), str(tmp_path / "back"), "--world-size", str(size)])
    back = ckpt.load_shards(str(tmp_path / "back"))
    assert [shard["moe_parallel"]["world_size"] for shard in ckpt.load_shards(str(tmp_path / "other"))] == [other] * other
    assert _equal(ckpt.consolidate(back), ckpt.consolidate(shards))
    if size == 2:  # without ZeRO the files themselves come back unchanged
        for original, converted in zip(shards, back):
            assert _equal(original, converted)


def test_consolidated_checkpoint_is_the_single_process_state(world):
    _, out_dir, _ = world
    full = ckpt.consolidate(ckpt.load_shards(os.path.join(out_dir, "ep")))
    reference = torch.load(os.path.join(out_dir, "ep", "reference.pt"), weights_only=False)
    for key, value in reference["model"].items():
        torch.testing.assert_close(full["model"][key], value, **TOLERANCE)
    # Optimizer moments of every parameter, experts gathered back to [E, ...].
    for index, name in enumerate(reference["names"]):
        for item in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(full["optimizer"]["state"][name][item],
                                       reference["optimizer"]["state"][index][item], atol=1e-5, rtol=1e-3)
    model = TinyMoEModel(full["moe_parallel"]["experts"]["moe1.experts.w1"])
    model.load_state_dict(full["model"])  # loads into a plain single-process model


def test_wrong_world_size_is_refused():
    shard = {"moe_parallel": {"world_size": 4}}
    ckpt.check_world_size(shard, 4)
    with pytest.raises(ValueError, match="written by 4 rank.*this run has 2.*--world-size 2"):
        ckpt.check_world_size(shard, 2)


def test_parallel_arguments_need_a_strategy():
    layer = MoELayer(8, 4, 16)
    with pytest.raises(ValueError, match="adaptive_r and a2a_ffn_overlap_degree need expert parallelism"):
        layer(torch.randn(5, 8), adaptive_r=1)


def test_backend_choice_is_checked():
    with pytest.raises(ValueError, match="backend must be one of"):
        spawn(_worker, 2, backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="'nccl' is not available"):
            spawn(_worker, 2, backend="nccl")
