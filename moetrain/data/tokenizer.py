"""Tokenizers: the built-in byte-level one, or a Hugging Face `tokenizer.json` read with `tokenizers`.

    tokenizer = load_tokenizer("tokenizer/")          # a tokenizer.json, or a directory holding one
    ids = tokenizer.encode("Once upon a time")
    tokenizer.decode(ids), tokenizer.vocab_size, tokenizer.eos_id, tokenizer.sha256
    tokenizer.save("runs/RUN/tokenizer")              # the files, copied byte for byte

A directory in the Hugging Face layout holds `tokenizer.json` and, where present,
`tokenizer_config.json` and `special_tokens_map.json`; all three are kept and saved verbatim, so a
run directory's copy loads in transformers as the original does. The end-of-text token that
separates documents is the config's `eos_token` (tokenizer_config.json, then
special_tokens_map.json), else an added token named like one (<|endoftext|>, <|end_of_text|>,
</s>, <eos>); a tokenizer without any is refused, since packed documents need a separator.

Documents are encoded without the tokenizer's own special tokens (no BOS from a template post-
processor): moetrain puts the end-of-text token after each document itself. The tokenizer's
identity is the SHA-256 of its tokenizer.json bytes: token shards and runs record it, and shards
are only read with the tokenizer that wrote them.

The byte-level tokenizer (UTF-8 bytes as ids 0..255, end-of-text 256) has no files and no hash.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json")
END_OF_TEXT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # sentencepiece-style byte tokens


class TokenizerError(ValueError):
    """A tokenizer that cannot be used: missing, unreadable, or without an end-of-text token."""


class Tokenizer:
    """A tokenizers.Tokenizer with the files it was read from (see the module doc)."""

    def __init__(self, backend, eos_id: int, files: dict[str, bytes], source: str = ""):
        self.backend, self.eos_id, self.files, self.source = backend, eos_id, files, source
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.sha256 = hashlib.sha256(files[TOKENIZER_FILE]).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, by the tokenizers batch encoder (parallel in Rust; encode_batch_fast,
        which skips the character offsets nobody here reads, where the installed version has it)."""
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)

    def byte_lengths(self) -> np.ndarray:
        """[vocab_size] int64: the UTF-8 bytes of the text each token stands for (0 for special
        tokens), so that bits per byte divide by the bytes of the text the tokens spell. Exact for
        byte-level BPE (one alphabet character per byte: GPT-2, Llama 3, Qwen, DeepSeek) and for
        sentencepiece-style vocabularies (▁ is a space, <0xNN> one byte)."""
        config = json.loads(self.files[TOKENIZER_FILE])
        special = {token["id"] for token in config.get("added_tokens", []) if token.get("special")}
        byte_level = "ByteLevel" in json.dumps(config.get("decoder"))
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for token_id in range(self.vocab_size):
            piece = self.backend.id_to_token(token_id)
            if piece is None or token_id in special:
                continue
            if byte_level:
                lengths[token_id] = len(piece)
            elif _BYTE_FALLBACK.fullmatch(piece):
                lengths[token_id] = 1
            else:
                lengths[token_id] = len(piece.replace("\u2581", " ").encode("utf-8"))
        return lengths

    def save(self, directory: str | Path) -> Path:
        """Copy the tokenizer's files, unchanged, into `directory` (made if missing)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name, content in self.files.items():
            (directory / name).write_bytes(content)
        return directory


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens 0..255, plus one end-of-text token (256) between documents."""

    eos_id = 256
    vocab_size = 257
    sha256 = None  # no tokenizer file: shards and runs of byte-level text record none

    def __init__(self):
        self.files, self.source = {}, "byte-level"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def byte_lengths(self) -> np.ndarray:
        lengths = np.ones(self.vocab_size, dtype=np.int64)
        lengths[self.eos_id] = 0
        return lengths

    def save(self, directory: str | Path) -> Path:
        return Path(directory)  # nothing to copy: the byte-level tokenizer is built in


def _read_json(file: Path) -> dict:
    try:
        value = json.loads(file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TokenizerError(f"{file} is not valid JSON ({error}): restore it, or remove it if it is optional") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{file} holds a JSON {type(value).__name__}, not an object: restore the file")
    return value


def _named_token(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # {"content": "</s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer at `path`: a tokenizer.json file, or a directory holding one (module doc).
    Raises TokenizerError naming the file and the fix."""
    try:
        from tokenizers import Tokenizer as Backend
    except ImportError:
        raise TokenizerError("the tokenizers package is not installed: pip install tokenizers") from None
    path = Path(path).expanduser()
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        where = f"{path} holds no {TOKENIZER_FILE}" if path.is_dir() else f"{path} does not exist"
        raise TokenizerError(f"tokenizer={str(path)!r}: {where}: give a {TOKENIZER_FILE} or a directory holding one "
                             "(the Hugging Face layout)")
    files = {TOKENIZER_FILE: file.read_bytes()}
    for name in TOKENIZER_FILES[1:]:
        if (file.parent / name).is_file():
            files[name] = (file.parent / name).read_bytes()
    try:
        backend = Backend.from_str(files[TOKENIZER_FILE].decode("utf-8"))
    except Exception as error:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise TokenizerError(f"tokenizer={str(path)!r}: {file} is not a readable tokenizer.json ({first}): restore it, "
                             "or write it again with tokenizers' Tokenizer.save or transformers' save_pretrained") from None
    names = [_named_token(_read_json(file.parent / name), "eos_token") for name in TOKENIZER_FILES[1:]
             if name in files]
    names = [name for name in names if name is not None] + list(END_OF_TEXT_NAMES)
    eos_id = next((backend.token_to_id(name) for name in names if backend.token_to_id(name) is not None), None)
    if eos_id is None:
        raise TokenizerError(f"tokenizer={str(path)!r} has no end-of-text token (tokenizer_config.json's eos_token, or "
                             f"an added token such as {END_OF_TEXT_NAMES[0]}), which separates packed documents: add "
                             "one to the tokenizer")
    return Tokenizer(backend, eos_id, files, str(path))
