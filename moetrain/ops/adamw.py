"""One AdamW update of a 16-bit parameter from its fp32 master weight, in one pass.

Mixed-precision training as Megatron arranges it: the model holds bf16 parameters (so the forward
casts nothing and the backward writes bf16 gradients), the optimizer holds an fp32 master copy of
each and the fp32 moments. The update reads the bf16 gradient, the master and both moments once,
and writes the master, the moments and the master rounded to bf16 into the parameter: 28 bytes per
element, what torch's fused AdamW moves over fp32 parameters alone, with no fp32 gradient and no
separate cast kernels.

On CUDA that is a Triton kernel (fp32 registers); elsewhere, and without Triton, `reference` does
the same arithmetic with torch's ops. Both follow torch.optim.AdamW's formula:

    master *= 1 - lr * weight_decay
    m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
    master -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)
    param = master rounded to param's dtype

A parameter that is fp32 itself (the routers) is its own master: `master` is the parameter.

The moments may be stored in bf16 instead (MasterWeightAdamW(moment_dtype=torch.bfloat16),
optim.moment_dtype=bfloat16): read into fp32, updated and used in fp32, stored rounded to nearest.
That moves 20 bytes an element instead of 28.

Without master weights (MasterWeightAdamW(master_weights=False), optim.master_weights=false) a bf16
parameter is its own master: the update is computed in fp32 from the bf16 value and stored with
stochastic rounding, up to the next bf16 value with probability equal to the fraction of the gap
that the fp32 result covers, so that updates far smaller than a bf16 step still move the weight in
expectation. It moves 14 bytes an element (bf16 moments) instead of 20. The random bits are a pure
function of a seed and the element's index (`rounding_noise`: an integer hash, the same bits in the
kernel and in torch), so a replica that takes the same step with the same seed writes the same bits.

Two optional device scalars let the caller decide on the GPU, with no host sync, what torch's fused
optimizers decide from the same two tensors (their `grad_scale` and `found_inf`): the gradient is
divided by `grad_scale` before use (clipping: the norm over the limit), and where `found_inf` is
non-zero nothing is written (a step skipped for a non-finite loss or gradient).
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # without Triton, CUDA tensors take the reference path
    triton = None

_ELEMENTS_PER_PROGRAM = 2048


def reference(param: torch.Tensor, grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, step: int, lr: float, beta1: float, beta2: float, eps: float,
              weight_decay: float, grad_scale: torch.Tensor | None = None,
              found_inf: torch.Tensor | None = None) -> None:
    """The update with torch's ops, in fp32, in place (step counts from 1). Reads found_inf on the
    host (a sync on a GPU: this path runs there only without Triton or on strided tensors)."""
    if found_inf is not None and bool(found_inf):
        return
    g = grad.float() if grad_scale is None else grad.float() / grad_scale.float()
    master.mul_(1 - lr * weight_decay)
    # fp32 moments are updated in place; 16-bit ones in fp32 copies, stored rounded at the end
    m = exp_avg if exp_avg.dtype == torch.float32 else exp_avg.float()
    v = exp_avg_sq if exp_avg_sq.dtype == torch.float32 else exp_avg_sq.float()
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    master.addcdiv_(m, denom, value=-lr / (1 - beta1**step))
    if m is not exp_avg:
        exp_avg.copy_(m)
    if v is not exp_avg_sq:
        exp_avg_sq.copy_(v)
    if param is not master:
        param.copy_(master)


# rounding_noise's hash: an index times 2**32 over the golden ratio, plus the seed, then MurmurHash3's
# 32-bit finalizer (multiply-xorshift rounds; every input bit reaches every output bit)
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35
_LOW32 = 0xFFFFFFFF


def rounding_noise(seed: int, elements: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 random bits (0 .. 65535, int64) that stochastic rounding adds below each of `elements`
    fp32 values: the top half of a 32-bit hash of the element's index and `seed`. The kernel computes
    the same hash in uint32 arithmetic; here int64 products wrap and are masked to their low 32 bits."""
    h = (torch.arange(elements, dtype=torch.int64, device=device) * _GOLDEN + seed) & _LOW32
    h ^= h >> 16
    h = (h * _MIX1) & _LOW32
    h ^= h >> 13
    h = (h * _MIX2) & _LOW32
    h ^= h >> 16
    return h >> 16


def stochastic_round(value: torch.Tensor, seed: int) -> torch.Tensor:
    """fp32 `value` rounded to bf16 stochastically: to the bf16 neighbour above in magnitude with
    probability (|value| - |lower|) / (|upper| - |lower|), else to the one below (in expectation,
    `value`); non-finite values as they are. The random bits: rounding_noise(seed), by flat index."""
    noise = rounding_noise(seed, value.numel(), value.device).view(value.shape).to(torch.int32)
    # an fp32's top 16 bits are its bf16 truncation; adding noise below them carries into them with
    # the probability that the dropped bits make of 2**16 (the sign is separate: magnitudes round)
    rounded = ((value.contiguous().view(torch.int32) + noise) & ~0xFFFF).view(torch.float32)
    return torch.where(value.isfinite(), rounded, value).to(torch.bfloat16)


def reference_stochastic(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                         seed: int, grad_scale: torch.Tensor | None = None,
                         found_inf: torch.Tensor | None = None) -> None:
    """The update of a bf16 parameter that is its own master, with torch's ops, in place: `reference`
    on an fp32 copy of it, stored back with stochastic_round(seed)."""
    if found_inf is not None and bool(found_inf):
        return
    master = param.float()
    reference(master, grad, master, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    param.copy_(stochastic_round(master, seed))


if triton is not None:
    _GOLDEN_C, _MIX1_C, _MIX2_C = tl.constexpr(_GOLDEN), tl.constexpr(_MIX1), tl.constexpr(_MIX2)  # jit-readable

    @triton.jit
    def _adamw_master_kernel(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, elements,
                             decay, beta1, beta2, eps, step_size, bias_correction2_sqrt, grad_scale_ptr, found_inf_ptr,
                             seed, WRITE_PARAM: tl.constexpr, SCALED: tl.constexpr, SKIPPABLE: tl.constexpr,
                             STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
        index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if SKIPPABLE:  # a skipped step: no element is live, every load and store is masked off
            elements = tl.where(tl.load(found_inf_ptr) != 0, 0, elements)
        mask = index < elements
        g = tl.load(grad_ptr + index, mask=mask).to(tl.float32)
        if SCALED:  # divided exactly (IEEE), as torch's fused optimizers divide
            g = tl.math.div_rn(g, tl.full(g.shape, tl.load(grad_scale_ptr).to(tl.float32), tl.float32))
        master = tl.load(master_ptr + index, mask=mask).to(tl.float32)
        m = tl.load(exp_avg_ptr + index, mask=mask).to(tl.float32)
        v = tl.load(exp_avg_sq_ptr + index, mask=mask).to(tl.float32)
        master = master * decay
        m = m + (1.0 - beta1) * (g - m)
        v = beta2 * v + (1.0 - beta2) * g * g
        master = master - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
        if STOCHASTIC:  # a bf16 parameter that is its own master: stored stochastically rounded
            h = index.to(tl.uint32) * _GOLDEN_C + seed.to(tl.uint32)  # rounding_noise, in uint32
            h ^= h >> 16
            h *= _MIX1_C
            h ^= h >> 13
            h *= _MIX2_C
            h ^= h >> 16
            noise = h >> 16
            bits = master.to(tl.uint32, bitcast=True)
            rounded = (((bits + noise) >> 16) << 16).to(tl.float32, bitcast=True)
            finite = (bits & 0x7F800000) != 0x7F800000
            master = tl.where(finite, rounded, master)  # NaN and inf as they are
        tl.store(master_ptr + index, master.to(master_ptr.dtype.element_ty), mask=mask)
        tl.store(exp_avg_ptr + index, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
        tl.store(exp_avg_sq_ptr + index, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)
        if WRITE_PARAM:
            tl.store(param_ptr + index, master.to(param_ptr.dtype.element_ty), mask=mask)


MOMENT_DTYPES = (torch.float32, torch.bfloat16)  # the moments' storage


def kernel_runs(param: torch.Tensor, grad: torch.Tensor, master: torch.Tensor, stochastic: bool = False) -> bool:
    """Whether adamw_master_step_ takes the Triton kernel: CUDA, Triton, contiguous tensors, an fp32
    master or (stochastic) a bf16 parameter that is its own."""
    return (triton is not None and param.is_cuda and all(t.is_contiguous() for t in (param, grad, master))
            and (master.dtype == torch.float32 or stochastic))


def adamw_master_step_(param: torch.Tensor, grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
                       exp_avg_sq: torch.Tensor, step: int, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, grad_scale: torch.Tensor | None = None,
                       found_inf: torch.Tensor | None = None, rounding_seed: int | None = None) -> None:
    """One AdamW step of `param` (any float dtype) through its fp32 `master` (which may be `param`
    itself), with fp32 or bf16 moments, all updated in place; `step` counts from 1. grad_scale, found_inf:
    one-element tensors on param's device (module docstring), read by the kernel, not the host.
    rounding_seed: a bf16 `param` that is its own `master` is stored stochastically rounded, its random
    bits drawn from this seed (an int below 2**31); None, or any other dtype: rounded to nearest."""
    stochastic = rounding_seed is not None and master is param and param.dtype == torch.bfloat16
    if stochastic and not 0 <= rounding_seed < 2**31:
        raise ValueError(f"rounding_seed must be in [0, 2**31), got {rounding_seed}")
    if not kernel_runs(param, grad, master, stochastic):
        if stochastic:
            reference_stochastic(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                                 rounding_seed, grad_scale, found_inf)
        else:
            reference(param, grad, master, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                      grad_scale, found_inf)
        return
    elements = param.numel()
    if elements == 0:
        return
    _adamw_master_kernel[(triton.cdiv(elements, _ELEMENTS_PER_PROGRAM),)](
        param, grad, master, exp_avg, exp_avg_sq, elements,
        1 - lr * weight_decay, beta1, beta2, eps, lr / (1 - beta1**step), math.sqrt(1 - beta2**step),
        grad if grad_scale is None else grad_scale, grad if found_inf is None else found_inf,
        rounding_seed if stochastic else 0,
        WRITE_PARAM=param is not master, SCALED=grad_scale is not None, SKIPPABLE=found_inf is not None,
        STOCHASTIC=stochastic, BLOCK=_ELEMENTS_PER_PROGRAM, num_warps=8,
    )
