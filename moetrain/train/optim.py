"""The optimizer and its warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from moetrain.config import OptimConfig, OptimizerName, ParamDtype
from moetrain.moe import is_expert_param
from moetrain.ops import adamw


def _decays(parameter: nn.Parameter) -> bool:
    """Weight decay shrinks weight matrices only: not biases, norm scales, or the per-expert
    biases of routed experts (b1 [E, H], b2 [E, D], vectors stacked along the expert dimension)."""
    return parameter.ndim >= 3 or (parameter.ndim == 2 and not is_expert_param(parameter))


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW for 16-bit parameters through fp32 master weights (Megatron's mixed-precision layout).

    Each bf16 (or fp16) parameter gets an fp32 master copy and two moments (fp32 unless
    moment_dtype says otherwise) in its state; a step updates the master from the 16-bit gradient
    and writes the master, rounded, back into the parameter (moetrain.ops.adamw: one pass per
    parameter on CUDA). fp32 parameters (the routers) are their own masters. The masters are in the
    state dict, so a resumed run continues from the same fp32 weights bit for bit, and they stay fp32
    when a checkpoint is loaded. moment_dtype=torch.bfloat16 stores both moments in bf16 (computed in
    fp32, rounded to nearest when stored): 20 bytes moved an element instead of 28; a checkpoint's
    moments are loaded in this optimizer's moment dtype.

    master_weights=False keeps no fp32 copy: a bf16 parameter is its own master, updated in fp32 and
    stored with stochastic rounding (moetrain.ops.adamw), 14 bytes moved an element with bf16 moments
    instead of 20, and 4 bytes less held. The random bits of a parameter's step are a function of
    rounding_seed, the parameter's key and the step count, so a resumed run, and every data-parallel
    replica of a parameter, rounds the same way. A parameter's key (`rounding_keys`) is its place among
    the parameters given to the constructor; it stays when the groups are narrowed afterwards (ZeRO-1
    keeping each rank's own), and an expert-parallel wrapper gives each rank's experts keys of their
    own (`set_rounding_key`), so that different experts in the same place never share their bits. A
    checkpoint's masters are dropped on load (the parameters are loaded with the model); a checkpoint
    without masters loaded with master_weights=True starts them from the bf16 parameters.

    Like torch's fused optimizers it takes the GradScaler protocol's two device scalars, set as
    attributes before step() (step_with_device_flags): `grad_scale` divides every gradient and a
    non-zero `found_inf` leaves every tensor as it was, decided by the kernel with no host sync. The
    step counts (host numbers, for the bias corrections) are then counted as taken and put right once
    the flag has reached the host: by the next step(), or state_dict(), whichever comes first.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, moment_dtype: torch.dtype = torch.float32, master_weights: bool = True,
                 rounding_seed: int = 0):
        if moment_dtype not in adamw.MOMENT_DTYPES:
            raise ValueError(f"moment_dtype must be one of {list(adamw.MOMENT_DTYPES)}, got {moment_dtype}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.moment_dtype, self.master_weights, self.rounding_seed = moment_dtype, master_weights, rounding_seed
        if not master_weights:
            other = {p.dtype for group in self.param_groups for p in group["params"]} - {torch.float32, torch.bfloat16}
            if other:
                raise ValueError(f"master_weights=False rounds bf16 parameters stochastically; {sorted(map(str, other))} "
                                 "parameters need fp32 master weights (master_weights=True)")
        self._unconfirmed = None  # (found_inf on its way to the host, its copy's event, the params stepped)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        keys = self.__dict__.setdefault("rounding_keys", {})  # (the constructor adds its groups here too)
        for param in self.param_groups[-1]["params"]:
            keys.setdefault(param, len(keys))

    def set_rounding_key(self, param: torch.Tensor, key: int) -> None:
        """The key whose bits round `param` (distinct keys: independent bits; see the class doc)."""
        if param not in self.rounding_keys:
            raise ValueError("set_rounding_key: the parameter is not one this optimizer was built with")
        if not 0 <= key < 2**63:
            raise ValueError(f"set_rounding_key: key must be in [0, 2**63), got {key}")
        self.rounding_keys[param] = key

    def _confirm_steps(self) -> None:
        """Take back the step counts of the last step if its found_inf said it was skipped."""
        if self._unconfirmed is None:
            return
        flag, copied, stepped = self._unconfirmed
        self._unconfirmed = None
        if copied is not None:
            copied.synchronize()
        if float(flag) != 0:
            for param in stepped:
                self.state[param]["step"] -= 1

    def state_dict(self) -> dict:
        self._confirm_steps()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        # torch's Optimizer.load_state_dict casts float state to each parameter's dtype: the masters of
        # a bf16 parameter are put back in fp32, as saved, and the moments in this optimizer's dtype.
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        indices = [index for group in state_dict["param_groups"] for index in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        for index, param in zip(indices, params):
            for key, value in saved.get(index, {}).items():
                if key != "step" and isinstance(value, torch.Tensor):
                    dtype = torch.float32 if key == "master" else self.moment_dtype
                    self.state[param][key] = value.to(device=param.device, dtype=dtype)
            state = self.state[param]
            if not self.master_weights:
                state.pop("master", None)
            elif state and param.dtype != torch.float32 and "master" not in state:
                state["master"] = param.detach().float()  # saved without masters: from the weights
        self._unconfirmed = None

    def _state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            if param.dtype != torch.float32 and self.master_weights:
                state["master"] = param.detach().float()
            state["exp_avg"] = torch.zeros_like(param, dtype=self.moment_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.moment_dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._confirm_steps()
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        stepped = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self._state(param)
                state["step"] += 1
                stepped.append(param)
                step = int(state["step"].item())
                seed = (None if self.master_weights
                        else rounding_seed(self.rounding_seed, self.rounding_keys[param], step))
                adamw.adamw_master_step_(param, param.grad, state.get("master", param), state["exp_avg"],
                                         state["exp_avg_sq"], step, group["lr"], beta1, beta2,
                                         group["eps"], group["weight_decay"], _on(grad_scale, param),
                                         _on(found_inf, param), rounding_seed=seed)
        if found_inf is not None and stepped:
            (flag,), copied = to_host(found_inf)
            self._unconfirmed = flag, copied, stepped
        return loss


def rounding_seed(seed: int, key: int, step: int) -> int:
    """The seed of the random bits that round the parameter of `key` at `step` (splitmix64 of the
    three, in [0, 2**31)): distinct for each parameter and step, the same on every replica."""
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + key * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) % (1 << 31)


def _on(scalar: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor | None:
    return None if scalar is None else scalar.to(param.device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Device tensors' values on their way to the host, without waiting for them: (host copies, the
    event to wait on before reading them; None on the CPU, where the copies are ready)."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.detach().clone() for t in tensors], None
    copies = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for copy, tensor in zip(copies, tensors):
        copy.copy_(tensor.detach(), non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return copies, copied


def takes_device_flags(optimizer: torch.optim.Optimizer) -> bool:
    """Whether step_with_device_flags can drive this optimizer: MasterWeightAdamW, or one of torch's
    fused optimizers (which read the same two tensors)."""
    return isinstance(optimizer, MasterWeightAdamW) or bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_with_device_flags(optimizer: torch.optim.Optimizer, skip: torch.Tensor, clip: torch.Tensor | None) -> None:
    """optimizer.step() with its gradients multiplied by `clip` (None: as they are) and no change at all
    where `skip` is true; both are one-element tensors on the parameters' device, read there, so the
    host neither waits for them nor learns them. Through the GradScaler protocol's grad_scale (which
    the gradients are divided by) and found_inf (takes_device_flags)."""
    optimizer.found_inf = skip.to(torch.float32).reshape(())
    optimizer.grad_scale = None if clip is None else (1.0 / clip.to(torch.float32)).reshape(())
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf, optimizer.grad_scale


def build_optimizer(model: nn.Module, cfg: OptimConfig, seed: int = 0) -> torch.optim.Optimizer:
    """AdamW or SGD over the model's trainable parameters, weight decay on weight matrices only. With
    16-bit parameters (TrainerConfig.param_dtype=bfloat16) AdamW keeps fp32 master weights
    (MasterWeightAdamW), its moments in OptimConfig.moment_dtype, or with OptimConfig.master_weights=False
    none (bf16 parameters rounded stochastically, from `seed`); SGD needs fp32 parameters, and bf16
    moments and master_weights=False need 16-bit parameters."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in parameters if _decays(p)], "weight_decay": cfg.weight_decay},
        {"params": [p for p in parameters if not _decays(p)], "weight_decay": 0.0},
    ]
    # On CUDA one fused kernel updates every parameter: on moe_1b5 (1.47B fp32 parameters, H200) the
    # default multi-tensor AdamW took 32 ms of a 270 ms step, the fused one about half of that.
    # Elsewhere (CPU) torch's default implementation.
    fused = True if parameters and all(p.device.type == "cuda" for p in parameters) else None
    betas = tuple(cfg.betas)
    low_precision = any(p.dtype in (torch.bfloat16, torch.float16) for p in parameters)
    if low_precision:
        if cfg.name != OptimizerName.adamw:
            raise ValueError(f"OptimConfig.name={cfg.name.value!r} needs fp32 parameters: use 'adamw', whose "
                             "fp32 master weights make 16-bit parameters trainable")
        return MasterWeightAdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps,
                                 moment_dtype=getattr(torch, cfg.moment_dtype.value),
                                 master_weights=cfg.master_weights, rounding_seed=seed % (1 << 31))
    if cfg.moment_dtype != ParamDtype.float32:
        raise ValueError(f"OptimConfig.moment_dtype={cfg.moment_dtype.value!r} keeps the moments of the "
                         "master-weight AdamW of 16-bit parameters: set TrainerConfig.param_dtype='bfloat16', or "
                         "OptimConfig.moment_dtype='float32'")
    if not cfg.master_weights:
        raise ValueError("OptimConfig.master_weights=False rounds bf16 parameters stochastically: set "
                         "TrainerConfig.param_dtype='bfloat16', or OptimConfig.master_weights=True")
    if cfg.name == OptimizerName.adamw:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, fused=fused)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=fused)


def clip_factor(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """What torch.nn.utils.clip_grads_with_norm_ multiplies the gradients by: max_norm / (total_norm
    + 1e-6), clamped to 1 (1: not clipped)."""
    return (max_norm / (total_norm + 1e-6)).clamp(max=1.0)


def learning_rate(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """The learning rate of the optimizer step taken after `step` completed steps: a linear warm-up
    from lr / (warmup_steps + 1) to lr over optim.warmup_steps, then a cosine decay that reaches
    lr * min_lr_ratio at max_steps and stays there (never a second cycle)."""
    warmup_steps = min(cfg.warmup_steps, max_steps - 1)
    if step < warmup_steps:
        return cfg.lr * (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress)) / 2.0


class WarmupCosine:
    """Sets every parameter group's lr to learning_rate(step) of the current config.

    The schedule is a function of the step alone, so it holds no state worth saving: a resumed run
    follows the config it is started with (a new max_steps, lr or warm-up), never the saved one.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
        self.optimizer, self.cfg, self.max_steps = optimizer, cfg, max_steps
        self.set_step(0)

    def set_step(self, step: int) -> None:
        """Steps completed so far: the next optimizer step uses learning_rate(step)."""
        self.steps_done = step
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(step, self.cfg, self.max_steps)

    def step(self) -> None:
        self.set_step(self.steps_done + 1)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int) -> WarmupCosine:
    """Linear warm-up over optim.warmup_steps, then cosine decay to lr * min_lr_ratio at max_steps."""
    return WarmupCosine(optimizer, cfg, max_steps)
