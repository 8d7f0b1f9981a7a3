"""A language model's head and its cross-entropy in one pass over chunks of tokens: the [N, V]
logits never exist at once.

    linear_cross_entropy(hidden_ND, weight_VD, targets_N, ignore_index=-100)

is the mean over the positions whose target is not ignore_index of

    F.cross_entropy((hidden_ND @ weight_VD.T).float(), targets_N, ignore_index=ignore_index)

with the same gradients for hidden_ND and weight_VD. The forward takes `chunk_tokens` rows at a time:
their logits (one GEMM in the operands' dtype, fp32 accumulation), the log-sum-exp and the loss in
fp32, and at once the gradient of the mean loss with respect to those logits, (softmax - onehot) / n,
rounded to the operands' dtype as autograd rounds it, which two more GEMMs turn into the chunk's rows
of the hidden states' gradient and a term of the weight's (summed in fp32). The backward only scales
the two gradients by the one that arrives. The GEMMs are the unfused head's three; what goes is the
logits' memory: on a 32k vocabulary and 32k tokens, 2 GiB of 16-bit logits, their gradient of the
same size, and the fp32 softmax the loss's backward would otherwise re-read. What is kept instead:
one chunk's logits and gradient, the hidden states' gradient ([N, D]) and an fp32 [V, D] sum.

Under autocast the operands are cast to its dtype first, as nn.Linear would be; the weight's
gradient arrives in the weight's own dtype. On CUDA the chunk's softmax and gradient are one
compiled kernel (torch.compile, on first use); elsewhere the same ops run eagerly.
"""

from __future__ import annotations

import torch

from moetrain.timing import LM_HEAD_SCOPE

IGNORE_INDEX = -100
_CHUNK_ELEMENTS = 1 << 27  # logits per chunk: 128 Mi (256 MiB in bf16); larger chunks in docs/performance.md


def _loss_and_logit_grad(logits_CV: torch.Tensor, targets_C: torch.Tensor, scale: torch.Tensor,
                         ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the chunk's losses, d mean loss / d logits in the logits' dtype); scale = 1 / n."""
    logits = logits_CV.float()
    valid_C = targets_C != ignore_index
    safe_C = torch.where(valid_C, targets_C, 0)
    lse_C = torch.logsumexp(logits, dim=-1)
    picked_C = logits.gather(-1, safe_C[:, None]).squeeze(-1)
    loss_sum = torch.where(valid_C, lse_C - picked_C, 0.0).sum()
    grad = torch.exp(logits - lse_C[:, None])
    onehot = torch.arange(logits.shape[-1], device=logits.device)[None, :] == safe_C[:, None]
    grad = (grad - onehot.to(grad.dtype)) * torch.where(valid_C, scale, 0.0)[:, None]
    return loss_sum, grad.to(logits_CV.dtype)


_compiled_core = None


def _core(device: torch.device):
    global _compiled_core
    if device.type != "cuda":
        return _loss_and_logit_grad
    if _compiled_core is None:
        _compiled_core = torch.compile(_loss_and_logit_grad, dynamic=False)
    return _compiled_core


def _accumulate_weight_grad(sum_VD: torch.Tensor, grad_CV: torch.Tensor, hidden_CD: torch.Tensor) -> torch.Tensor:
    if grad_CV.dtype == torch.float32:
        return sum_VD.addmm_(grad_CV.t(), hidden_CD)
    if grad_CV.is_cuda:  # 16-bit operands, the product added in fp32 by the GEMM itself, in place: an
        # out-of-place addmm would first copy the fp32 [V, D] sum (262 MB on a 32k x 2048 head) every chunk
        return torch.addmm(sum_VD, grad_CV.t(), hidden_CD, out_dtype=torch.float32, out=sum_VD)
    return sum_VD.add_(torch.mm(grad_CV.t(), hidden_CD).float())


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, ignore_index, chunk_tokens):
        N = hidden_ND.shape[0]
        core = _core(hidden_ND.device)
        scale = 1.0 / (targets_N != ignore_index).sum().to(torch.float32)  # inf when none counts: loss nan
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden_ND) if need_hidden else None
        grad_weight = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device) if need_weight else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
        for start in range(0, N, chunk_tokens):
            hidden_CD = hidden_ND[start:start + chunk_tokens]
            part, grad_CV = core(torch.mm(hidden_CD, weight_VD.t()), targets_N[start:start + chunk_tokens], scale,
                                 ignore_index)
            loss += part
            if need_hidden:
                torch.mm(grad_CV, weight_VD, out=grad_hidden[start:start + chunk_tokens])
            if need_weight:
                grad_weight = _accumulate_weight_grad(grad_weight, grad_CV, hidden_CD)
        ctx.weight_dtype = weight_VD.dtype
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss * scale

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight_VD: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX, chunk_tokens: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of the logits hidden @ weight_VD.T against targets (module doc), without
    the logits: hidden [..., D], targets [...] (positions equal to ignore_index do not count),
    weight_VD [V, D]. chunk_tokens: rows per chunk (default: 128 Mi logits a chunk)."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)}: targets must have "
                         "hidden's shape without its last dimension")
    if hidden.shape[-1] != weight_VD.shape[1]:
        raise ValueError(f"hidden's last dimension {hidden.shape[-1]} is not the weight's {weight_VD.shape[1]}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight_VD = hidden.to(dtype), weight_VD.to(dtype)
    elif weight_VD.dtype != hidden.dtype:
        raise ValueError(f"hidden is {hidden.dtype} and the weight {weight_VD.dtype}: give both one dtype, or "
                         "run under autocast")
    hidden_ND = hidden.reshape(-1, hidden.shape[-1])
    if chunk_tokens is None:
        chunk_tokens = max(1, _CHUNK_ELEMENTS // weight_VD.shape[0])
    # the profiler region tells the step's anatomy (moetrain.timing) these kernels are the head's
    with torch.autocast(device_type, enabled=False), torch.autograd.profiler.record_function(LM_HEAD_SCOPE):
        return _LinearCrossEntropy.apply(hidden_ND, weight_VD, targets.reshape(-1), ignore_index, chunk_tokens)
