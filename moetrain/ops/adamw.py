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


if triton is not None:

    @triton.jit
    def _adamw_master_kernel(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, elements,
                             decay, beta1, beta2, eps, step_size, bias_correction2_sqrt, grad_scale_ptr, found_inf_ptr,
                             WRITE_PARAM: tl.constexpr, SCALED: tl.constexpr, SKIPPABLE: tl.constexpr,
                             BLOCK: tl.constexpr):
        index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if SKIPPABLE:  # a skipped step: no element is live, every load and store is masked off
            elements = tl.where(tl.load(found_inf_ptr) != 0, 0, elements)
        mask = index < elements
        g = tl.load(grad_ptr + index, mask=mask).to(tl.float32)
        if SCALED:  # divided exactly (IEEE), as torch's fused optimizers divide
            g = tl.math.div_rn(g, tl.full(g.shape, tl.load(grad_scale_ptr).to(tl.float32), tl.float32))
        master = tl.load(master_ptr + index, mask=mask)
        m = tl.load(exp_avg_ptr + index, mask=mask).to(tl.float32)
        v = tl.load(exp_avg_sq_ptr + index, mask=mask).to(tl.float32)
        master = master * decay
        m = m + (1.0 - beta1) * (g - m)
        v = beta2 * v + (1.0 - beta2) * g * g
        master = master - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
        tl.store(master_ptr + index, master, mask=mask)
        tl.store(exp_avg_ptr + index, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
        tl.store(exp_avg_sq_ptr + index, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)
        if WRITE_PARAM:
            tl.store(param_ptr + index, master.to(param_ptr.dtype.element_ty), mask=mask)


if triton is not None:

    @triton.jit
    def _adamw_master_tensors_kernel(addresses_ptr, settings_ptr, block_tensor_ptr, first_block_ptr, grad_scale_ptr,
                                     found_inf_ptr, PARAM: tl.constexpr, GRAD: tl.constexpr, MOMENT: tl.constexpr,
                                     WRITE_PARAM: tl.constexpr,
                                     SCALED: tl.constexpr, SKIPPABLE: tl.constexpr, BLOCK: tl.constexpr):
        # _adamw_master_kernel over many tensors in one launch: program b updates BLOCK elements of
        # tensor t = block_tensor[b], whose five addresses (param, grad, master, exp_avg, exp_avg_sq)
        # and element count are row t of `addresses`, and whose fp32 constants (decay, step size, the
        # second bias correction's root, beta1, beta2, eps) are row t of `settings`.
        block = tl.program_id(0)
        tensor = tl.load(block_tensor_ptr + block).to(tl.int64)
        row = addresses_ptr + tensor * 6
        # Every address is a multiple of 16 bytes (multi_tensor_runs): said so, the loads are vectorized.
        param_ptr = tl.multiple_of(tl.load(row).to(tl.pointer_type(PARAM)), 16)
        grad_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(GRAD)), 16)
        master_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.float32)), 16)
        exp_avg_ptr = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(MOMENT)), 16)
        exp_avg_sq_ptr = tl.multiple_of(tl.load(row + 4).to(tl.pointer_type(MOMENT)), 16)
        elements = tl.load(row + 5)
        if SKIPPABLE:  # a skipped step: no element is live, every load and store is masked off
            elements = tl.where(tl.load(found_inf_ptr) != 0, 0, elements)
        setting = settings_ptr + tensor * 6
        decay, step_size = tl.load(setting), tl.load(setting + 1)
        bias_correction2_sqrt, beta1 = tl.load(setting + 2), tl.load(setting + 3)
        beta2, eps = tl.load(setting + 4), tl.load(setting + 5)
        scale = tl.load(grad_scale_ptr).to(tl.float32) if SCALED else 1.0
        start = (block - tl.load(first_block_ptr + tensor)).to(tl.int64) * BLOCK
        index = start + tl.arange(0, BLOCK)
        # Whole blocks unmasked (vectorized loads and stores), the tensor's last block masked.
        if start + BLOCK <= elements:
            _update(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, index, index < elements, scale,
                    decay, beta1, beta2, eps, step_size, bias_correction2_sqrt, WRITE_PARAM, SCALED, MASKED=False)
        else:
            _update(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, index, index < elements, scale,
                    decay, beta1, beta2, eps, step_size, bias_correction2_sqrt, WRITE_PARAM, SCALED, MASKED=True)

    @triton.jit
    def _update(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, index, mask, scale, decay, beta1, beta2,
                eps, step_size, bias_correction2_sqrt, WRITE_PARAM: tl.constexpr, SCALED: tl.constexpr,
                MASKED: tl.constexpr):
        """_adamw_master_kernel's arithmetic on the elements at index (within mask where MASKED)."""
        if MASKED:
            g = tl.load(grad_ptr + index, mask=mask).to(tl.float32)
            master = tl.load(master_ptr + index, mask=mask)
            m = tl.load(exp_avg_ptr + index, mask=mask).to(tl.float32)
            v = tl.load(exp_avg_sq_ptr + index, mask=mask).to(tl.float32)
        else:
            g = tl.load(grad_ptr + index).to(tl.float32)
            master = tl.load(master_ptr + index)
            m = tl.load(exp_avg_ptr + index).to(tl.float32)
            v = tl.load(exp_avg_sq_ptr + index).to(tl.float32)
        if SCALED:
            g = tl.math.div_rn(g, tl.full(g.shape, scale, tl.float32))
        master = master * decay
        m = m + (1.0 - beta1) * (g - m)
        v = beta2 * v + (1.0 - beta2) * g * g
        master = master - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
        if MASKED:
            tl.store(master_ptr + index, master, mask=mask)
            tl.store(exp_avg_ptr + index, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
            tl.store(exp_avg_sq_ptr + index, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)
            if WRITE_PARAM:
                tl.store(param_ptr + index, master.to(param_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(master_ptr + index, master)
            tl.store(exp_avg_ptr + index, m.to(exp_avg_ptr.dtype.element_ty))
            tl.store(exp_avg_sq_ptr + index, v.to(exp_avg_sq_ptr.dtype.element_ty))
            if WRITE_PARAM:
                tl.store(param_ptr + index, master.to(param_ptr.dtype.element_ty))


_TRITON_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
MOMENT_DTYPES = (torch.float32, torch.bfloat16)  # the moments' storage


def constants(step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> list[float]:
    """The update's constants for one tensor, as both kernels take them (step counts from 1)."""
    return [1 - lr * weight_decay, lr / (1 - beta1**step), math.sqrt(1 - beta2**step), beta1, beta2, eps]


def _to_device(rows: list[list], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small table copied to the device without waiting for it (from pinned memory on CUDA)."""
    table = torch.tensor(rows, dtype=dtype, pin_memory=device.type == "cuda")
    return table.to(device, non_blocking=True)


def adamw_master_tensors_(updates: list[tuple[torch.Tensor, ...]], settings: list[list[float]],
                          blocks: dict | None = None, grad_scale: torch.Tensor | None = None,
                          found_inf: torch.Tensor | None = None) -> None:
    """adamw_master_step_ of many tensors in one launch: updates[i] = (param, grad, master, exp_avg,
    exp_avg_sq), settings[i] = constants(...) of that tensor. Every param must have one dtype, every
    grad one dtype, every moment one dtype, and either every master be its param or none; each tensor contiguous, on one
    device (CUDA, or the CPU under Triton's interpreter). blocks: a cache for the program-to-tensor
    map, which depends only on the tensors' sizes (pass the same dict each step). grad_scale,
    found_inf: as adamw_master_step_'s, one pair for all the tensors."""
    kept = [(update, setting) for update, setting in zip(updates, settings) if update[0].numel()]
    if not kept:
        return
    updates, settings = [update for update, _ in kept], [setting for _, setting in kept]
    device = updates[0][0].device
    sizes = tuple(p.numel() for p, *_ in updates)
    key = (device, sizes)
    maps = None if blocks is None else blocks.get(key)
    if maps is None:
        per_tensor = torch.tensor([triton.cdiv(n, _ELEMENTS_PER_PROGRAM) for n in sizes], dtype=torch.int64)
        first = torch.cumsum(per_tensor, 0) - per_tensor
        block_tensor = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), per_tensor)
        maps = (block_tensor.to(device), first.to(device), int(per_tensor.sum()))
        if blocks is not None:
            blocks[key] = maps
    block_tensor, first_block, programs = maps
    addresses = _to_device([[t.data_ptr() for t in update] + [update[0].numel()] for update in updates], torch.int64,
                           device)
    constants_T6 = _to_device(settings, torch.float32, device)
    param, grad, master = updates[0][:3]
    _adamw_master_tensors_kernel[(programs,)](
        addresses, constants_T6, block_tensor, first_block,
        constants_T6 if grad_scale is None else grad_scale, constants_T6 if found_inf is None else found_inf,
        PARAM=getattr(tl, _TRITON_DTYPES[param.dtype]), GRAD=getattr(tl, _TRITON_DTYPES[grad.dtype]),
        MOMENT=getattr(tl, _TRITON_DTYPES[updates[0][3].dtype]), WRITE_PARAM=param is not master, SCALED=grad_scale is not None, SKIPPABLE=found_inf is not None,
        BLOCK=_ELEMENTS_PER_PROGRAM, num_warps=8,
    )


def kernel_runs(param: torch.Tensor, grad: torch.Tensor, master: torch.Tensor) -> bool:
    """Whether adamw_master_step_ takes the Triton kernel: CUDA, Triton, contiguous tensors."""
    return (triton is not None and param.is_cuda and all(t.is_contiguous() for t in (param, grad, master))
            and master.dtype == torch.float32)


def multi_tensor_runs(param: torch.Tensor, grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor) -> bool:
    """Whether adamw_master_tensors_ takes these tensors (besides kernel_runs' conditions): contiguous
    moments of one dtype (fp32 or bf16), a parameter and gradient dtype its kernel knows, and every
    address a multiple of 16 bytes (the kernel is told so, to vectorize; a view at an odd offset is
    updated alone)."""
    tensors = (param, grad, master, exp_avg, exp_avg_sq)
    return (param.dtype in _TRITON_DTYPES and grad.dtype in _TRITON_DTYPES
            and exp_avg.dtype in MOMENT_DTYPES and exp_avg_sq.dtype == exp_avg.dtype
            and exp_avg.is_contiguous() and exp_avg_sq.is_contiguous() and all(t.data_ptr() % 16 == 0 for t in tensors))


def adamw_master_step_(param: torch.Tensor, grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
                       exp_avg_sq: torch.Tensor, step: int, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, grad_scale: torch.Tensor | None = None,
                       found_inf: torch.Tensor | None = None) -> None:
    """One AdamW step of `param` (any float dtype) through its fp32 `master` (which may be `param`
    itself), with fp32 moments, all updated in place; `step` counts from 1. grad_scale, found_inf:
    one-element tensors on param's device (module docstring), read by the kernel, not the host."""
    if not kernel_runs(param, grad, master):
        reference(param, grad, master, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, grad_scale,
                  found_inf)
        return
    elements = param.numel()
    if elements == 0:
        return
    _adamw_master_kernel[(triton.cdiv(elements, _ELEMENTS_PER_PROGRAM),)](
        param, grad, master, exp_avg, exp_avg_sq, elements,
        1 - lr * weight_decay, beta1, beta2, eps, lr / (1 - beta1**step), math.sqrt(1 - beta2**step),
        grad if grad_scale is None else grad_scale, grad if found_inf is None else found_inf,
        WRITE_PARAM=param is not master, SCALED=grad_scale is not None, SKIPPABLE=found_inf is not None,
        BLOCK=_ELEMENTS_PER_PROGRAM, num_warps=8,
    )
