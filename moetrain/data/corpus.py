"""Reading a text corpus: which files are text, and the documents of one file (.txt: the whole
file; .jsonl / .jsonl.gz: one JSON object a line, its text under a key). Both the in-memory text
data (moetrain.data.text) and `moetrain tokenize` (moetrain.data.shards) read corpora through it."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz")


def suffix(path: Path) -> str:
    """The corpus kind of a file name: .jsonl.gz, or its last suffix."""
    return ".jsonl.gz" if path.name.endswith(".jsonl.gz") else path.suffix


def _decode_utf8(data: bytes, file: Path, line_offset: int = 0) -> str:
    """`data` as UTF-8, or a ValueError naming the file, the line and the byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = line_offset + data.count(b"\n", 0, error.start) + 1
        raise ValueError(
            f"{file}:{line}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}): "
            "convert the file to UTF-8 (e.g. iconv -t UTF-8), or tokenize it yourself into .npy/.bin token ids"
        ) from None


def documents(file: Path, text_key: str = "text") -> Iterator[str]:
    """The documents of one text file in order: a .txt file is one, a .jsonl (.jsonl.gz) line one
    (blank lines skipped). A ValueError names the file and line of a fault."""
    if suffix(file) == ".txt":
        yield _decode_utf8(file.read_bytes(), file)
        return
    opener = gzip.open if suffix(file) == ".jsonl.gz" else open
    try:
        with opener(file, "rb") as handle:
            for number, raw in enumerate(handle, 1):
                line = _decode_utf8(raw, file, number - 1)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:  # its line number counts within this one line
                    raise ValueError(f"{file}:{number}: invalid JSON at column {error.colno}: {error.msg}") from None
                if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                    raise ValueError(f"{file}:{number}: expected a JSON object with a string under text_key={text_key!r}")
                yield record[text_key]
    except (gzip.BadGzipFile, EOFError) as error:
        raise ValueError(f"{file}: not a complete gzip file ({error}): compress it again, or decompress it to .jsonl") from None
