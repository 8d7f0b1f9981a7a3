"""The training loop: one process on a CPU or one GPU (its processes object is the multi-process seam).

Each optimizer step takes TrainerConfig.grad_accum_steps micro-batches. The loss is cross-entropy
of the model's logits against integer targets (one class per image, or one next token per
position; targets of -100 are ignored) plus every MoE layer's aux_loss, whose configured weights
the layers already applied. The step's gradients are reduced over the processes, clipped, checked
(a non-finite loss or gradient stops the run or skips the step, as configured), applied, and the
routers' load biases are updated. Evaluation, logging and checkpoints run every N steps and at the end.

Resuming restores what the config does not say (weights, optimizer moments, data position, random
states, step); the settings come from the current config, and every one that differs from the
checkpoint's is logged. A checkpoint that is incomplete or fails its checksum is skipped, with one
line, for the newest intact one. SIGTERM (what job schedulers send before killing a job) ends the
run after the current step with a checkpoint; with several ranks, all stop at the same step.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import random
import signal
import threading
import time
from collections import defaultdict, deque
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from moetrain.config import (
    CompileMode, Device, FP8Wgrad, LoggerConfig, NonFinite, OptimConfig, ParamDtype, Precision, SettingError,
    TrainerConfig,
)
from moetrain.data import DataModule, unpack_batch
from moetrain.moe import (
    MoELayer, set_activation_checkpointing, set_parameter_dtype, set_training_precision, update_router_biases,
)
from moetrain.ops.linear_cross_entropy import IGNORE_INDEX  # targets that are not scored
from moetrain.precision.fp8_matmul import fp8_supported
from moetrain.timing import anatomy_markdown, idle_by_host_activity, profiled_kernels, profiled_spans, step_anatomy
from moetrain.train import checkpoint
from moetrain.train.metrics import TensorBoard, append_metrics, flatten, load_postfix, training_throughput
from moetrain.train.optim import build_scheduler, clip_factor, step_with_device_flags, takes_device_flags, to_host
from moetrain.train.processes import SingleProcess
from moetrain.train.stream import BatchStream

_PROFILED_STEPS = 3  # trainer.profile_at profiles this many steps
_RATE_KEYS = ("train/samples_per_sec", "train/tokens_per_sec", "train/mfu")  # what a window of timed steps logs
log = logging.getLogger(__name__)

EVAL_TAGS = ["eval/loss", "eval/accuracy"]


class NonFiniteLoss(RuntimeError):
    """The loss or the gradient norm of a step was NaN or infinite."""


class Terminated(RuntimeError):
    """SIGTERM stopped the run after `step`, whose checkpoint was then saved in `run_dir`."""

    exit_code = 128 + signal.SIGTERM  # 143: what a shell reports for a process ended by SIGTERM

    def __init__(self, step: int, run_dir: Path):
        super().__init__(step, run_dir)  # the arguments, so that it pickles (a worker's error reaches the launcher)
        self.step, self.run_dir = step, run_dir

    def __str__(self) -> str:
        return (f"stopped by SIGTERM at step {self.step} after saving its checkpoint; continue with "
                f"TrainerConfig.resume='auto' in {self.run_dir}")


class _StepRecord:
    """What the host learns of one optimizer step: its values (loss, aux loss, stop request, gradient
    norm, clipping factor) and routing counts, copied to the host without waiting for the GPU; read()
    waits for the copy (on the CPU there is nothing to wait for)."""

    def __init__(self, step: int, values: torch.Tensor, routing: dict[str, list], done: torch.cuda.Event | None = None):
        self.step, self.seconds, self.names = step, 0.0, list(routing)
        # done: a CUDA event recorded where the step's numbers are final, whose time the step's duration
        # ends at (Trainer._check); timed: whether the step counts in the window's rate (not profiled).
        self.done, self.timed = done, True
        sizes = [t.numel() for pair in routing.values() for t in pair]
        counts = torch.cat([t.reshape(-1) for pair in routing.values() for t in pair]) if sizes \
            else values.new_zeros(0, dtype=torch.int64)
        (self._values, self._counts), self._copied = to_host(values, counts)
        self._sizes, self.routing, self._read = sizes, {}, False
        self.loss = self.aux = self.grad_norm = self.clip = math.nan
        self.stop = self.finite = False

    def read(self) -> _StepRecord:
        """Wait for the copy once, then set loss, aux, grad_norm, clip, stop, finite and routing."""
        if self._read:
            return self
        self._read = True
        if self._copied is not None:
            self._copied.synchronize()
        self.loss, self.aux, stop, self.grad_norm, self.clip = self._values.tolist()
        self.stop, self.finite = stop > 0, all(math.isfinite(v) for v in (self.loss, self.aux, self.grad_norm))
        pieces = iter(torch.split(self._counts, self._sizes))
        self.routing = {name: [next(pieces), next(pieces)] for name in self.names}
        return self


class _Window:
    """The logged steps since the last log line."""

    def __init__(self):
        self.losses: list[float] = []
        self.aux: list[float] = []
        self.seconds = 0.0  # of the timed steps
        self.timed = self.untimed = 0  # steps in the rate, and steps left out of it (profiled)
        self.routing = defaultdict(lambda: [0, 0])  # layer -> [tokens per expert, kept per expert]


# Keys whose change on resume is no change to the run.
_UNCOMPARED = ("trainer.resume", "trainer.progress_bar")


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (every device) before the model is built."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(device: Device) -> torch.device:
    if device == Device.auto:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == Device.cuda and not torch.cuda.is_available():
        raise SettingError("device='cuda' but no CUDA GPU is visible: use device='auto' or device='cpu'")
    return torch.device(device.value)


def _compile_kwargs(mode: CompileMode | None, tuned_reductions: bool) -> dict:
    """torch.compile's keyword arguments: the mode by torch's name for it; with tuned reductions, the
    inductor options that mode stands for and triton.multi_kernel (torch.compile takes a mode or
    options, not both).

    Tuned reductions also turn off inductor's static Triton launcher: the kernels it keeps in the
    compile cache come back without the lock that reading a kernel's hash takes, which the tuned
    reductions' record of their pick reads, so a second run from a warm cache failed in compiling
    (torch 2.11). With CUDA graphs (reduce_overhead) the launcher's speed does not show."""
    if not tuned_reductions:
        return {} if mode is None else {"mode": mode.value}
    from torch._inductor import list_mode_options  # noqa: PLC0415 - inductor loads on first use

    return {"options": {**list_mode_options("default" if mode is None else mode.value), **_TUNED_REDUCTIONS}}


_TUNED_REDUCTIONS = {"triton.multi_kernel": 1, "use_static_cuda_launcher": False}


def task_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every scored position: logits [..., C], targets [...]."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX)


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        data: DataModule,
        trainer: TrainerConfig,
        optim: OptimConfig,
        logger: LoggerConfig,
        run_dir: Path,
        seed: int,
        run_config: dict,
        processes: SingleProcess | None = None,
    ):
        self.cfg, self.logger_cfg, self.data = trainer, logger, data
        self.run_dir, self.run_config = Path(run_dir), run_config
        self.processes = processes or SingleProcess()
        self.device = resolve_device(trainer.device)
        # auto, fp8 and fp8_block: bf16 autocast on CUDA; on the CPU fp32 (the FP8 expert GEMMs are
        # emulated there)
        fp8 = trainer.precision in (Precision.fp8, Precision.fp8_block)
        bf16 = trainer.precision == Precision.bf16 or ((fp8 or trainer.precision == Precision.auto)
                                                        and self.device.type == "cuda")
        if trainer.fp8_linears and trainer.precision != Precision.fp8:
            raise SettingError("TrainerConfig.fp8_linears=true applies only with TrainerConfig.precision='fp8' "
                               f"(row-wise scales), not with TrainerConfig.precision={trainer.precision.value!r}; "
                               "set TrainerConfig.precision='fp8' or TrainerConfig.fp8_linears=false")
        if fp8:
            supported, why = fp8_supported(self.device, trainer.precision.value)
            if not supported:
                raise SettingError(f"TrainerConfig.precision={trainer.precision.value!r} needs an sm90+ GPU or the "
                                   f"CPU, not {why}; use TrainerConfig.precision='bf16'")
            try:
                fp8_linears = set_training_precision(model, trainer.precision.value,
                                                     (trainer.fp8_wgrad or FP8Wgrad.bf16).value,
                                                     fp8_linears=trainer.fp8_linears)
            except ValueError as error:
                raise SettingError(str(error).replace("fp8_linears", "TrainerConfig.fp8_linears", 1)) from None
            if fp8_linears:
                log.info("trainer.fp8_linears: %d dense linears in FP8 (%s, ...)", len(fp8_linears), fp8_linears[0])
        elif trainer.fp8_wgrad is not None:
            raise SettingError(f"TrainerConfig.fp8_wgrad={trainer.fp8_wgrad.value!r} applies only with precision fp8 "
                               f"or fp8_block, not with TrainerConfig.precision={trainer.precision.value!r}; leave "
                               "fp8_wgrad null or set an FP8 precision")
        self.autocast = (
            (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if bf16 else nullcontext
        )
        self.model = model.to(self.device)
        if trainer.param_dtype == ParamDtype.bfloat16:
            # bf16 weights, fp32 masters in the optimizer: the forward casts no weight and the residual
            # stream is bf16 (routers stay fp32).
            set_parameter_dtype(self.model, torch.bfloat16)
        try:
            set_activation_checkpointing(self.model, trainer.activation_checkpointing.value)
        except ValueError as error:
            raise SettingError(f"TrainerConfig.activation_checkpointing: {error}") from None
        # Training and evaluation call the compiled wrapper; checkpoints read self.model, so their
        # keys stay the plain module's (no "_orig_mod." prefix).
        if trainer.compile and trainer.activation_checkpointing.value == "full":
            raise SettingError("TrainerConfig.activation_checkpointing='full' cannot be compiled (torch.compile does "
                               "not trace the routing replay of recomputed MoE blocks): use "
                               "TrainerConfig.activation_checkpointing='selective', or TrainerConfig.compile=False")
        if trainer.compile_mode is not None and not trainer.compile:
            raise SettingError(f"TrainerConfig.compile_mode={trainer.compile_mode.name!r} applies only with "
                               "TrainerConfig.compile=true; set compile=true, or leave compile_mode null")
        if trainer.compile_tuned_reductions and not trainer.compile:
            raise SettingError("TrainerConfig.compile_tuned_reductions=true applies only with "
                               "TrainerConfig.compile=true; set compile=true, or leave compile_tuned_reductions false")
        compile_kwargs = _compile_kwargs(trainer.compile_mode, trainer.compile_tuned_reductions)
        self.forward = torch.compile(self.model, **compile_kwargs) if trainer.compile else self.model
        # Compiled, the loss reads the 16-bit logits once and its backward recomputes the softmax
        # from them: no fp32 copy of the logits and of their log-softmax is kept (on moe_1b5's 32k
        # vocabulary, batch 16 x 2048: 8 GiB).
        self.loss = torch.compile(task_loss, **compile_kwargs) if trainer.compile else task_loss
        # The model's own fused head + loss (forward(..., targets=)) where it has one.
        self.fused_loss = (trainer.fused_loss and data.task == "language_modeling"
                           and "targets" in inspect.signature(self.model.forward).parameters)
        self.moe_layers = {name: m for name, m in self.model.named_modules() if isinstance(m, MoELayer)}
        self.optimizer = self.processes.build_optimizer(self.model, optim, seed)
        if trainer.async_checkpoint:
            self.processes.enable_async_checkpoints()
        self.scheduler = build_scheduler(self.optimizer, optim, trainer.max_steps)
        # The optimizer decides on the device whether to clip and whether to skip a step, so the host
        # need not wait for each step (_train_step). In one process only: the multi-process optimizers
        # decide on the host.
        self.device_flags = isinstance(self.processes, SingleProcess) and takes_device_flags(self.optimizer)
        self.pending: _StepRecord | None = None  # a queued step whose numbers the host has not read
        # On a GPU, the event the next step read is timed from (_check): the last read step's end, or
        # where training resumed after a pause; None outside fit() and after a pause.
        self._since: torch.cuda.Event | None = None
        self.recent_seconds: deque[float] = deque(maxlen=3)
        # What fit() logs to (set by _train): the steps since the last log line, the bar, TensorBoard.
        self.window, self.bar, self.board = _Window(), None, None
        pin = self.device.type == "cuda"
        self.stream = BatchStream(data.train_set, data.batch_size, data.num_workers, seed, pin_memory=pin,
                                  rank=self.processes.rank, world_size=self.processes.world_size)
        self.eval_loader = DataLoader(
            data.eval_set,
            batch_size=data.eval_batch_size,
            num_workers=data.num_workers,
            pin_memory=pin,
            generator=torch.Generator(),  # leaves torch's global generator untouched (see stream.py)
        )
        self.step = 0
        self.skipped_steps = 0
        self.metrics: dict = {}  # the latest logged and evaluated metrics
        self.stop_requested = False  # set by SIGTERM
        self.stopping = False  # every rank saw a stop request: save and stop after this step

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "data": self.stream.state_dict(),
            "rng": checkpoint.rng_state(),
            "config": self.run_config,
            "metrics": dict(self.metrics),  # at the last step: the final metrics, should metrics.json be lost
        }

    def load_state_dict(self, state: dict) -> None:
        """Everything the config does not set. The optimizer's hyperparameters (lr, weight decay,
        betas, ...) stay those of this run's config: only its moments come from the checkpoint."""
        self.model.load_state_dict(state["model"])
        settings = [{key: value for key, value in group.items() if key != "params"}
                    for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        for group, own in zip(self.optimizer.param_groups, settings):
            group.update(own)
        self.stream.load_state_dict(state["data"])
        checkpoint.set_rng_state(state["rng"])
        self.step, self.skipped_steps = state["step"], state["skipped_steps"]
        self.metrics = dict(state.get("metrics", {}))
        self.scheduler.set_step(self.step)

    def save_checkpoint(self) -> None:
        path = self.processes.save_checkpoint(self.state_dict(), self.run_dir, self.step, self.cfg.keep_checkpoints)
        log.info("step %d: checkpoint %s", self.step, path)

    def _ranks_where(self, flag: bool) -> list[int]:
        """The ranks on which `flag` holds (one all-reduce; the same answer on every rank)."""
        flags = torch.zeros(self.processes.world_size, device=self.device)
        flags[self.processes.rank] = float(flag)
        return (self.processes.mean_over_ranks(flags) > 0).nonzero().flatten().tolist()

    def _load_resume_checkpoint(self) -> tuple[Path, dict] | None:
        """The newest intact checkpoint trainer.resume names, checked against this run's model config.
        An incomplete or corrupted one is skipped with one line; every rank takes the same one."""
        paths = checkpoint.candidates(self.cfg.resume, self.run_dir)
        if not paths:
            return None
        problems = []
        for path in paths:
            state, problem, refused = None, None, False
            try:
                checkpoint.check_complete(path)
                state = self.processes.load_checkpoint(path)  # checks this rank's file against its sha256
            except checkpoint.CheckpointError as error:
                problem, refused = str(error), isinstance(error, checkpoint.UnsafeCheckpointError)
            failed = self._ranks_where(problem is not None)
            if not failed:
                break
            refusing = self._ranks_where(refused)
            if refusing:  # objects that would run code: refused, not skipped for an older checkpoint
                raise checkpoint.UnsafeCheckpointError(
                    f"TrainerConfig.resume={self.cfg.resume!r}: "
                    + (problem if refused else f"the file of rank {refusing[0]} holds objects that are not data"))
            problem = problem or f"the file of rank {', '.join(map(str, failed))} failed its check"
            if len(paths) == 1:  # the checkpoint the user named: nothing to fall back to
                raise checkpoint.CheckpointError(f"TrainerConfig.resume={self.cfg.resume!r}: {problem}")
            if self.processes.is_main:
                log.warning("TrainerConfig.resume: skipping %s: %s", path.name, problem)
            problems.append(path.name)
        else:
            raise checkpoint.CheckpointError(
                f"TrainerConfig.resume={self.cfg.resume!r}: no intact checkpoint in {paths[0].parent}: "
                f"{', '.join(problems)} {'is' if len(problems) == 1 else 'are'} incomplete or corrupted (each reason "
                "is logged above); resume from a copy you trust with TrainerConfig.resume=PATH, or start over in a new "
                "run directory"
            )
        if state["config"].get("model") != self.run_config.get("model"):
            raise checkpoint.CheckpointError(
                f"TrainerConfig.resume: {path} holds a different model config than this run: "
                "resume with the model settings of the run that wrote it"
            )
        return path, state

    def _log_changed_settings(self, saved_config: dict) -> None:
        """One line per setting this run changes from the checkpoint's run: these settings apply now."""
        before, now = flatten(saved_config), flatten(self.run_config)
        for key in sorted(before.keys() | now.keys()):
            if key not in _UNCOMPARED and before.get(key) != now.get(key):
                log.info("%s: %s (checkpoint) -> %s (now)", key, before.get(key, "unset"), now.get(key, "unset"))

    def _resume(self) -> None:
        found = self._load_resume_checkpoint()
        if found is None:
            log.info("TrainerConfig.resume='auto': no checkpoint in %s yet, starting from step 0", self.run_dir)
            return
        path, state = found
        saved_lr = state["optimizer"]["param_groups"][0].get("lr")
        self.load_state_dict(state)
        log.info("resumed from %s at step %d", path, self.step)
        if self.processes.is_main:
            self._log_changed_settings(state["config"])
            lr = self.optimizer.param_groups[0]["lr"]
            if saved_lr is not None and lr != saved_lr:
                log.info("learning rate of step %d: %.6g (checkpoint) -> %.6g (now, from OptimConfig and "
                         "TrainerConfig.max_steps=%d)", self.step + 1, saved_lr, lr, self.cfg.max_steps)

    def load_model(self) -> Path:
        """Only the model weights of trainer.resume's checkpoint (for evaluation); returns its path."""
        found = self._load_resume_checkpoint()
        if found is None:
            raise SettingError(f"TrainerConfig.resume={self.cfg.resume!r}: no checkpoint in {self.run_dir}: "
                               "pass TrainerConfig.resume=RUN_DIR (a run directory or checkpoint file)")
        path, state = found
        self.model.load_state_dict(state["model"])
        self.step = state["step"]
        return path

    def _finished_metrics(self) -> dict:
        """A resumed run that has already reached trainer.max_steps: its final metrics, kept as they are."""
        path = self.run_dir / "metrics.json"
        if path.is_file():
            written = json.loads(path.read_text())
            if written.get("step") == self.step:
                return written
        # Resumed into a new run directory (or metrics.json was lost): the checkpoint's final metrics.
        metrics = {**self.metrics, "step": self.step, "skipped_steps": self.skipped_steps}
        if self.processes.is_main:
            path.write_text(json.dumps(metrics, indent=2) + "\n")
        return metrics

    def _on_sigterm(self, signum, frame) -> None:
        # Only a flag: the step in progress finishes, then every rank agrees to stop (_train_step).
        self.stop_requested = True

    # ---- evaluation --------------------------------------------------------------------------
    def _eval_batches(self) -> int | None:
        """How many batches evaluate() reads (None when the loader cannot tell its length)."""
        try:
            total = len(self.eval_loader)
        except TypeError:
            return self.cfg.eval_batches or None
        return min(total, self.cfg.eval_batches) if self.cfg.eval_batches else total

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.model.eval()
        loss_sum, correct, count = 0.0, 0, 0
        # A bar of its own, so the run's display moves while it evaluates (it is removed when done).
        bar = tqdm(total=self._eval_batches(), desc="eval", unit="batch", leave=False, dynamic_ncols=True,
                   disable=not (self.cfg.progress_bar and self.processes.is_main))
        for index, batch in enumerate(self.eval_loader):
            if self.cfg.eval_batches and index == self.cfg.eval_batches:
                break
            bar.update(1)
            inputs, targets, arguments = unpack_batch(batch, self.device)
            with self.autocast():
                logits = self.forward(inputs, **arguments)
            scored = targets != IGNORE_INDEX
            n = int(scored.sum())
            loss_sum += float(task_loss(logits, targets)) * n
            correct += int((logits.argmax(dim=-1) == targets)[scored].sum())
            count += n
        bar.close()
        self.model.train()
        metrics = {"eval/loss": loss_sum / count, "eval/accuracy": correct / count}
        if self.data.task == "language_modeling":
            metrics["eval/perplexity"] = math.exp(min(metrics["eval/loss"], 50.0))
        return metrics

    # ---- training ----------------------------------------------------------------------------
    def _train_step(self) -> _StepRecord:
        """Queue one optimizer step over grad_accum_steps micro-batches; returns its record.

        Where the optimizer takes its decisions on the device (self.device_flags: MasterWeightAdamW
        or one of torch's fused optimizers, in one process), the host does not wait for the step: the
        clipping factor and the skip of a non-finite step are tensors the optimizer's kernels read, and
        the step's numbers (loss, gradient norm, routing counts, the stop request) travel to the host
        while the GPU runs on. The host reads them one step later (_settle, before that step's update,
        so a non-finite step stops the run before anything else changes), or at once where it needs them
        (evaluation, checkpoints, the last step, a stop). The GPU then never waits for the host between
        steps. Elsewhere the host waits for every step's numbers, then clips and updates."""
        accum = self.cfg.grad_accum_steps
        loss_total = torch.zeros((), device=self.device)
        aux_total = torch.zeros((), device=self.device)
        routing: dict[str, list] = {}
        for _ in range(accum):
            inputs, targets, arguments = unpack_batch(next(self.stream), self.device, non_blocking=True)
            with self.autocast():
                if self.fused_loss:
                    loss = self.forward(inputs, targets=targets, **arguments)
                else:
                    loss = self.loss(self.forward(inputs, **arguments), targets)
                aux = sum((layer.aux_loss for layer in self.moe_layers.values()), torch.zeros((), device=self.device))
            ((loss + aux) / accum).backward()
            loss_total += loss.detach()
            aux_total += aux.detach()
            for name, layer in self.moe_layers.items():
                counts = routing.setdefault(name, [0, 0])
                counts[0] = counts[0] + layer.stats.tokens_per_expert
                counts[1] = counts[1] + layer.stats.kept_per_expert
        self.processes.reduce_gradients(self.model)
        grad_norm = self.processes.clip_grad_norm_(self.model, math.inf)  # measured; scaled below if need be
        max_norm = self.cfg.grad_clip
        clip = clip_factor(max_norm, grad_norm) if max_norm else torch.ones_like(grad_norm)
        # The losses are averaged over ranks, so every rank logs and decides alike; a stop request
        # (SIGTERM) rides along, so that all ranks stop after the same step when any of them got one.
        # (torch.full, not torch.tensor: a copy from the host would wait for the GPU to catch up)
        stop = torch.full((), float(self.stop_requested), device=self.device)
        reduced = self.processes.mean_over_ranks(torch.stack([loss_total / accum, aux_total / accum, stop]))
        values = torch.cat([reduced, grad_norm.reshape(1).to(reduced), clip.reshape(1).to(reduced)])
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        record = _StepRecord(self.step, values, routing, done)
        if self.device_flags:
            skip = ~(torch.isfinite(values[:2]).all() & torch.isfinite(values[3]))  # loss, aux loss, gradient norm
            self._settle()  # the step before this one, whose numbers have reached the host by now
            step_with_device_flags(self.optimizer, skip, clip if max_norm else None)
            update_router_biases(self.model, skip)
            self.pending = record
        else:
            self._check(record)  # waits for this step's numbers
            if record.finite:
                # Clipping waits for them too: a step whose norm is under the limit skips the pass
                # over every gradient that multiplying by 1 would be.
                if record.clip < 1.0:
                    self.processes.clip_grads_with_norm_(self.model, max_norm, grad_norm)
                self.optimizer.step()
                update_router_biases(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return record

    def _check(self, record: _StepRecord) -> None:
        """Act on a step's numbers: stop or count a non-finite step, note a stop request. On a GPU, also
        time the step: from the previous step's end, or from where training resumed after a pause, to
        its own end, both as the GPU reached them (the host runs ahead of the GPU, so its own clock
        would give a step the GPU work queued before it, or lose the work a pause let drain)."""
        record.read()
        if record.done is not None and self._since is not None:
            record.done.synchronize()
            record.seconds = self._since.elapsed_time(record.done) / 1e3
            self._since = record.done
        self.stopping = self.stopping or record.stop
        if record.finite:
            return
        loss, aux, norm = record.loss, record.aux, record.grad_norm
        if self.cfg.on_nonfinite == NonFinite.stop:
            raise NonFiniteLoss(
                f"non-finite {'loss' if not math.isfinite(loss + aux) else 'gradient norm'} at step "
                f"{record.step} (loss {loss}, aux loss {aux}, grad norm {norm}): lower OptimConfig.lr, "
                "raise OptimConfig.warmup_steps, or set TrainerConfig.on_nonfinite='skip'"
            )
        self.skipped_steps += 1
        log.warning("step %d: non-finite loss or gradient, update skipped (%d so far)", record.step, self.skipped_steps)

    def _settle(self) -> None:
        """Read, check and log the step whose numbers the host has not read yet, if any."""
        record, self.pending = self.pending, None
        if record is not None:
            self._check(record)
            self._log(record)

    def _log(self, record: _StepRecord) -> None:
        """Add a read step to the logging window; at a logging step, write the window's metrics."""
        window = self.window
        if record.timed:
            window.seconds += record.seconds
            window.timed += 1
            if record.step < self.cfg.profile_at:
                self.recent_seconds.append(record.seconds)
        else:
            window.untimed += 1
        if record.finite:  # a skipped step's loss would turn the average into NaN
            window.losses.append(record.loss)
            window.aux.append(record.aux)
        for name, (tokens_E, kept_E) in record.routing.items():
            counts = window.routing[name]
            counts[0] = counts[0] + tokens_E
            counts[1] = counts[1] + kept_E
        if self.bar is not None:
            self.bar.update(1)
        step = record.step
        # A stop is logged at the step the run stops after (the last one the host has read).
        stops_here = self.stopping and step == self.step
        if not ((step % self.logger_cfg.log_every == 0 or step == self.cfg.max_steps or stops_here)
                and window.losses and (window.seconds > 0 or window.untimed)):  # (steps outside fit(): no time)
            return
        metrics = self.metrics
        samples_per_step = self.data.batch_size * self.cfg.grad_accum_steps * self.processes.world_size
        metrics.update({
            "train/loss": sum(window.losses) / len(window.losses),
            "train/aux_loss": sum(window.aux) / len(window.aux),
            "train/lr": self.optimizer.param_groups[0]["lr"],
            "train/grad_norm": record.grad_norm,
        })
        for key in _RATE_KEYS:  # a window of profiled steps only has no rate: none, rather than the last one's
            metrics.pop(key, None)
        rate = {}
        if window.seconds > 0:  # the rate of the window's timed steps
            metrics["train/samples_per_sec"] = samples_per_step * window.timed / window.seconds
            rate = {"samples_s": f"{metrics['train/samples_per_sec']:.0f}"}
            seq_len = self.data.model_inputs.get("max_seq_len")
            if self.data.task == "language_modeling" and seq_len:  # tokens/s, and MFU on a GPU of known peak
                throughput = training_throughput(
                    self.model, metrics["train/samples_per_sec"], seq_len, self.device, self.processes.world_size
                )
                metrics.update({f"train/{key}": value for key, value in throughput.items()})
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", **rate, **load_postfix(window.routing))
        if self.processes.is_main:
            append_metrics(self.run_dir, step, metrics, "train/")
        if self.board is not None:
            self.board.scalars({k: v for k, v in metrics.items() if k.startswith("train/")}, step)
            self.board.scalars({"train/skipped_steps": self.skipped_steps}, step)
            for name, (tokens_E, kept_E) in window.routing.items():
                self.board.routing(name, tokens_E, kept_E, step)
        self.window = _Window()

    def _start_profiler(self) -> torch.profiler.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        profiler.start()
        return profiler

    def _write_anatomy(self, profiler: torch.profiler.profile, steps: int, unprofiled_seconds: list[float]) -> None:
        """Where the profiled steps' time went, by part of the step (moetrain.timing.step_anatomy), into
        <run dir>/anatomy.md and the log. The wall time of a step is that of the steps just before
        the profiled ones (the profiler's own host work stretches those it records)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        profiler.stop()
        if not self.processes.is_main:
            return
        first = self.step - steps + 1
        if self.device.type != "cuda":
            table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            text = f"# Steps {first}-{self.step}: host operators (no GPU)\n\n```\n{table}\n```\n"
        else:
            wall_ms = 1e3 * sum(unprofiled_seconds) / len(unprofiled_seconds) if unprofiled_seconds else float("nan")
            vocab_size = self.data.model_inputs.get("vocab_size")
            tokens = self.data.batch_size * (self.data.model_inputs.get("max_seq_len") or 0)
            anatomy = step_anatomy(profiled_kernels(profiler), steps, wall_ms, vocab_size, tokens)
            anatomy["idle_by_host"] = idle_by_host_activity(*profiled_spans(profiler), steps)
            text = (f"# Steps {first}-{self.step} on {torch.cuda.get_device_name(self.device)}: GPU time per part\n\n"
                    f"Wall time of a step: the mean of the {len(unprofiled_seconds)} steps before step {first}; "
                    "idle: that wall time minus the GPU's busy time.\n\n" + anatomy_markdown(anatomy) + "\n")
        (self.run_dir / "anatomy.md").write_text(text)
        log.info("step %d: profile of steps %d-%d written to %s", self.step, first, self.step, self.run_dir / "anatomy.md")

    def fit(self) -> dict:
        """Train to trainer.max_steps; returns the final metrics (also written to metrics.json).
        Raises Terminated after saving a checkpoint when SIGTERM arrives before the last step."""
        # While training, SIGTERM only sets a flag (handlers can be set in the main thread only).
        previous_handler = None
        if threading.current_thread() is threading.main_thread():
            previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            return self._fit()
        finally:
            if previous_handler is not None:
                signal.signal(signal.SIGTERM, previous_handler)

    def _fit(self) -> dict:
        cfg = self.cfg
        if cfg.resume:
            self._resume()
            if self.step > cfg.max_steps:
                raise SettingError(
                    f"TrainerConfig.resume: the checkpoint is at step {self.step}, past TrainerConfig.max_steps="
                    f"{cfg.max_steps}: raise TrainerConfig.max_steps to train on, or only evaluate it"
                )
            if self.step == cfg.max_steps:
                log.info("the run is already complete at step %d (TrainerConfig.max_steps=%d): nothing to train, "
                         "metrics.json kept; raise TrainerConfig.max_steps to train on", self.step, cfg.max_steps)
                return self._finished_metrics()
        board = TensorBoard(self.run_dir) if self.logger_cfg.tensorboard and self.processes.is_main else None
        bar = tqdm(
            total=cfg.max_steps,
            initial=self.step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not (cfg.progress_bar and self.processes.is_main),
        )
        try:
            self._train(board, bar)
        except Terminated:
            self.processes.finish_checkpoints()  # the checkpoint SIGTERM asked for must be complete
            raise
        finally:
            bar.close()
            if board is not None:
                board.close()
        self.processes.finish_checkpoints()
        metrics = {**self.metrics, "step": self.step, "skipped_steps": self.skipped_steps}
        if self.processes.is_main:
            (self.run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        return metrics

    def _train(self, board: TensorBoard | None, bar: tqdm) -> None:
        cfg = self.cfg
        if board is not None and self.step == 0:
            board.hparams(self.run_config, EVAL_TAGS)
        self.board, self.bar, self.window, self.pending = board, bar, _Window(), None
        metrics = self.metrics
        profiler, self._since = None, None
        self.recent_seconds = deque(maxlen=3)  # trainer.profile_at: the steps before it set the wall time
        self.model.train()
        while self.step < cfg.max_steps:
            self.step += 1
            if self.step == cfg.profile_at:
                profiler = self._start_profiler()
            if self.device.type == "cuda" and self._since is None:  # (re)starting: time from where the GPU is
                self._since = torch.cuda.Event(enable_timing=True)
                self._since.record()
            started = time.perf_counter()
            record = self._train_step()
            if record.done is None:  # on the CPU the host's clock is the step's: nothing runs ahead
                record.seconds = time.perf_counter() - started
            record.timed = profiler is None  # the profiler's own work stretches the steps it records
            if profiler is not None and (self.step == cfg.profile_at + _PROFILED_STEPS - 1 or self.step == cfg.max_steps):
                self._settle()  # the steps before the pause are timed up to here
                self._write_anatomy(profiler, self.step - cfg.profile_at + 1, list(self.recent_seconds))
                self._since, profiler = None, None
            last = self.step == cfg.max_steps
            evaluates = bool(cfg.eval_every and self.step % cfg.eval_every == 0) or last
            saves = bool(cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or last
            if not self.device_flags:
                self._log(record)  # read already
            elif evaluates or saves or self.stopping:
                self._settle()  # the host needs this step's outcome now
            if self.stopping and not last:  # SIGTERM: the grace period is short, so no evaluation first
                self.save_checkpoint()
                log.info("SIGTERM: stopped after step %d, whose checkpoint is saved", self.step)
                raise Terminated(self.step, self.run_dir)
            if evaluates:
                metrics.update(self.evaluate())
                bar.unpause()  # the evaluation's time is not training time: keep it out of the bar's rate and ETA
                log.info(
                    "step %d: eval loss %.4f, accuracy %.4f", self.step, metrics["eval/loss"], metrics["eval/accuracy"]
                )
                if board is not None:
                    board.scalars({k: v for k, v in metrics.items() if k.startswith("eval/")}, self.step)
                if self.processes.is_main:
                    append_metrics(self.run_dir, self.step, metrics, "eval/")
            if saves:
                self.save_checkpoint()
            if evaluates or saves:  # a pause: the next step is timed from where the GPU resumes
                self._since = None
