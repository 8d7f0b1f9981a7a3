"""python -m moetrain.models: total and active parameters of every preset, built on the meta
device (no memory is allocated, so the trillion-parameter presets print in seconds)."""

import torch

from moetrain.models.lm import parameter_counts
from moetrain.models.presets import PRESETS, build_lm


def human(count: int) -> str:
    return f"{count / 1e9:.3f}B" if count >= 1e9 else f"{count / 1e6:.3f}M"


print(f"{'preset':<20} {'total':>10} {'active':>10}")
for name in PRESETS:
    with torch.device("meta"):
        total, active = parameter_counts(build_lm(name))
    print(f"{name:<20} {human(total):>10} {human(active):>10}")
