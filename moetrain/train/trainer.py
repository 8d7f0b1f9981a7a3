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
    Device, FP8Wgrad, LoggerConfig, NonFinite, OptimConfig, ParamDtype, Precision, SettingError, TrainerConfig,
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
from moetrain.train.optim import build_scheduler, clip_factor
from moetrain.train.processes import SingleProcess
from moetrain.train.stream import BatchStream

_PROFILED_STEPS = 3  # trainer.profile_at profiles this many steps
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
        compile_kwargs = {} if trainer.compile_mode is None else {"mode": trainer.compile_mode.value}
        self.forward = torch.compile(self.model, **compile_kwargs) if trainer.compile else self.model
        # Compiled, the loss reads the 16-bit logits once and its backward recomputes the softmax
        # from them: no fp32 copy of the logits and of their log-softmax is kept (on moe_1b5's 32k
        # vocabulary, batch 16 x 2048: 8 GiB).
        self.loss = torch.compile(task_loss, **compile_kwargs) if trainer.compile else task_loss
        # The model's own fused head + loss (forward(..., targets=)) where it has one.
        self.fused_loss = (trainer.fused_loss and data.task == "language_modeling"
                           and "targets" in inspect.signature(self.model.forward).parameters)
        self.moe_layers = {name: m for name, m in self.model.named_modules() if isinstance(m, MoELayer)}
        self.optimizer = self.processes.build_optimizer(self.model, optim)
        if trainer.async_checkpoint:
            self.processes.enable_async_checkpoints()
        self.scheduler = build_scheduler(self.optimizer, optim, trainer.max_steps)
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
    def _train_step(self, routing: dict) -> tuple[float, float, float]:
        """One optimizer step over grad_accum_steps micro-batches -> (loss, aux loss, grad norm)."""
        accum = self.cfg.grad_accum_steps
        loss_total = torch.zeros((), device=self.device)
        aux_total = torch.zeros((), device=self.device)
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
                routing[name][0] += layer.stats.tokens_per_expert
                routing[name][1] += layer.stats.kept_per_expert
        self.processes.reduce_gradients(self.model)
        grad_norm = self.processes.clip_grad_norm_(self.model, math.inf)  # measured; scaled below if need be
        max_norm = self.cfg.grad_clip
        clip = clip_factor(max_norm, grad_norm) if max_norm else torch.ones_like(grad_norm)
        # One host sync per step: the update must not happen when anything is non-finite. The losses
        # are averaged over ranks, so every rank logs and decides alike; a stop request (SIGTERM)
        # rides along, so that all ranks stop after the same step when any of them got one.
        stop = torch.tensor(float(self.stop_requested), device=self.device)
        reduced = self.processes.mean_over_ranks(torch.stack([loss_total / accum, aux_total / accum, stop]))
        loss_value, aux_value, stop_value, norm_value, clip_value = torch.cat(
            [reduced, grad_norm.reshape(1).to(reduced), clip.reshape(1).to(reduced)]).tolist()
        self.stopping = stop_value > 0
        if all(math.isfinite(v) for v in (loss_value, aux_value, norm_value)):
            # Clipping waits for the sync: a step whose norm is under the limit skips the pass over
            # every gradient that multiplying by 1 would be.
            if clip_value < 1.0:
                self.processes.clip_grads_with_norm_(self.model, max_norm, grad_norm)
            self.optimizer.step()
            update_router_biases(self.model)
        elif self.cfg.on_nonfinite == NonFinite.stop:
            raise NonFiniteLoss(
                f"non-finite {'loss' if not math.isfinite(loss_value + aux_value) else 'gradient norm'} at step "
                f"{self.step} (loss {loss_value}, aux loss {aux_value}, grad norm {norm_value}): lower OptimConfig.lr, "
                "raise OptimConfig.warmup_steps, or set TrainerConfig.on_nonfinite='skip'"
            )
        else:
            self.skipped_steps += 1
            log.warning("step %d: non-finite loss or gradient, update skipped (%d so far)", self.step, self.skipped_steps)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss_value, aux_value, norm_value

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
        samples_per_step = self.data.batch_size * cfg.grad_accum_steps * self.processes.world_size
        metrics = self.metrics
        routing = defaultdict(lambda: [0, 0])  # layer -> [tokens per expert, kept per expert] since the last log
        window_losses, window_aux, window_seconds = [], [], 0.0
        profiler, recent_seconds = None, deque(maxlen=3)  # trainer.profile_at: the steps before it set the wall time
        self.model.train()
        while self.step < cfg.max_steps:
            self.step += 1
            if self.step == cfg.profile_at:
                profiler = self._start_profiler()
            started = time.perf_counter()
            loss, aux, grad_norm = self._train_step(routing)
            seconds = time.perf_counter() - started
            window_seconds += seconds
            if profiler is None:
                recent_seconds.append(seconds)
            elif self.step == cfg.profile_at + _PROFILED_STEPS - 1 or self.step == cfg.max_steps:
                self._write_anatomy(profiler, self.step - cfg.profile_at + 1, list(recent_seconds))
                profiler = None
            if math.isfinite(loss + aux):  # a skipped step's loss would turn the average into NaN
                window_losses.append(loss)
                window_aux.append(aux)
            bar.update(1)
            last = self.step == cfg.max_steps
            if (self.step % self.logger_cfg.log_every == 0 or last or self.stopping) and window_losses:
                metrics.update({
                    "train/loss": sum(window_losses) / len(window_losses),
                    "train/aux_loss": sum(window_aux) / len(window_aux),
                    "train/lr": self.optimizer.param_groups[0]["lr"],
                    "train/grad_norm": grad_norm,
                    "train/samples_per_sec": samples_per_step * len(window_losses) / window_seconds,
                })
                seq_len = self.data.model_inputs.get("max_seq_len")
                if self.data.task == "language_modeling" and seq_len:  # tokens/s, and MFU on a GPU of known peak
                    throughput = training_throughput(
                        self.model, metrics["train/samples_per_sec"], seq_len, self.device, self.processes.world_size
                    )
                    metrics.update({f"train/{key}": value for key, value in throughput.items()})
                bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", samples_s=f"{metrics['train/samples_per_sec']:.0f}",
                                **load_postfix(routing))
                if self.processes.is_main:
                    append_metrics(self.run_dir, self.step, metrics, "train/")
                if board is not None:
                    board.scalars({k: v for k, v in metrics.items() if k.startswith("train/")}, self.step)
                    board.scalars({"train/skipped_steps": self.skipped_steps}, self.step)
                    for name, (tokens_E, kept_E) in routing.items():
                        board.routing(name, tokens_E, kept_E, self.step)
                routing.clear()
                window_losses, window_aux, window_seconds = [], [], 0.0
            if self.stopping and not last:  # SIGTERM: the grace period is short, so no evaluation first
                self.save_checkpoint()
                log.info("SIGTERM: stopped after step %d, whose checkpoint is saved", self.step)
                raise Terminated(self.step, self.run_dir)
            if (cfg.eval_every and self.step % cfg.eval_every == 0) or last:
                metrics.update(self.evaluate())
                bar.unpause()  # the evaluation's time is not training time: keep it out of the bar's rate and ETA
                log.info(
                    "step %d: eval loss %.4f, accuracy %.4f", self.step, metrics["eval/loss"], metrics["eval/accuracy"]
                )
                if board is not None:
                    board.scalars({k: v for k, v in metrics.items() if k.startswith("eval/")}, self.step)
                if self.processes.is_main:
                    append_metrics(self.run_dir, self.step, metrics, "eval/")
            if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or last:
                self.save_checkpoint()
