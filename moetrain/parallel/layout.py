"""Where one MoE layer's experts live on the ranks, and the process groups each degree needs.

Storage never changes with the adaptive degree r, so r can switch between forward calls:

  E >= W   rank i stores experts [i*E/W, (i+1)*E/W) whole (E must be divisible by W);
  E <  W   rank i stores expert i // (W/E) whole: each expert has W/E replicas on consecutive
           ranks (W must be divisible by E).

Tutel's adaptive degree r picks how the experts are *computed*:

  r = 0    data parallel: every rank all-gathers every expert and runs its own tokens locally;
  r = 1    expert parallel: tokens travel by all-to-all to one replica of their expert;
           with replicas (E < W) the W ranks form W/E expert-parallel groups, one per replica;
  r > 1    each expert's hidden dimension is split over r of its replicas (r must divide W/E):
           every token row goes to all r slices and their partial outputs are summed.

For r >= 1 the computation is expert parallelism over V = E*r "virtual experts" (expert e's
hidden slice j is virtual expert e*r + j) inside a group of W*r/replicas ranks, where member g
holds virtual experts [g*V/G, (g+1)*V/G). Rank i = e*replicas + q*r + j takes slice j of its
expert e in group q; member order inside a group is then the virtual expert order.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from moetrain.parallel.launch import check_timeout


def placement(num_experts: int, world_size: int, rank: int) -> slice:
    """The rows of the full [E, ...] expert tensors that `rank` stores (see the top of this file)."""
    if num_experts >= world_size and num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} must be divisible by the number of ranks {world_size} "
                         f"(or divide it); valid expert counts are multiples or divisors of {world_size}")
    if num_experts < world_size and world_size % num_experts:
        raise ValueError(f"num_experts={num_experts} must divide the number of ranks {world_size} when it is "
                         f"smaller (or be a multiple of it)")
    local = max(num_experts // world_size, 1)
    first = rank // max(world_size // num_experts, 1) * local
    return slice(first, first + local)


def collective_timeout(group=None) -> float:
    """Seconds a collective of `group` (the world by default) waits before it fails: the timeout the
    group was made with (moetrain's own process group: parallel.timeout_s)."""
    group = group or dist.group.WORLD
    device = torch.device("cuda" if "nccl" in dist.get_backend(group) else "cpu")
    # torch keeps it in the backend's options only (no public getter).
    return group._get_backend(device).options._timeout.total_seconds()


def group_timeout(group=None, timeout_s: float | None = None) -> timedelta:
    """The timeout for a new process group made from `group`'s ranks: timeout_s seconds, or None for
    as long as `group` waits (torch's own default for new groups, 30 minutes on Gloo and 10 on NCCL,
    would ignore the configured one)."""
    if timeout_s is None:
        return timedelta(seconds=collective_timeout(group))
    check_timeout(timeout_s)
    return timedelta(seconds=timeout_s)


class ExpertLayout:
    """Placement of num_experts experts on the ranks of `group`; build it on every rank, together
    (it creates process groups, a collective call). Their collectives wait at most timeout_s seconds
    (None: as long as `group`'s)."""

    def __init__(self, num_experts: int, group=None, timeout_s: float | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("expert parallelism needs torch.distributed initialised first "
                               "(moetrain.parallel.init_distributed or torch.distributed.init_process_group)")
        self.group = group
        self.timeout = group_timeout(group, timeout_s)
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.world_size = len(self.ranks)
        self.rank = dist.get_rank(group)
        world, experts = self.world_size, num_experts
        self.local_slice = placement(experts, world, self.rank)  # checks that the experts divide
        self.num_experts = experts
        self.local_experts = max(experts // world, 1)
        self.replicas = max(world // experts, 1)
        self.valid_r = [0] + [r for r in range(1, self.replicas + 1) if self.replicas % r == 0]

        # Ranks that hold the same expert (their gradients are summed; None: no replicas), and one
        # expert-parallel group per r.
        self.replica_group = None if self.replicas == 1 else self._my_group(
            [self.ranks[e * self.replicas:(e + 1) * self.replicas] for e in range(experts)])
        self._expert_groups = {}
        # collectives.PeerMemoryExchange per expert-parallel group, built on first use (exchange="peer_memory")
        # and shared by every layer of this layout: one shared buffer per group, not one per layer.
        self.peer_exchanges = {}
        for r in self.valid_r[1:]:
            members = [[self.ranks[i] for i in range(world) if (i % self.replicas) // r == q]
                       for q in range(self.replicas // r)]
            self._expert_groups[r] = self._my_group(members)

    def _my_group(self, members: list[list[int]]):
        if len(members) == 1 and len(members[0]) == self.world_size:
            return self.group  # the whole group: no new communicator
        mine, _ = dist.new_subgroups_by_enumeration(members, timeout=self.timeout)
        return mine

    def check_r(self, r) -> int:
        if isinstance(r, bool) or not isinstance(r, int) or r not in self.valid_r:
            raise ValueError(f"adaptive_r must be one of {self.valid_r} for {self.num_experts} experts on "
                             f"{self.world_size} ranks (r > 1 needs replicas: fewer experts than ranks), got {r!r}")
        return r

    def expert_group(self, r: int):
        """The expert-parallel group for degree r >= 1."""
        return self._expert_groups[r]

    def shard_index(self, r: int) -> int:
        """Which of the r hidden slices of its expert this rank computes under degree r >= 1."""
        return (self.rank % self.replicas) % r
