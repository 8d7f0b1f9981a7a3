"""TensorBoard output of a run: scalars, per-layer routing, and the hyperparameters."""

from __future__ import annotations

from pathlib import Path

import torch
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


class TensorBoard:
    def __init__(self, log_dir: Path):
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, values: dict, step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def routing(self, layer: str, tokens_per_expert_E: torch.Tensor, kept_per_expert_E: torch.Tensor, step: int) -> None:
        """Tokens per expert as a histogram over expert ids (bar e = tokens routed to expert e),
        and the fraction of routing choices that found no slot under the capacity limit."""
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

    def hparams(self, config: dict, metric_tags: list[str]) -> None:
        """The composed config in the HParams tab, linked to the run's metric scalars."""
        experiment, session_start, session_end = hparams(flatten(config), {tag: 0.0 for tag in metric_tags})
        for summary in (experiment, session_start, session_end):
            self.writer.file_writer.add_summary(summary)

    def close(self) -> None:
        self.writer.close()
