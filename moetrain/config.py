"""Typed schemas for the moetrain configuration, and the checks a schema alone cannot express.

The schemas are plain dataclasses: moetrain.cli registers `Config` in Hydra's ConfigStore, so
every YAML file of conf/ and recipes/ is merged into them and an unknown key or a value of the
wrong type is refused while composing. The model and data groups are open dictionaries instead:
each names its builder with `_target_` (a dotted path) plus that builder's keyword arguments, so
a new model or data set is one YAML file and no schema change. Library code receives these
dataclasses (or the plain dictionaries), never Hydra objects.

The gate group is typed here by its layer-level keys only; each registered gate declares its own
settings next to it (moetrain.moe.gates.register_gate) and moetrain.cli adds them to the schema, so
this module stays a leaf that imports no other part of moetrain.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional, Sequence


class ConfigError(ValueError):
    """A mistake in the composed configuration (a `Config`), named by its keys (`trainer.max_steps`):
    raised by `validate` and by the command line, which reports it as one line naming the key and
    the fix. Library code raises SettingError (or its own exception types) instead."""


class SettingError(ValueError):
    """A setting the library cannot use, named as the Python API spells it: a field of one of the
    dataclasses below (`TrainerConfig.device='cuda'`) or a function's argument (`device='cuda'`),
    with what to change. The command line rewrites these names into its config keys."""


def did_you_mean(word: str, choices) -> str:
    """' (did you mean X?)' for the closest of `choices`, or '' when nothing is close."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]}?)" if close else ""


class Impl(Enum):
    kernel = "kernel"  # moetrain._C (C++ / CUDA)
    torch = "torch"  # the pure-torch reference path


class Device(Enum):
    auto = "auto"  # cuda when a GPU is visible, else cpu
    cpu = "cpu"
    cuda = "cuda"


class Precision(Enum):
    auto = "auto"  # bf16 autocast on CUDA, fp32 on CPU
    bf16 = "bf16"
    fp32 = "fp32"
    fp8 = "fp8"  # bf16 autocast and every expert GEMM in FP8 (moetrain.precision.fp8_matmul); CPU: fp32, FP8 emulated
    fp8_block = "fp8_block"  # as fp8, with DeepSeek-V3's 1x128 / 128x128 block scales instead of row-wise ones


class FP8Wgrad(Enum):
    bf16 = "bf16"  # the weight gradient's GEMM on bf16 operands, as in bf16 training
    fp8 = "fp8"  # in FP8 too, by the precision's recipe (DeepSeek-V3's)


class CompileMode(Enum):
    """torch.compile's modes (the member's value is torch's name for it)."""
    reduce_overhead = "reduce-overhead"  # CUDA graphs: the host's launches replayed from one graph
    max_autotune = "max-autotune"  # Triton kernels and GEMMs chosen by benchmarking them, and CUDA graphs
    max_autotune_no_cudagraphs = "max-autotune-no-cudagraphs"  # the autotuning without CUDA graphs


class ParamDtype(Enum):
    float32 = "float32"  # fp32 parameters; under bf16 autocast each weight is cast to bf16 where it is used
    bfloat16 = "bfloat16"  # bf16 parameters (routers stay fp32); AdamW keeps fp32 master copies and moments


class NonFinite(Enum):
    stop = "stop"  # stop the run, naming the step
    skip = "skip"  # drop that step's update and go on


class BalanceLoss(Enum):
    micro_batch = "micro_batch"  # f_e counted over this process's tokens of the call
    global_batch = "global_batch"  # f_e counted over every rank's tokens (Qwen3, Megatron)
    sequence = "sequence"  # per sequence, averaged (DeepSeek-V3's sequence-wise loss)


class ActivationCheckpointing(Enum):
    none = "none"  # keep every activation
    selective = "selective"  # recompute attention and the experts' hidden activations (never the routing)
    full = "full"  # recompute each transformer block (the routing plan is replayed)


class OptimizerName(Enum):
    adamw = "adamw"
    sgd = "sgd"


@dataclass
class GateConfig:
    """How tokens are routed to experts. The model option fills it with the model's own routing
    (its preset's); a gate option (gate=NAME) or key (gate.KEY=VALUE) changes only what it names.
    Every MoE layer of the model gets these settings (moetrain/models/routing_settings.py)."""

    type: str = "top"  # a registered gate (moetrain.moe.GATES): top, cosine, sigmoid
    top_k: int = 2
    capacity_factor: float = 1.0  # > 0 padded, 0 dropless, < 0 dropless capped: moetrain/moe/routing.py says how
    balance_loss_weight: float = 0.01  # weight of the load-balancing loss added to the training loss
    balance_loss: BalanceLoss = BalanceLoss.micro_batch  # over which tokens the loss counts f_e
    z_loss_weight: float = 0.0  # weight of the router z-loss (ST-MoE)
    batch_prioritized: bool = False  # under a capacity limit, keep the highest-scoring tokens first
    impl: Impl = Impl.kernel
    # Your own gate (docs/extending.md): the dotted path of a moetrain.moe.Gate subclass, used
    # instead of `type` and the built-in gates' settings, and its constructor arguments
    # (+gate.kwargs.NAME=VALUE).
    _target_: Optional[str] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)


class ParallelStrategy(Enum):
    data = "data"  # every rank holds every expert; all gradients averaged over ranks
    expert = "expert"  # experts sharded over ranks, tokens exchanged by all-to-all
    fsdp = "fsdp"  # every parameter sharded over all ranks (FSDP2), experts included
    fsdp_expert = "fsdp_expert"  # experts placed by expert parallelism, the rest sharded by FSDP2


@dataclass
class ParallelConfig:
    """How many processes share the work (one per GPU, or CPU processes over Gloo); docs/distributed.md."""

    nproc_per_node: int = 1  # workers started on this machine (torchrun starts its own instead)
    strategy: ParallelStrategy = ParallelStrategy.expert
    adaptive_r: int = 1  # expert strategy: 0 data parallel, 1 expert parallel, r > 1 splits experts over r ranks
    a2a_ffn_overlap_degree: int = 1  # chunks that overlap the all-to-all with expert compute (GPUs)
    zero: bool = False  # ZeRO-1: shard the optimizer state of shared (non-expert) parameters
    backend: Optional[str] = None  # nccl | gloo; null: NCCL on GPUs, Gloo on CPUs
    mixed_precision: bool = False  # fsdp: bf16 parameters in compute, fp32 master weights and reductions
    cpu_offload: bool = False  # fsdp: parameters, gradients and optimizer state wait on the CPU
    # Seconds a collective waits for the other ranks before it fails (a frozen rank then stops the
    # job with a message naming it instead of hanging it); a checkpoint save must fit in it too.
    timeout_s: float = 300.0


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.adamw
    lr: float = 1e-3
    weight_decay: float = 0.05  # applied to matrices only, never to biases or norm scales
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])  # adamw
    eps: float = 1e-8  # adamw
    momentum: float = 0.9  # sgd
    warmup_steps: int = 100  # linear warm-up from lr / (warmup_steps + 1) to lr
    min_lr_ratio: float = 0.1  # the cosine decay ends at lr * min_lr_ratio on trainer.max_steps
    # AdamW's moments with bf16 parameters (trainer.param_dtype=bfloat16): float32, or bfloat16 (updated
    # in fp32, stored rounded: 20 instead of 28 bytes an element a step; docs/performance.md)
    moment_dtype: ParamDtype = ParamDtype.float32
    # With bf16 parameters: true, AdamW keeps an fp32 master copy of each; false, none: each bf16
    # parameter is updated in fp32 and stored with stochastic rounding (6 bytes an element fewer moved
    # a step and 4 fewer held; not the same arithmetic: docs/performance.md)
    master_weights: bool = True


@dataclass
class TrainerConfig:
    max_steps: int = 1000  # optimizer steps
    grad_accum_steps: int = 1  # micro-batches of data.batch_size per optimizer step
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    eval_every: int = 200  # steps between evaluations; 0 = only at the end
    eval_batches: int = 0  # batches per evaluation; 0 = the whole evaluation set
    checkpoint_every: int = 500  # steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = 2  # newest checkpoints kept in the run directory; 0 = keep all
    resume: Optional[str] = None  # null, "auto" (latest checkpoint of this run dir) or a path
    on_nonfinite: NonFinite = NonFinite.stop
    device: Device = Device.auto
    precision: Precision = Precision.auto
    # The parameters' dtype: float32, or bfloat16 with fp32 master weights kept by the optimizer
    # (the bf16 weights are the fp32 masters rounded after each update; needs optim=adamw).
    param_dtype: ParamDtype = ParamDtype.float32
    # Language models: the LM head and the loss in one pass over chunks of tokens, no logits kept
    # (moetrain.ops.linear_cross_entropy); false: the logits, then the cross-entropy.
    fused_loss: bool = True
    fp8_wgrad: Optional[FP8Wgrad] = None  # precision fp8 | fp8_block: the weight gradient's GEMM; null = bf16
    # precision fp8: the blocks' dense linears (attention projections, dense FFNs, shared experts) in
    # row-wise FP8 too (moetrain.precision.fp8_linear); false: only the routed experts
    fp8_linears: bool = False
    progress_bar: bool = True
    # torch.compile the model before training: faster steps on GPUs; on a CPU it works but the
    # first step compiles for a long time. Checkpoints keep the plain model's parameter names.
    compile: bool = False
    compile_mode: Optional[CompileMode] = None  # with compile: torch.compile's mode; null = its default
    # with compile: inductor compiles each reduction (norms, softmax, amax) both in one pass over a row
    # held in registers and as a loop over the row, and keeps the faster at its first call
    # (inductor's triton.multi_kernel): longer compiles, fewer passes over rows of a few thousand
    compile_tuned_reductions: bool = False
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none
    async_checkpoint: bool = False  # multi-process: write sharded checkpoints while training goes on
    # Profile steps profile_at .. profile_at + 2 and write where their time goes (anatomy.md in the
    # run directory: GPU milliseconds per part of the step, and idle time); 0 = never.
    profile_at: int = 0


@dataclass
class QuantConfig:
    """Quantized evaluation (mode=eval): the routed experts' weight formats (moetrain.quant)."""

    format: Optional[str] = None  # fp8 | fp8_block | mxfp4 | nvfp4; null = evaluate unquantized only
    hot_format: Optional[str] = None  # the most used experts' format (per-expert precision)
    hot_fraction: float = 0.25  # share of each layer's experts that get hot_format
    calibration_batches: int = 0  # training batches that measure expert use (needed with hot_format)
    export: Optional[str] = None  # path of a quantized checkpoint to write after quantizing


class Mode(Enum):
    train = "train"  # train (or continue training) the model
    eval = "eval"  # load trainer.resume, evaluate it, quantized per `quant` and as trained


@dataclass
class LoggerConfig:
    tensorboard: bool = True  # event files in the run directory
    log_every: int = 10  # steps between logged training metrics


@dataclass
class Config:
    name: str = "moetrain"  # names the run directory: runs/<date>_<time>_<name>
    seed: int = 0
    mode: Mode = Mode.train
    model: Dict[str, Any] = field(default_factory=dict)
    gate: GateConfig = field(default_factory=GateConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: Dict[str, Any] = field(default_factory=dict)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# The run directory is runs/<date>_<time>_<name>: a name is one short folder name.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.=+,-]*")
NAME_MAX_LENGTH = 100


def _validate_name(name: str) -> None:
    _require(
        NAME_PATTERN.fullmatch(name) is not None and len(name) <= NAME_MAX_LENGTH,
        f"name={name[:60]!r}{'...' if len(name) > 60 else ''} ({len(name)} characters) names the run directory "
        f"runs/<date>_<time>_<name>, one folder: use at most {NAME_MAX_LENGTH} letters, digits and . _ - + = , "
        f"starting with a letter or digit (no / and no ..)",
    )


def _validate_finite(node, path: str) -> None:
    """No float key of the schema may be inf or nan: each is a weight, a rate, a ratio or a limit
    for which such a value would only surface later, as a crash or a silently useless run."""
    for item in dataclasses.fields(node):
        value = getattr(node, item.name)
        values = value if isinstance(value, list) else [value]
        for number in values:
            _require(
                not isinstance(number, float) or math.isfinite(number),
                f"{path}.{item.name} must be {'finite numbers' if isinstance(value, list) else 'a finite number'}, "
                f"got {value}" + (f" (default {item.default})" if item.default is not dataclasses.MISSING else ""),
            )


def validate(cfg: Config, quant_formats: Sequence[str], num_experts: int | None = None) -> None:
    """Checks across keys and on value ranges; raises ConfigError with a one-line fix. quant_formats:
    the expert weight formats moetrain.quant knows (given by the caller: this module imports no other).
    num_experts: the model's experts per MoE layer where its config.json, not model.num_experts, says
    (model=hf: a checkpoint's, read by the caller)."""
    gate, trainer, optim = cfg.gate, cfg.trainer, cfg.optim
    _validate_name(cfg.name)
    for group in ("gate", "parallel", "optim", "trainer", "logger", "quant"):
        _validate_finite(getattr(cfg, group), group)
    _require(gate.top_k >= 1, f"gate.top_k must be >= 1, got {gate.top_k}")
    stated = cfg.model.get("num_experts")
    if isinstance(stated, int):
        num_experts, experts_key = stated, f"model.num_experts={stated}"
        _require(num_experts >= 1, f"model.num_experts must be >= 1, got {num_experts}: give each MoE layer experts")
        _require(
            gate.top_k <= num_experts,
            f"gate.top_k={gate.top_k} exceeds model.num_experts={num_experts}: "
            f"lower gate.top_k or raise model.num_experts",
        )
    elif num_experts is not None:
        experts_key = f"the {num_experts} experts of model.path={cfg.model.get('path')}"
        _require(gate.top_k <= num_experts, f"gate.top_k={gate.top_k} exceeds {experts_key}: lower gate.top_k")
    parallel = cfg.parallel
    _require(parallel.nproc_per_node >= 1, f"parallel.nproc_per_node must be >= 1, got {parallel.nproc_per_node}")
    _require(parallel.adaptive_r >= 0, f"parallel.adaptive_r must be >= 0 (0 data parallel, 1 expert parallel), got {parallel.adaptive_r}")
    _require(parallel.a2a_ffn_overlap_degree >= 1, f"parallel.a2a_ffn_overlap_degree must be >= 1, got {parallel.a2a_ffn_overlap_degree}")
    _require(parallel.backend in (None, "nccl", "gloo"), f"parallel.backend must be nccl, gloo or null (by device), got {parallel.backend}")
    _require(parallel.timeout_s > 0, f"parallel.timeout_s must be > 0 seconds, got {parallel.timeout_s}")
    ranks = parallel.nproc_per_node
    fsdp = parallel.strategy in (ParallelStrategy.fsdp, ParallelStrategy.fsdp_expert)
    for key in ("mixed_precision", "cpu_offload"):
        _require(fsdp or not getattr(parallel, key),
                 f"parallel.{key} applies to parallel.strategy=fsdp|fsdp_expert, not {parallel.strategy.value}")
    # FSDP2 shards one dtype per group of parameters (the routers stay fp32): it computes in bf16 from
    # fp32 parameters itself, with parallel.mixed_precision
    _require(not fsdp or trainer.param_dtype == ParamDtype.float32,
             f"trainer.param_dtype=bfloat16 applies to parallel.strategy=data|expert, not {parallel.strategy.value}: "
             "set trainer.param_dtype=float32 and parallel.mixed_precision=true (bf16 compute, fp32 parameters)")
    expert_placed = parallel.strategy in (ParallelStrategy.expert, ParallelStrategy.fsdp_expert)
    for key in ("adaptive_r", "a2a_ffn_overlap_degree"):  # read by expert parallelism only: never ignored silently
        _require(expert_placed or getattr(parallel, key) == 1,
                 f"parallel.{key} applies to parallel.strategy=expert, not {parallel.strategy.value}: "
                 f"remove parallel.{key} or set parallel.strategy=expert")
    if expert_placed and ranks > 1 and isinstance(num_experts, int):
        _require(
            num_experts % ranks == 0 if num_experts >= ranks else ranks % num_experts == 0,
            f"{experts_key} cannot be sharded over parallel.nproc_per_node={ranks}: use a "
            f"multiple or a divisor of {ranks} experts, or parallel.strategy=data",
        )
    # lr = 0 trains nothing (a check that a run reproduces its starting weights; eval-only loops).
    _require(optim.lr >= 0, f"optim.lr must be >= 0, got {optim.lr}")
    _require(len(optim.betas) == 2, f"optim.betas must hold two numbers, got {list(optim.betas)}")
    _require(optim.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {optim.warmup_steps}")
    _require(0 <= optim.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {optim.min_lr_ratio}")
    for key in ("max_steps", "grad_accum_steps"):
        _require(getattr(trainer, key) >= 1, f"trainer.{key} must be >= 1, got {getattr(trainer, key)}")
    for key in ("eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints", "profile_at"):
        _require(getattr(trainer, key) >= 0, f"trainer.{key} must be >= 0, got {getattr(trainer, key)}")
    _require(optim.moment_dtype == ParamDtype.float32 or trainer.param_dtype == ParamDtype.bfloat16,
             "optim.moment_dtype=bfloat16 keeps the moments of the master-weight AdamW of bf16 parameters: set "
             "trainer.param_dtype=bfloat16 too, or optim.moment_dtype=float32")
    _require(optim.master_weights or trainer.param_dtype == ParamDtype.bfloat16,
             "optim.master_weights=false rounds bf16 parameters stochastically: set trainer.param_dtype=bfloat16 "
             "too, or optim.master_weights=true")
    _require(trainer.param_dtype == ParamDtype.float32 or optim.name == OptimizerName.adamw,
             f"trainer.param_dtype=bfloat16 keeps fp32 master weights in AdamW: set optim=adamw, or "
             f"trainer.param_dtype=float32 for optim={optim.name.value}")
    _require(trainer.param_dtype == ParamDtype.float32 or trainer.precision in (Precision.auto, Precision.bf16,
                                                                                  Precision.fp8, Precision.fp8_block),
             "trainer.param_dtype=bfloat16 computes in bf16: use trainer.precision=bf16|fp8|fp8_block|auto, or "
             "trainer.param_dtype=float32 with trainer.precision=fp32")
    _require(trainer.grad_clip >= 0, f"trainer.grad_clip must be >= 0 (0 = off), got {trainer.grad_clip}")
    _require(cfg.logger.log_every >= 1, f"logger.log_every must be >= 1, got {cfg.logger.log_every}")
    _validate_quant(cfg, quant_formats)
    for group in ("model", "data"):
        _require(
            isinstance(getattr(cfg, group).get("_target_"), str),
            f"{group} has no _target_: pick a {group} preset ({group}=NAME) or set {group}._target_",
        )


def _validate_quant(cfg: Config, formats: Sequence[str]) -> None:
    quant, choices = cfg.quant, "|".join(formats)
    for key in ("format", "hot_format"):
        value = getattr(quant, key)
        _require(value is None or value in formats, f"quant.{key} must be one of {choices} or null, got {value!r}"
                 + did_you_mean(value, formats))
    _require(quant.hot_format is None or quant.format is not None,
             "quant.hot_format needs quant.format (the other experts' format) as well")
    _require(0.0 <= quant.hot_fraction <= 1.0, f"quant.hot_fraction must be in [0, 1], got {quant.hot_fraction}")
    _require(quant.calibration_batches >= 0, f"quant.calibration_batches must be >= 0, got {quant.calibration_batches}")
    needs_calibration = quant.hot_format is not None and quant.hot_format != quant.format
    _require(not needs_calibration or quant.calibration_batches > 0,
             "quant.hot_format picks the most used experts: set quant.calibration_batches to a number > 0")
    _require(quant.export is None or quant.format is not None,
             "quant.export writes a quantized checkpoint: choose a format too (quant=fp8|fp8_block|mxfp4|nvfp4|mixed)")
    if cfg.mode == Mode.eval:
        _require(bool(cfg.trainer.resume),
                 "mode=eval evaluates a trained model: pass trainer.resume=RUN_DIR (a run directory or checkpoint file)")
    else:
        _require(quant.format is None, "quant applies to mode=eval: add mode=eval trainer.resume=RUN_DIR, or drop quant")
