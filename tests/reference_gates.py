"""Gate references written from the papers, token by token, for the layer and gate tests.

Nothing here imports moetrain: the functions take the gate's parameters as plain tensors (read by
the tests from the module under test) and compute routing from the published definitions, so
that a bug in moetrain's gate arithmetic cannot cancel out against itself.

  Switch Transformer (Fedus et al. 2021, eq. 1-2) / GShard (Lepikhin et al. 2020):
      p(x) = softmax(W x); the k experts of largest p; their weights are p (Switch, GShard as
      published) or p renormalised over the k chosen (Mixtral, Qwen3: "normalize").
      Jitter (Switch, appendix): in training only, the router input is multiplied by noise drawn
      uniformly from [1 - eps, 1 + eps].
  DeepSeek-V3 (2024, section 2.1.2) and Kimi-K2: s = sigmoid(W x); a per-expert bias b is added
      to s *only to choose* the experts; the weights are the unbiased s of the chosen ones,
      renormalised to sum to one, times the routed scaling factor. Group-limited routing
      (DeepSeek-V3's node-limited routing as published in its code): experts split into G
      groups, a group scores the sum of its two largest biased affinities, only the topk_group
      best groups stay eligible.
      The balance loss sees s normalised per token (DeepSeek-V3's sequence-wise auxiliary loss).
  X-MoE (Chi et al. 2022, "On the representation collapse of sparse MoE", eq. 6): the token is
      projected to a low-dimensional space, scored by cosine similarity with one learned
      direction per expert, divided by a temperature tau; then softmax top-k as above. Here tau
      is 1 / min(exp(log_scale), 100) (the scale is learnt in log space and capped at 100).

Every reference returns (probs_TE, idx_TK, weight_TK, logits_TE) in float64, best choice first.
"""

from __future__ import annotations

import math

import torch

MAX_COSINE_SCALE = 100.0


def _softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(v - top) for v in row]
    total = sum(exps)
    return [e / total for e in exps]


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _largest(values: list[float], k: int, eligible: list[bool] | None = None) -> list[int]:
    """Indices of the k largest values (among the eligible ones), largest first."""
    candidates = [i for i in range(len(values)) if eligible is None or eligible[i]]
    return sorted(candidates, key=lambda i: -values[i])[:k]


def linear_logits(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """W x for every token, as float64 dot products (the router's logits)."""
    x, w = x_TD.double(), weight_ED.double()
    if not len(x):
        return x.new_zeros(0, len(w))
    return torch.stack([torch.stack([torch.dot(x_D, w_D) for w_D in w]) for x_D in x])


def softmax_top_k(logits_TE: torch.Tensor, top_k: int, normalize: bool):
    """Switch (k=1) / GShard (k=2) routing from the logits; normalize: Mixtral/Qwen3 renormalisation."""
    probs, idx, weight = [], [], []
    for row in logits_TE.double().tolist():
        p = _softmax(row)
        chosen = _largest(p, top_k)
        w = [p[e] for e in chosen]
        if normalize:
            w = [v / sum(w) for v in w]
        probs.append(p), idx.append(chosen), weight.append(w)
    return _pack(probs, idx, weight, logits_TE)


def switch_top_k(x_TD, weight_ED, top_k: int, normalize: bool = False):
    return softmax_top_k(linear_logits(x_TD, weight_ED), top_k, normalize)


def sigmoid_top_k(x_TD, weight_ED, expert_bias_E, top_k: int, n_group: int = 1, topk_group: int = 1,
                  routed_scaling_factor: float = 1.0, normalize: bool = True):
    """DeepSeek-V3 / Kimi-K2 routing: the bias picks, the unbiased affinities weigh."""
    logits_TE = linear_logits(x_TD, weight_ED)
    bias = expert_bias_E.double().tolist()
    num_experts = len(bias)
    per_group = num_experts // n_group
    probs, idx, weight = [], [], []
    for row in logits_TE.tolist():
        s = [_sigmoid(v) for v in row]
        choice = [s[e] + bias[e] for e in range(num_experts)]
        eligible = [True] * num_experts
        if n_group > 1:
            group_score = []
            for g in range(n_group):
                members = sorted(choice[g * per_group : (g + 1) * per_group], reverse=True)
                group_score.append(sum(members[:2]))
            kept = set(_largest(group_score, topk_group))
            eligible = [e // per_group in kept for e in range(num_experts)]
        chosen = _largest(choice, top_k, eligible)
        w = [s[e] for e in chosen]
        if normalize:
            w = [v / sum(w) for v in w]
        w = [v * routed_scaling_factor for v in w]
        probs.append([v / sum(s) for v in s]), idx.append(chosen), weight.append(w)
    return _pack(probs, idx, weight, logits_TE)


def cosine_top_k(x_TD, proj_weight_PD, proj_bias_P, expert_dirs_EP, log_scale, top_k: int, normalize: bool = False):
    """X-MoE: cos(W_p x + b_p, e_i) / tau, then softmax top-k."""
    temperature = 1.0 / min(math.exp(float(log_scale)), MAX_COSINE_SCALE)
    proj_TP = x_TD.double() @ proj_weight_PD.double().t() + proj_bias_P.double()
    dirs = expert_dirs_EP.double()
    rows = []
    for h_P in proj_TP:
        cosines = [float(torch.dot(h_P, e_P)) / (float(h_P.norm()) * float(e_P.norm())) for e_P in dirs]
        rows.append([c / temperature for c in cosines])
    return softmax_top_k(torch.tensor(rows, dtype=torch.float64).reshape(len(rows), len(dirs)), top_k, normalize)


def _pack(probs, idx, weight, logits_TE):
    num_experts = logits_TE.size(-1)
    return (
        torch.tensor(probs, dtype=torch.float64).reshape(-1, num_experts),
        torch.tensor(idx, dtype=torch.long).reshape(len(idx), -1),
        torch.tensor(weight, dtype=torch.float64).reshape(len(weight), -1),
        logits_TE.double(),
    )


def route_like(gate, x_TD: torch.Tensor, top_k: int):
    """The reference routing for one of moetrain's built-in gates, read from its parameters and
    settings only (its forward is never called). Gradients flow to the gate's parameters through
    the weights: the layer tests back-propagate through this reference."""
    kind = type(gate).__name__
    if kind == "TopKGate":
        return _differentiable(lambda: switch_top_k(x_TD, gate.weight_ED, top_k, gate.normalize),
                               x_TD, gate, top_k)
    if kind == "SigmoidGate":
        return _differentiable(
            lambda: sigmoid_top_k(x_TD, gate.weight_ED, gate.expert_bias, top_k, gate.n_group, gate.topk_group,
                                  gate.routed_scaling_factor, gate.normalize),
            x_TD, gate, top_k,
        )
    if kind == "CosineGate":
        return _differentiable(
            lambda: cosine_top_k(x_TD, gate.proj.weight, gate.proj.bias, gate.expert_dirs_EP, gate.log_scale, top_k,
                                 gate.normalize),
            x_TD, gate, top_k,
        )
    raise TypeError(f"no reference for gate {kind}")


def _differentiable(reference, x_TD, gate, top_k):
    """Run the list-based reference for the choice, then recompute the chosen weights with torch
    ops written from the same formulas so that they carry gradient (to x and the gate's weights)."""
    probs_TE, idx_TK, weight_TK, logits_TE = reference()
    kind = type(gate).__name__
    x = x_TD.to(torch.promote_types(x_TD.dtype, torch.float32))
    if kind == "CosineGate":
        h = x @ gate.proj.weight.to(x.dtype).t() + gate.proj.bias.to(x.dtype)
        dirs = gate.expert_dirs_EP.to(x.dtype)
        cos = (h @ dirs.t()) / (h.norm(dim=-1, keepdim=True) * dirs.norm(dim=-1))
        logits = cos * gate.log_scale.clamp(max=math.log(MAX_COSINE_SCALE)).exp()
    else:
        logits = x @ gate.weight_ED.to(x.dtype).t()
    if kind == "SigmoidGate":
        s = torch.sigmoid(logits).gather(1, idx_TK)
        w = s / s.sum(-1, keepdim=True) if gate.normalize else s
        w = w * gate.routed_scaling_factor
    else:
        p = torch.exp(logits - logits.logsumexp(-1, keepdim=True)).gather(1, idx_TK)
        w = p / p.sum(-1, keepdim=True) if gate.normalize else p
    # The list reference and the differentiable recomputation must agree (they share no code).
    torch.testing.assert_close(w.detach().double(), weight_TK, rtol=1e-5, atol=1e-6)
    return probs_TE, idx_TK, w, logits_TE
