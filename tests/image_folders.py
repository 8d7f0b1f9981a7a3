"""Small image folders written as real PNG files, for the data=folder tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

# Each class is one dominant colour channel: an easy, separable task (other names get one by their letters).
COLOURS = {"blue": 2, "green": 1, "red": 0}


def channel_of(name: str) -> int:
    return COLOURS.get(name, sum(map(ord, name)) % 3)


def write_class_folders(root: Path, per_class: int, size: int | tuple[int, int] = 8, seed: int = 0,
                        classes: tuple[str, ...] = ("blue", "green", "red")) -> dict[str, list[np.ndarray]]:
    """root/<class>/<i>.png: noisy images whose dominant channel is the class's; returns each class's
    pixel arrays [H, W, 3] uint8 in file-name order."""
    generator = np.random.default_rng(seed)
    height, width = (size, size) if isinstance(size, int) else size
    written = {}
    for name in classes:
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        written[name] = []
        for index in range(per_class):
            pixels = generator.integers(0, 120, size=(height, width, 3))
            pixels[..., channel_of(name)] += 120 + generator.integers(0, 15, size=(height, width))
            array = pixels.astype(np.uint8)
            Image.fromarray(array).save(folder / f"{index:03d}.png")
            written[name].append(array)
    return written
