"""Reading and writing safetensors files through the `safetensors` package.

The format (https://huggingface.co/docs/safetensors) is an unsigned little-endian 64-bit header
size N, N bytes of JSON mapping each tensor name to {"dtype", "shape", "data_offsets": [begin,
end]} (an optional "__metadata__" entry holds strings), then the raw tensor bytes. It holds data
only: reading one runs nothing and builds nothing but tensors.

A file comes from anyone, so its header is checked before any tensor is read, by the package's
reader (Hugging Face's, the one transformers uses): the header's size is bounded (100 MB) and
within the file, it is strict JSON, every dtype is known, every tensor's bytes are what its shape
and dtype need, and the tensors' byte ranges tile the data exactly (none past the end, none
overlapping). A file failing any check is a ValueError of one line naming it and the check, with
nothing large allocated. Opening maps the file; a tensor costs memory only when it is read.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file as _save_file


class SafetensorsFile:
    """One .safetensors file, its header checked: names(), shape(name), get(name) -> tensor (a copy)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._file = safe_open(str(self.path), framework="pt")
        except SafetensorError as error:
            raise ValueError(f"{self.path} is not a valid safetensors file ({_one_line(error)})") from None
        self.metadata = self._file.metadata() or {}

    def names(self) -> list[str]:
        return list(self._file.keys())

    def shape(self, name: str) -> list[int]:
        """The tensor's shape as the (checked) header gives it; reads no data."""
        return list(self._file.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._file.get_tensor(name)
        except (SafetensorError, TypeError) as error:  # a dtype torch has no tensor type for
            raise ValueError(f"{self.path}: tensor {name!r} cannot be read ({_one_line(error)})") from None


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()).removeprefix("Error while deserializing header: ")


def save_file(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (any device, any layout: each is copied to contiguous CPU memory of its own,
    as the format stores every tensor whole) with string `metadata`."""
    _save_file({name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in tensors.items()},
               str(path), metadata=dict(metadata) if metadata else None)
