"""From the gate's top-k choice to a routing plan: which buffer row each choice lands in.

Capacity follows Tutel's semantics (tutel.impls.fast_dispatch.extract_critical), with T tokens,
E experts, k choices per token:
  capacity_factor > 0   each expert takes at most k * int(cf * ceil(T / E)) rows, padded to exactly
                        that many (the layout is E blocks of `capacity` rows: batched matmul);
  capacity_factor == 0  dropless: every choice is kept, experts' rows are packed back to back;
  capacity_factor < 0   dropless but capped at k * int(|cf| * ceil(T / E)) rows per expert, packed
                        (Tutel pads to min(largest load, that cap); the same choices are kept).
The one difference: where int(|cf| * ceil(T / E)) is 0 (a small |cf| or few tokens, and T = 0),
Tutel's capacity is 0 and its dispatch fails; moetrain takes k rows per expert (one per choice
rank), so every call has a plan and an empty batch gives an empty output.
Choices over capacity are dropped: the token gets no output from that expert (its other choices
and the residual path still carry it) and the drop is counted in the layer's statistics.

Priority decides who keeps a slot when an expert overflows. By default all first choices come
before all second choices, each in token order. Batch-prioritized routing (V-MoE, Tutel's
batch_prioritized_routing) orders the tokens of each choice rank by their priority score instead,
so confident tokens keep their slots first. The score is the gate's (GateOutput.priority): Tutel's,
the token's largest router probability, which is the raw top-1 probability, before any
renormalisation of the k weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain import ops


@dataclass
class RoutingPlan:
    dest_TK: torch.Tensor  # int64 row of the expert buffer for each choice, -1 when dropped
    num_rows: int  # rows of the expert buffer (E * capacity padded; T * K packed)
    counts_E: torch.Tensor  # int64 rows in use per expert (kept choices)
    load_E: torch.Tensor  # int64 choices per expert before dropping
    capacity: int | None  # rows per expert block in the padded layout; None when packed


def capacity_limit(capacity_factor: float, tokens: int, num_experts: int, top_k: int) -> int:
    """k * int(|cf| * ceil(T / E)), Tutel's per-expert row limit for a non-zero capacity factor, or k
    where that is 0 (see the top of this file)."""
    per_choice = int(abs(capacity_factor) * ((tokens + num_experts - 1) // num_experts))
    return top_k * max(per_choice, 1)


def make_plan(topk_idx_TK: torch.Tensor, priority_T: torch.Tensor | None, num_experts: int, capacity_factor: float,
              batch_prioritized: bool = False, impl: str = "kernel") -> RoutingPlan:
    """priority_T: the scores batch-prioritized routing orders tokens by (highest first); read only
    when batch_prioritized (GateOutput.priority())."""
    tokens, top_k = topk_idx_TK.shape
    if capacity_factor > 0:
        capacity, packed = capacity_limit(capacity_factor, tokens, num_experts, top_k), False
    elif capacity_factor < 0:
        capacity, packed = capacity_limit(capacity_factor, tokens, num_experts, top_k), True
    else:
        capacity, packed = -1, True
    order_T = None
    if batch_prioritized:
        if priority_T is None or priority_T.shape != (tokens,):
            shape = None if priority_T is None else tuple(priority_T.shape)
            raise ValueError(f"batch-prioritized routing needs one priority score per token, shape ({tokens},); "
                             f"got {shape}")
        order_T = torch.argsort(priority_T, descending=True, stable=True)
        expert_idx_KT = topk_idx_TK.t()[:, order_T]
    else:
        expert_idx_KT = topk_idx_TK.t()
    dest_N, load_E, counts_E = ops.route(expert_idx_KT.reshape(-1), num_experts, capacity, packed, impl=impl)
    dest_KT = dest_N.view(top_k, tokens)
    if order_T is not None:
        dest_KT = torch.empty_like(dest_KT).index_copy_(1, order_T, dest_KT)
    return RoutingPlan(
        dest_TK=dest_KT.t().contiguous(),
        num_rows=tokens * top_k if packed else num_experts * capacity,
        counts_E=counts_E,
        load_E=load_E,
        capacity=None if packed else capacity,
    )
