"""What a run records: TensorBoard output (scalars, per-layer routing, the hyperparameters) and
metrics.jsonl, one JSON line per logged step.

metrics.jsonl (in the run directory) gets a line each time the trainer logs training metrics and
each time it evaluates: {"step": N, "time": unix seconds, "train/loss": ..., ...} or {"step": N,
"time": ..., "eval/loss": ...}; a non-finite value is written as null (JSON has no NaN). Lines are
only appended, so a resumed run continues the file; steps between its checkpoint and the stop are
then logged twice, and the later line is the one of the weights that were kept. The correction
("later line wins") is the reader's: read_metrics returns every line as written.

Expert load, per MoE layer, from the routing choices counted since the previous log:
  moe/<layer>/tokens_per_expert   histogram over expert ids (bar e = choices that went to expert e)
  moe/<layer>/expert_load         image: experts (rows, expert 0 at the top) x logged steps
                                  (columns, oldest on the left), each cell coloured by the fraction
                                  of the layer's routing choices the expert received: LOAD_COLORS
                                  from 0 (dark purple) through 1/E, the uniform load (teal), to 2/E
                                  and more (yellow); one image per log, the latest holds them all
  moe/<layer>/imbalance           max / mean load over the experts (1 = uniform, E = one expert takes all)
  moe/<layer>/dropped_fraction    fraction of the choices that found no slot under the capacity limit
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from moetrain.timing import peak_bf16_flops
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams


def flatten(config: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}, with values TensorBoard's hparams accept (others as text)."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, prefix=f"{name}."))
        else:
            flat[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return flat


METRICS_FILE = "metrics.jsonl"


def append_metrics(run_dir: Path, step: int, metrics: dict, prefix: str = "") -> None:
    """Append one line to run_dir/metrics.jsonl: the step, the time and every metric whose name
    starts with `prefix` (non-finite values as null)."""
    line = {"step": int(step), "time": round(time.time(), 3)}
    for key, value in metrics.items():
        if key.startswith(prefix):
            value = float(value)
            line[key] = value if math.isfinite(value) else None
    Path(run_dir).mkdir(parents=True, exist_ok=True)  # as the TensorBoard writer and checkpoints make it
    with open(Path(run_dir) / METRICS_FILE, "a") as file:
        file.write(json.dumps(line) + "\n")


def read_metrics(run_dir: Path) -> list[dict]:
    """Every line of run_dir/metrics.jsonl, in the order written ([] when there is none yet)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- expert load ---------------------------------------------------------------------------------
def load_fractions(tokens_per_expert_E: torch.Tensor) -> np.ndarray:
    """Each expert's fraction of the layer's routing choices (zeros when there were none)."""
    counts_E = np.asarray(torch.as_tensor(tokens_per_expert_E).detach().cpu(), dtype=np.float64)
    total = counts_E.sum()
    return counts_E / total if total > 0 else np.zeros_like(counts_E)


def imbalance(tokens_per_expert_E: torch.Tensor) -> float:
    """Max / mean load over the experts: 1 for a uniform load, E when one expert takes every choice
    (nan when there were no choices)."""
    counts_E = np.asarray(torch.as_tensor(tokens_per_expert_E).detach().cpu(), dtype=np.float64)
    mean = counts_E.mean() if counts_E.size else 0.0
    return float(counts_E.max() / mean) if mean > 0 else math.nan


def worst_imbalance(routing: dict) -> tuple[str, float] | None:
    """(layer, imbalance) of the most imbalanced layer; routing maps layer -> tokens per expert [E]
    (or a (tokens, kept) pair, the trainer's routing record). None without any routed tokens."""
    worst = None
    for layer, counts in routing.items():
        value = imbalance(counts[0] if isinstance(counts, (tuple, list)) else counts)
        if not math.isnan(value) and (worst is None or value > worst[1]):
            worst = (layer, value)
    return worst


def load_postfix(routing: dict) -> dict:
    """The progress bar's postfix entry for the worst layer's imbalance, e.g. {"max_load": "1.84
    blocks.2.ffn"} ({} without routed tokens)."""
    worst = worst_imbalance(routing)
    return {} if worst is None else {"max_load": f"{worst[1]:.2f} {worst[0]}"}


# Published viridis colours at 0, 1/4, 1/2, 3/4 and 1 (perceptually uniform, readable in grey and
# by colour-blind readers); values in between are interpolated linearly per channel.
LOAD_COLORS = np.array([
    [0.267004, 0.004874, 0.329415],
    [0.229739, 0.322361, 0.545706],
    [0.127568, 0.566949, 0.550556],
    [0.369214, 0.788888, 0.382914],
    [0.993248, 0.906157, 0.143936],
])
LOAD_IMAGE_HEIGHT = 256  # pixels the experts share (each at least 1, at most 16)
LOAD_IMAGE_WIDTH = 512  # pixels the logged steps share; more steps than this are averaged in groups


def load_heat_map(fractions_SE: np.ndarray) -> np.ndarray:
    """An RGB uint8 image [H, W, 3] of experts (rows) x steps (columns) from fractions [S, E]: each
    cell coloured by fraction * E / 2 clipped to [0, 1] on LOAD_COLORS (uniform load = the middle).
    More than LOAD_IMAGE_WIDTH steps are averaged in consecutive groups, so the whole run fits."""
    fractions_SE = np.asarray(fractions_SE, dtype=np.float64)
    steps, experts = fractions_SE.shape
    if steps > LOAD_IMAGE_WIDTH:
        groups = np.array_split(np.arange(steps), LOAD_IMAGE_WIDTH)
        fractions_SE = np.stack([fractions_SE[group].mean(axis=0) for group in groups])
        steps = LOAD_IMAGE_WIDTH
    scaled_ES = np.clip(fractions_SE.T * experts / 2.0, 0.0, 1.0)
    anchors = np.linspace(0.0, 1.0, len(LOAD_COLORS))
    rgb_ES3 = np.stack([np.interp(scaled_ES, anchors, LOAD_COLORS[:, channel]) for channel in range(3)], axis=-1)
    cell_height = min(max(LOAD_IMAGE_HEIGHT // experts, 1), 16)
    cell_width = min(max(LOAD_IMAGE_WIDTH // steps, 1), 16)
    image = np.repeat(np.repeat(rgb_ES3, cell_height, axis=0), cell_width, axis=1)
    return np.round(image * 255).astype(np.uint8)


class TensorBoard:
    def __init__(self, log_dir: Path):
        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.load_history: dict[str, list[np.ndarray]] = {}  # layer -> fractions [E] per logged step

    def scalars(self, values: dict, step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def routing(self, layer: str, tokens_per_expert_E: torch.Tensor, kept_per_expert_E: torch.Tensor, step: int) -> None:
        """One logged step of a layer's routing (counts since the previous log): the histogram over
        expert ids, the dropped fraction, the imbalance, and the heat map of every step logged by
        this writer so far (a resumed run's map starts at its resume)."""
        counts_E = tokens_per_expert_E.double().cpu()
        expert_ids_E = torch.arange(counts_E.numel(), dtype=torch.float64)
        total = float(counts_E.sum())
        self.writer.add_histogram_raw(
            f"moe/{layer}/tokens_per_expert",
            min=0.0,
            max=float(counts_E.numel() - 1),
            num=total,
            sum=float((expert_ids_E * counts_E).sum()),
            sum_squares=float((expert_ids_E**2 * counts_E).sum()),
            bucket_limits=(expert_ids_E + 0.5).tolist(),  # bucket e holds ids in (e - 0.5, e + 0.5]
            bucket_counts=counts_E.tolist(),
            global_step=step,
        )
        dropped = 1.0 - float(kept_per_expert_E.sum()) / total if total else 0.0
        self.writer.add_scalar(f"moe/{layer}/dropped_fraction", dropped, step)
        if total:
            self.writer.add_scalar(f"moe/{layer}/imbalance", imbalance(counts_E), step)
            history = self.load_history.setdefault(layer, [])
            history.append(load_fractions(counts_E))
            self.writer.add_image(f"moe/{layer}/expert_load", load_heat_map(np.stack(history)), step,
                                  dataformats="HWC")

    def hparams(self, config: dict, metric_tags: list[str]) -> None:
        """The composed config in the HParams tab, linked to the run's metric scalars."""
        experiment, session_start, session_end = hparams(flatten(config), {tag: 0.0 for tag in metric_tags})
        for summary in (experiment, session_start, session_end):
            self.writer.file_writer.add_summary(summary)

    def close(self) -> None:
        self.writer.close()


def training_throughput(model, sequences_per_second: float, seq_len: int, device, world_size: int = 1) -> dict:
    """What a trainer logs for a language model: tokens_per_sec (all ranks together) and, when the
    model states its training FLOPs per token (a `flops_per_token(seq_len)` method) and the
    device's peak is known, mfu (per device)."""
    tokens_per_second = sequences_per_second * seq_len
    metrics = {"tokens_per_sec": tokens_per_second}
    flops = getattr(model, "flops_per_token", None)
    peak = peak_bf16_flops(device)
    if callable(flops) and peak is not None:
        metrics["mfu"] = tokens_per_second / world_size * flops(seq_len) / peak
    return metrics
