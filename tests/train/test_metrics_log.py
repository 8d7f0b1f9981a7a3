"""metrics.jsonl and the expert-load pictures: read back from the file and from TensorBoard's event
files, against values computed here from the routing counts."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from moetrain.config import LoggerConfig, OptimConfig, TrainerConfig
from moetrain.data import synthetic
from moetrain.models import VisionMoE
from moetrain.train import Trainer, seed_everything
from moetrain.train.metrics import (
    LOAD_IMAGE_WIDTH,
    TensorBoard,
    append_metrics,
    load_heat_map,
    load_postfix,
    read_metrics,
    worst_imbalance,
)

# viridis at 0, 1/4, 1/2, 3/4, 1 (the published colour map's table).
VIRIDIS = [(0.267004, 0.004874, 0.329415), (0.229739, 0.322361, 0.545706), (0.127568, 0.566949, 0.550556),
           (0.369214, 0.788888, 0.382914), (0.993248, 0.906157, 0.143936)]


def viridis(value: float) -> tuple[int, int, int]:
    """The 0..255 colour of a value in [0, 1]: linear between the table's neighbouring entries."""
    position = min(max(value, 0.0), 1.0) * 4
    low = min(int(position), 3)
    t = position - low
    return tuple(round(255 * (VIRIDIS[low][c] * (1 - t) + VIRIDIS[low + 1][c] * t)) for c in range(3))


def expected_colour(counts: list[int], expert: int) -> tuple[int, int, int]:
    """Fraction of the choices times E / 2 (uniform load in the middle of the map)."""
    return viridis(counts[expert] / sum(counts) * len(counts) / 2)


def events_of(directory) -> EventAccumulator:
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0, "images": 0, "histograms": 0})
    events.Reload()
    return events


def decode(image_event) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(image_event.encoded_image_string)).convert("RGB"))


def test_load_images_and_imbalance_read_back_from_the_event_file(tmp_path):
    generator = torch.Generator().manual_seed(0)
    layers = {"blocks.1.ffn": 4, "blocks.3.ffn": 6}
    logged = {layer: [] for layer in layers}
    board = TensorBoard(tmp_path)
    for step in (10, 20, 30, 40, 50):
        for layer, experts in layers.items():
            tokens_E = torch.randint(0, 50, (experts,), generator=generator)
            tokens_E[step // 10 % experts] += 200  # a hot expert that moves
            kept_E = tokens_E - torch.randint(0, 5, (experts,), generator=generator).clamp(max=tokens_E)
            board.routing(layer, tokens_E, kept_E, step)
            logged[layer].append((tokens_E.tolist(), kept_E.tolist()))
    board.close()
    events = events_of(tmp_path)
    for layer, experts in layers.items():
        imbalance = [event.value for event in events.Scalars(f"moe/{layer}/imbalance")]
        expected = [max(tokens) / (sum(tokens) / experts) for tokens, _ in logged[layer]]
        assert imbalance == pytest.approx(expected, rel=1e-6)
        dropped = [event.value for event in events.Scalars(f"moe/{layer}/dropped_fraction")]
        assert dropped == pytest.approx([1 - sum(kept) / sum(tokens) for tokens, kept in logged[layer]], rel=1e-6)
        images = events.Images(f"moe/{layer}/expert_load")
        assert [image.step for image in images] == [10, 20, 30, 40, 50]
        for count, image_event in enumerate(images, 1):  # each image: every step logged so far
            pixels = decode(image_event)
            height, width, _ = pixels.shape
            assert height % experts == 0 and width % count == 0
            cell_height, cell_width = height // experts, width // count
            for column in range(count):
                tokens = logged[layer][column][0]
                for expert in range(experts):
                    cell = pixels[expert * cell_height:(expert + 1) * cell_height,
                                  column * cell_width:(column + 1) * cell_width]
                    assert (np.abs(cell.astype(int) - expected_colour(tokens, expert)) <= 1).all(), (layer, column)


def test_a_long_history_is_averaged_into_the_image_width():
    generator = np.random.default_rng(0)
    steps, experts = 3 * LOAD_IMAGE_WIDTH + 5, 8
    fractions = generator.dirichlet(np.ones(experts), size=steps)
    pixels = load_heat_map(fractions)
    assert pixels.shape[1] == LOAD_IMAGE_WIDTH and pixels.shape[0] % experts == 0
    cell_height = pixels.shape[0] // experts
    # The first 5 columns each average 4 consecutive steps, the others 3 (as even as possible).
    for column, first, size in [(0, 0, 4), (4, 16, 4), (5, 20, 3), (LOAD_IMAGE_WIDTH - 1, steps - 3, 3)]:
        mean = fractions[first:first + size].mean(axis=0)
        for expert in range(experts):
            colour = viridis(mean[expert] * experts / 2)
            assert (np.abs(pixels[expert * cell_height, column].astype(int) - colour) <= 1).all(), (column, expert)


def test_worst_imbalance_names_the_worst_layer():
    routing = {"a": [torch.tensor([5, 5, 5, 5]), torch.tensor([5, 5, 5, 5])],
               "b": [torch.tensor([1, 9, 0, 2]), torch.tensor([1, 4, 0, 2])],
               "c": [torch.tensor([0, 0, 0]), torch.tensor([0, 0, 0])]}
    layer, value = worst_imbalance(routing)
    assert layer == "b" and value == pytest.approx(9 / (12 / 4))
    assert load_postfix(routing) == {"max_load": "3.00 b"}
    assert worst_imbalance({"c": routing["c"]}) is None and load_postfix({}) == {}


def test_metrics_lines_keep_the_prefix_and_write_null_for_non_finite(tmp_path):
    tmp_path = tmp_path / "new_run"  # made by the first line, as the trainer's first log may come before any checkpoint
    append_metrics(tmp_path, 3, {"train/loss": 1.5, "eval/loss": 2.0, "train/grad_norm": math.inf})
    append_metrics(tmp_path, 4, {"eval/loss": math.nan, "train/loss": 0.5}, "eval/")
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]  # strict JSON
    assert [{k: v for k, v in line.items() if k != "time"} for line in lines] == [
        {"step": 3, "train/loss": 1.5, "eval/loss": 2.0, "train/grad_norm": None}, {"step": 4, "eval/loss": None}]
    assert read_metrics(tmp_path) == lines and read_metrics(tmp_path / "none") == []


def test_training_appends_a_line_per_logged_step_and_draws_each_layer(tmp_path):
    seed_everything(0)
    data = synthetic(num_classes=4, image_size=8, train_size=48, eval_size=16, batch_size=8, eval_batch_size=8)
    model = VisionMoE(image_size=8, in_channels=3, patch_size=4, num_classes=4, dim=16, depth=2, num_heads=2,
                      num_experts=4, expert_hidden_size=32, moe_every=1)
    trainer = Trainer(model, data, trainer=TrainerConfig(max_steps=6, eval_every=3, eval_batches=1, checkpoint_every=0,
                                                         progress_bar=False),
                      optim=OptimConfig(lr=3e-3, warmup_steps=2), logger=LoggerConfig(tensorboard=True, log_every=2),
                      run_dir=tmp_path, seed=0, run_config={"model": {"name": "tiny"}})
    final = trainer.fit()
    lines = read_metrics(tmp_path)
    train_lines = [line for line in lines if "train/loss" in line]
    eval_lines = [line for line in lines if "eval/loss" in line]
    assert [line["step"] for line in train_lines] == [2, 4, 6] and [line["step"] for line in eval_lines] == [3, 6]
    assert all(key.startswith("train/") for line in train_lines for key in line if key not in ("step", "time"))
    events = events_of(tmp_path)
    # The same numbers as the event file's scalars, written by the other path.
    logged = {event.step: event.value for event in events.Scalars("train/loss")}
    assert {line["step"]: line["train/loss"] for line in train_lines} == pytest.approx(logged, rel=1e-6)
    assert eval_lines[-1]["eval/accuracy"] == final["eval/accuracy"]
    for layer in ("blocks.0.ffn", "blocks.1.ffn"):
        assert [event.step for event in events.Images(f"moe/{layer}/expert_load")] == [2, 4, 6]
        values = [event.value for event in events.Scalars(f"moe/{layer}/imbalance")]
        assert len(values) == 3 and all(1.0 <= value <= 4.0 for value in values)
        last = decode(events.Images(f"moe/{layer}/expert_load")[-1])
        assert last.shape[0] % 4 == 0 and last.shape[1] % 3 == 0  # 4 experts x 3 logged steps
