"""Reading and writing the safetensors file format, without the `safetensors` package.

The format (https://huggingface.co/docs/safetensors) is: an unsigned little-endian 64-bit header
size N, N bytes of JSON mapping each tensor name to {"dtype", "shape", "data_offsets": [begin,
end]} (offsets into the data that follows; an optional "__metadata__" entry holds strings), then
the raw little-endian tensor bytes. Reading memory-maps the file, so a tensor costs memory only
when it is used.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsFile:
    """Lazy view of one .safetensors file: names(), get(name) -> tensor (a copy, writable)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            # ACCESS_COPY gives a writable (copy-on-write) buffer, which torch.frombuffer wants.
            self._buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        if len(self._buffer) < 8:
            raise ValueError(f"{self.path} is not a safetensors file (shorter than its 8-byte header size)")
        (header_size,) = struct.unpack("<Q", self._buffer[:8])
        if 8 + header_size > len(self._buffer):
            raise ValueError(f"{self.path} is not a safetensors file (header size {header_size} past the end)")
        header = json.loads(self._buffer[8 : 8 + header_size])
        self.metadata = header.pop("__metadata__", None) or {}
        self._entries = header
        self._data_start = 8 + header_size

    def names(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {entry['dtype']}, supported: {sorted(DTYPES)}")
        dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
        begin, end = entry["data_offsets"]
        count = end - begin
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        data = torch.frombuffer(self._buffer, dtype=torch.uint8, count=count, offset=self._data_start + begin)
        return data.view(dtype).reshape(shape).clone()


def save_file(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    blobs, offset = [], 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        if tensor.dtype not in NAMES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, supported: {sorted(map(str, NAMES))}")
        blob = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the spec allows space padding; it aligns the data to 8 bytes
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for blob in blobs:
            handle.write(blob)
