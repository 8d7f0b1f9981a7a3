"""Does this distributed setup compute what one process computes? A self-check for a machine or cluster.

    python benchmarks/parallel_check.py --nproc 2               # Gloo on CPU, or NCCL when GPUs are visible
    python benchmarks/parallel_check.py --nproc 4 --backend gloo

Each rank runs, against a single-process reference computed from the same seeds:
  - every communication primitive of moetrain.collectives, forward and backward, against a one-process
    emulation of all ranks;
  - five training steps of a small model with two MoE layers (padded and dropless, softmax and
    sigmoid gates, FFN and SwiGLU experts, a shared expert) under data parallelism and under
    expert parallelism with the adaptive degree r switched between steps, the chunked all-to-all
    overlap on every other step, ZeRO-1, global-norm clipping, an LR schedule and a restart from
    state dicts in the middle; outputs, weights, router biases and the gradient norm are compared;
  - the same steps with FSDP2 (moetrain.parallel.fsdp.shard_model): every parameter sharded
    ("fsdp"), and experts placed by expert parallelism then sharded over their replicas with
    selective activation checkpointing ("fsdp_ep"); outputs, weights (gathered), the global
    gradient norm and the router bias against the same reference;
  - a per-rank checkpoint is written for the conversion checks (tests/parallel/test_dist.py).
The reference model sees each rank's batch in turn (capacities are per rank, as in the real run).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain import MoELayer, collectives
from moetrain.moe import set_activation_checkpointing, update_router_biases
from moetrain.parallel import checkpoint as ckpt
from moetrain.parallel.expert import parallelize, set_adaptive_r
from moetrain.parallel.fsdp import global_grad_norm, shard_model, sync_router_biases_after_step
from moetrain.parallel.launch import choose_backend, spawn
from moetrain.parallel.optimizer import DistributedOptimizer

STEPS = 5
DEVICE = torch.device("cpu")  # this worker's device and the MoE layers' dispatch impl, set in worker()
IMPL = "kernel"
# fp32 on every device; matmuls on GPUs run in full fp32 (torch's default, no TF32).
LIMITS = {"primitive": 1e-5, "training": 1e-4}


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
    inputs = [torch.randn(shape, generator=gen).to(DEVICE) for shape in shapes]
    upstream = [torch.randn(shape, generator=gen).to(DEVICE) for shape in out_shapes]
    ref_out, ref_grad = _grads_of(emulate, inputs, upstream)
    x = inputs[rank].clone().requires_grad_()
    y = run(x)
    (y * upstream[rank]).sum().backward()
    results[f"primitive:{name}"] = max((y - ref_out[rank]).abs().max().item(), (x.grad - ref_grad[rank]).abs().max().item())
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
                         lambda x: collectives.all_to_all(x, split_dim, concat_dim),
                         lambda xs: a2a(xs, split_dim, concat_dim), shapes, [tuple(out_shape)] * world, 10 + split_dim)

    # Uneven all_to_all_single: rank j sends (i + j + 1) rows to rank i (some ranks send 0).
    splits = [[(i + j) % 3 for i in range(world)] for j in range(world)]
    rank = dist.get_rank()
    received = [[splits[j][i] for j in range(world)] for i in range(world)]
    _check_primitive(results, "all_to_all_single(uneven)",
                     lambda x: collectives.all_to_all_single(x, received[rank], splits[rank]),
                     lambda xs: [torch.cat([x.split(splits[j])[i] for j, x in enumerate(xs)]) for i in range(world)],
                     [(sum(s), 5) for s in splits], [(sum(r), 5) for r in received], 20)
    for dim in (0, 1):
        _check_primitive(results, f"all_gather(dim={dim})", lambda x: collectives.all_gather(x, dim),
                         lambda xs: [torch.cat(xs, dim)] * world, [(3, 4)] * world,
                         [(3 * world, 4) if dim == 0 else (3, 4 * world)] * world, 30 + dim)
        _check_primitive(results, f"reduce_scatter(dim={dim})", lambda x: collectives.reduce_scatter(x, dim),
                         lambda xs: list(sum(xs).chunk(world, dim)), [(2 * world, 3 * world)] * world,
                         [(2, 3 * world) if dim == 0 else (2 * world, 3)] * world, 40 + dim)
    _check_primitive(results, "simple_all_reduce", lambda x: collectives.simple_all_reduce(x),
                     lambda xs: [sum(xs)] * world, [(4, 3)] * world, [(4, 3)] * world, 50)
    numel = 4 * world - 1  # not a multiple of the world size: the last shard is padded
    piece = -(-numel // world)
    _check_primitive(results, "zero_gather", lambda x: collectives.zero_gather(x, numel),
                     lambda xs: [torch.cat(xs)[:numel]] * world, [(piece,)] * world, [(numel,)] * world, 60)

    # zero_scatter hands each rank a piece of one replicated tensor: all ranks hold the same x.
    gen = torch.Generator().manual_seed(70)
    x_full = torch.randn(3, numel, generator=gen).to(DEVICE)
    upstream = [torch.randn(-(-3 * numel // world), generator=gen).to(DEVICE) for _ in range(world)]
    leaf = x_full.clone().requires_grad_()
    flat = F.pad(leaf.flatten(), (0, -leaf.numel() % world))
    sum((piece_ * g).sum() for piece_, g in zip(flat.chunk(world), upstream)).backward()
    x = x_full.clone().requires_grad_()
    y = collectives.zero_scatter(x)
    (y * upstream[rank]).sum().backward()
    results["primitive:zero_scatter"] = max((y - flat.chunk(world)[rank]).abs().max().item(), (x.grad - leaf.grad).abs().max().item())
    roundtrip = collectives.zero_gather(collectives.zero_scatter(x_full), x_full.numel())
    results["primitive:zero_gather(zero_scatter)"] = (roundtrip - x_full.flatten()).abs().max().item()

    if world == 4:
        groups = collectives.TwoLevelGroups(local_size=2)
        _check_primitive(results, "hierarchical_all_to_all", lambda x: collectives.hierarchical_all_to_all(x, groups),
                         lambda xs: a2a(xs, 0, 0), [(world * 3, 5)] * world, [(world * 3, 5)] * world, 80)


# ---------------------------------------------------------------------- training equivalence


class TinyMoEModel(nn.Module):
    """Shared layers around two MoE layers: a softmax-gated FFN one (padded, capacity 1.0) and a
    sigmoid-gated SwiGLU one with a shared expert (dropless, aux-loss-free bias)."""

    def __init__(self, num_experts: int, dim: int = 8):
        super().__init__()
        self.embed = nn.Linear(6, dim)
        self.moe1 = MoELayer(dim, num_experts, hidden_size=12, top_k=min(2, num_experts), capacity_factor=1.0,
                             impl=IMPL)
        self.norm = nn.LayerNorm(dim)
        self.moe2 = MoELayer(dim, num_experts, hidden_size=8, top_k=1, gate="sigmoid", expert="swiglu",
                             capacity_factor=0.0, num_shared_experts=1,
                             gate_kwargs={"bias_update_rate": 0.05}, impl=IMPL)
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
    return [(torch.randn(9 + 2 * rank, 6, generator=gen).to(DEVICE),
             torch.randint(0, 3, (9 + 2 * rank,), generator=gen).to(DEVICE))
            for rank in range(world)]


def _distributed_setup(num_experts, r_schedule, zero, trainer_clips):
    torch.manual_seed(2 + dist.get_rank())  # a different init per rank: rank 0's weights must win
    model = TinyMoEModel(num_experts).to(DEVICE)
    if r_schedule is not None:
        parallelize(model, adaptive_r=r_schedule[0])
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01, eps=1e-6), model,
                                     max_grad_norm=None if trainer_clips else 0.5, zero=zero)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)
    return model, optimizer, scheduler


def _reference(num_experts):
    """The one-process model every run is checked against (rank 0's initial weights), its optimizer
    and schedule, as the distributed runs set theirs up."""
    torch.manual_seed(2)
    reference = TinyMoEModel(num_experts).to(DEVICE)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, eps=1e-6)
    return reference, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)


def _run_training(results, tag, num_experts, r_schedule, zero, checkpoint_dir, trainer_clips=False):
    """STEPS steps against the reference; after step 2 the run restarts from its state dicts.
    trainer_clips: clip through optimizer.clip_grad_norm_ (as the trainer does) instead of step()."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer, scheduler = _distributed_setup(num_experts, r_schedule, zero, trainer_clips)
    reference, ref_opt, ref_scheduler = _reference(num_experts)
    output_err = norm_err = 0.0
    for step in range(STEPS):
        batches = _batches(world, step)
        ref_runs, ref_norm = _reference_step(reference, ref_opt, ref_scheduler, batches, world)

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
    shared_err = expert_err = spread = 0.0
    for name, param in model.named_parameters():
        expected = ref_params[name]
        if name in meta["experts"] and meta["expert_parallel"]:
            expected = expected[ckpt.placement(meta["experts"][name], world, rank)]
            expert_err = max(expert_err, (param - expected).abs().max().item())
        else:
            shared_err = max(shared_err, (param - expected).abs().max().item())
            everyone = collectives.all_gather(param.detach().reshape(1, -1))
            spread = max(spread, (everyone - everyone[0]).abs().max().item())
    results[f"{tag}:shared spread"] = spread  # shared weights must be bit-identical on all ranks
    results[f"{tag}:shared params"] = shared_err
    results[f"{tag}:expert params"] = expert_err
    results[f"{tag}:router bias"] = (model.moe2.gate.expert_bias - reference.moe2.gate.expert_bias).abs().max().item()

    shard = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "moe_parallel": meta, "step": STEPS}
    ckpt.save_shard(shard, checkpoint_dir)  # every rank's file, then the SHA256SUMS that marks it complete
    if rank == 0:
        torch.save({"model": reference.state_dict(), "optimizer": ref_opt.state_dict(),
                    "names": [name for name, _ in reference.named_parameters()]},
                   os.path.join(checkpoint_dir, "reference.pt"))


def _reference_step(reference, ref_opt, ref_scheduler, batches, world):
    ref_opt.zero_grad()
    ref_runs = [_loss(reference, x, t) for x, t in batches]  # also sums every rank's router load
    (sum(loss for loss, _ in ref_runs) / world).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    ref_opt.step()
    ref_scheduler.step()
    update_router_biases(reference)
    return ref_runs, ref_norm


def _run_fsdp_training(results, tag, num_experts, expert_parallel):
    """STEPS steps of the model sharded by FSDP2 against the one-process reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(2 + rank)  # a different init per rank: shard_model must start from rank 0's
    model = TinyMoEModel(num_experts).to(DEVICE)
    if expert_parallel:
        set_activation_checkpointing(model, "selective")
    shard_model(model, expert_parallel=expert_parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, eps=1e-6)
    sync_router_biases_after_step(optimizer, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)
    reference, ref_opt, ref_scheduler = _reference(num_experts)
    output_err = norm_err = 0.0
    for step in range(STEPS):
        batches = _batches(world, step)
        ref_runs, ref_norm = _reference_step(reference, ref_opt, ref_scheduler, batches, world)
        optimizer.zero_grad()
        loss, out = _loss(model, *batches[rank])
        loss.backward()
        norm_err = max(norm_err, abs(global_grad_norm(list(model.parameters()), 0.5).item() - ref_norm.item()))
        optimizer.step()
        scheduler.step()
        output_err = max(output_err, (out - ref_runs[rank][1]).abs().max().item())
    results[f"{tag}:outputs"] = output_err
    results[f"{tag}:grad norm"] = norm_err
    ref_params = dict(reference.named_parameters())
    meta = ckpt.parallel_metadata(model, world, rank)
    shared_err = expert_err = 0.0
    for name, param in model.named_parameters():
        gathered = param.full_tensor() if isinstance(param, DTensor) else param
        expected = ref_params[name]
        if name in meta["experts"] and expert_parallel:
            expert_err = max(expert_err, (gathered - expected[ckpt.placement(meta["experts"][name], world, rank)])
                             .abs().max().item())
        else:
            shared_err = max(shared_err, (gathered - expected).abs().max().item())
    results[f"{tag}:shared params"] = shared_err
    results[f"{tag}:expert params"] = expert_err
    results[f"{tag}:router bias"] = (model.moe2.gate.expert_bias - reference.moe2.gate.expert_bias).abs().max().item()


def _error_checks(results):
    """Bad setups must fail with a message naming the problem."""
    world = dist.get_world_size()
    messages = {}
    for label, build in {
        "experts not divisible": lambda: parallelize(TinyMoEModel(world + 1).to(DEVICE)),
        "r not valid": lambda: parallelize(TinyMoEModel(world // 2).to(DEVICE), adaptive_r=3),
        "r without replicas": lambda: parallelize(TinyMoEModel(2 * world).to(DEVICE), adaptive_r=2),
    }.items():
        try:
            build()
            messages[label] = None
        except ValueError as error:
            messages[label] = str(error)
    results["errors"] = messages


# What each run checks, by name: (experts, r per step or None for data parallel, ZeRO-1, trainer clips).
RUNS = {
    "dp": lambda world: (4, None, True, True),
    # E >= W: experts sharded whole; r switches between expert parallel and data parallel.
    "ep": lambda world: (2 * world, [1, 0, 1, 0, 1], False, True),
    # E < W: two replicas per expert; r switches through 0, 1 and 2 (hidden dim split in two).
    "replicas": lambda world: (world // 2, [2, 1, 0, 2, 1], True, False),
}
# FSDP2 runs: (experts, expert parallelism). With expert parallelism each expert has two replicas,
# over which FSDP shards it.
FSDP_RUNS = {
    "fsdp": lambda world: (4, False),
    "fsdp_ep": lambda world: (world // 2, True),
}


def worker(rank: int, world: int, out_dir: str, runs: tuple = tuple(RUNS), impl: str = "kernel") -> None:
    """Run the checks on this rank; write results{rank}.pt and one checkpoint directory per run."""
    global DEVICE, IMPL
    IMPL = impl
    DEVICE = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    results = {}
    _primitive_checks(results)
    for run in runs:
        if run in FSDP_RUNS:
            _run_fsdp_training(results, run, *FSDP_RUNS[run](world))
            continue
        num_experts, r_schedule, zero, trainer_clips = RUNS[run](world)
        _run_training(results, run, num_experts, r_schedule, zero, os.path.join(out_dir, run), trainer_clips)
    if world >= 2:
        _error_checks(results)
    torch.save(results, os.path.join(out_dir, f"results{rank}.pt"))


def failures(results: dict) -> dict:
    """The measurements over their limit: primitives 1e-5, training 1e-4, shared spread exactly 0."""
    bad = {}
    for name, value in results.items():
        if name == "errors":
            continue
        limit = LIMITS["primitive"] if name.startswith("primitive:") else 0.0 if name.endswith("shared spread") \
            else LIMITS["training"]
        if not value <= limit:
            bad[name] = value
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/parallel_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes to start (one per GPU with NCCL)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: NCCL with GPUs, else Gloo")
    parser.add_argument("--impl", choices=("kernel", "torch"), default="kernel", help="the MoE layers' dispatch/combine")
    args = parser.parse_args(argv)
    if args.nproc < 2 or args.nproc % 2:
        parser.error(f"--nproc must be an even number >= 2, got {args.nproc}")
    backend = choose_backend(args.backend)
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(worker, args.nproc, args=(out_dir, tuple(RUNS) + tuple(FSDP_RUNS), args.impl), backend=backend)
        per_rank = [torch.load(os.path.join(out_dir, f"results{rank}.pt"), weights_only=False)
                    for rank in range(args.nproc)]
    worst = {name: max(results[name] for results in per_rank) for name in per_rank[0] if name != "errors"}
    bad = failures(worst)
    print(f"{'check':48s} {'max error (all ranks)':>22s}")
    for name, value in worst.items():
        print(f"{name:48s} {value:22.3e}{'  FAIL' if name in bad else ''}")
    print(f"{args.nproc} ranks, backend {backend}: " + ("all checks passed" if not bad else f"{len(bad)} FAILED"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
