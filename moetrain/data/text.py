"""Language-modelling data: a local text corpus or token files, and a learnable synthetic task.

`text(path=...)` reads one file or every supported file of a directory (sorted by name):
  *.txt     one document per file, encoded by the byte-level tokenizer (UTF-8 bytes 0..255)
  *.jsonl   one document per line, the string under `text_key`
  *.npy     a 1-D array of token ids, already tokenized (vocab_size must be given)
  *.bin     raw token ids of `token_dtype` (uint16 as written by nanoGPT-style preprocessing)
Documents are joined with the end-of-text token (256) into one stream that is packed into
fixed-length sequences: inputs are seq_len tokens, targets the same tokens shifted by one. The
last `eval_fraction` of the stream (or the corpus at `eval_path`) is the validation set, whose
cross-entropy gives the validation perplexity the trainer reports.

`synthetic_lm()` draws sequences from a random sparse Markov chain (each token has `branching`
equally likely successors), so the best achievable loss is exactly ln(branching): a smoke test
can check that a model learns, not only that the loss moves.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from moetrain.data.base import DataModule

SUFFIXES = (".txt", ".jsonl", ".npy", ".bin")
TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus one end-of-text token (256) between documents."""

    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class PackedSequences(Dataset):
    """Non-overlapping windows of a token stream: item i is (tokens[i*L : i*L+L], the next L)."""

    def __init__(self, tokens: np.ndarray | torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.count = max((len(tokens) - 1) // seq_len, 0)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        if not 0 <= index < self.count:
            raise IndexError(f"index {index} out of range for {self.count} sequences")
        start = index * self.seq_len
        window = torch.as_tensor(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        return window[:-1], window[1:]


def _files(path: Path) -> list[Path]:
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES)
    else:
        raise FileNotFoundError(f"path={str(path)!r} does not exist")
    if not files or any(p.suffix not in SUFFIXES for p in files):
        raise ValueError(f"path={str(path)!r} holds no supported file; supported suffixes: {SUFFIXES}")
    kinds = {"tokens" if p.suffix in (".npy", ".bin") else "text" for p in files}
    if len(kinds) > 1:
        raise ValueError(f"path={str(path)!r} mixes text (.txt/.jsonl) and token (.npy/.bin) files; use one kind")
    return files


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


def _read_jsonl(file: Path, text_key: str, tokenizer: ByteTokenizer) -> list[int]:
    ids: list[int] = []
    with open(file, "rb") as handle:
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
            ids += tokenizer.encode(record[text_key]) + [tokenizer.eos_id]
    return ids


def _check_token_ids(tokens: np.ndarray, file: Path, vocab_size: int | None) -> None:
    """Every id of a token file is in [0, vocab_size): a negative or too large id would index past
    the embedding (an error on a CPU, garbage or a device fault on a GPU)."""
    if len(tokens) == 0:
        return
    smallest, largest = int(tokens.min()), int(tokens.max())
    if smallest < 0:
        position = int(np.argmax(np.asarray(tokens) < 0))
        raise ValueError(f"{file}: token id {smallest} is negative (first at position {position}): token ids must be "
                         f"in [0, vocab_size); was the file written with another token_dtype?")
    if vocab_size is not None and largest >= vocab_size:
        position = int(np.argmax(np.asarray(tokens) >= vocab_size))
        raise ValueError(f"{file}: token id {largest} (first too large at position {position}) is >= "
                         f"vocab_size={vocab_size}: set vocab_size to the tokenizer's vocabulary size "
                         f"(at least {largest + 1})")


def read_corpus(path: str | Path, text_key: str = "text", token_dtype: str = "uint16",
                vocab_size: int | None = None) -> np.ndarray:
    """The token stream of a file or directory (see the module doc). Errors name the file (and the
    line, for text); token files are checked against vocab_size when it is given."""
    if token_dtype not in TOKEN_DTYPES:
        raise ValueError(f"token_dtype={token_dtype!r}: must be one of {TOKEN_DTYPES}")
    tokenizer = ByteTokenizer()
    pieces: list[np.ndarray] = []
    for file in _files(Path(path)):
        if file.suffix == ".npy":
            try:
                array = np.load(file, mmap_mode="r")
            except (ValueError, OSError, EOFError) as error:
                raise ValueError(f"{file}: not a readable .npy array ({error}): write it with numpy.save") from None
            if array.ndim != 1 or array.dtype.kind not in "iu":
                raise ValueError(f"{file}: a .npy token file must be a 1-D integer array, got {array.dtype} {array.shape}")
            _check_token_ids(array, file, vocab_size)
            pieces.append(array)
        elif file.suffix == ".bin":
            itemsize = np.dtype(token_dtype).itemsize
            if file.stat().st_size % itemsize:
                raise ValueError(f"{file}: {file.stat().st_size} bytes is not a whole number of {token_dtype} token ids: "
                                 f"set token_dtype (now token_dtype={token_dtype!r}) to the type the file was written with")
            array = np.memmap(file, dtype=token_dtype, mode="r") if file.stat().st_size else np.zeros(0, token_dtype)
            _check_token_ids(array, file, vocab_size)
            pieces.append(array)
        elif file.suffix == ".txt":
            text = _decode_utf8(file.read_bytes(), file)
            pieces.append(np.array(tokenizer.encode(text) + [tokenizer.eos_id], dtype=np.int32))
        else:
            pieces.append(np.array(_read_jsonl(file, text_key, tokenizer), dtype=np.int32))
    # One file stays memory-mapped; several are joined in memory.
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def text(
    path: str | None,
    seq_len: int = 256,
    batch_size: int = 16,
    eval_batch_size: int = 16,
    eval_fraction: float = 0.05,
    eval_path: str | None = None,
    text_key: str = "text",
    token_dtype: str = "uint16",
    vocab_size: int | None = None,
    num_workers: int = 0,
) -> DataModule:
    """A packed language-modelling corpus (see the module doc). vocab_size: required for token
    files (.npy/.bin), the byte tokenizer's 257 for text."""
    if path is None:
        raise ValueError("path=None: give the corpus, a file or a directory (path=FILE_OR_DIRECTORY)")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: must be >= 1")
    if _files(Path(path))[0].suffix in (".txt", ".jsonl"):
        vocab_size = vocab_size or ByteTokenizer.vocab_size
    elif vocab_size is None:
        raise ValueError("vocab_size=None: token files (.npy/.bin) need vocab_size, which the tokenizer that wrote them knows")
    tokens = read_corpus(path, text_key, token_dtype, vocab_size)
    if eval_path is not None:
        train_tokens, eval_tokens = tokens, read_corpus(eval_path, text_key, token_dtype, vocab_size)
    else:
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction={eval_fraction}: must be in (0, 1) when eval_path=None")
        split = max(len(tokens) - max(int(len(tokens) * eval_fraction), seq_len + 1), 0)
        train_tokens, eval_tokens = tokens[:split], tokens[split:]
    train_set, eval_set = PackedSequences(train_tokens, seq_len), PackedSequences(eval_tokens, seq_len)
    if len(train_set) == 0 or len(eval_set) == 0:
        raise ValueError(
            f"path={str(path)!r} has {len(tokens)} tokens: too few for one training and one validation sequence "
            f"of seq_len={seq_len}; lower seq_len or add text"
        )
    largest = int(max(train_tokens.max(), eval_tokens.max()))  # text: bytes and end-of-text, up to 256
    if largest >= vocab_size:
        raise ValueError(f"token id {largest} in path={str(path)!r} is >= vocab_size={vocab_size}: the byte "
                         f"tokenizer needs vocab_size >= {ByteTokenizer.vocab_size} (or vocab_size=None)")
    return DataModule(
        task="language_modeling",
        train_set=train_set,
        eval_set=eval_set,
        batch_size=batch_size,
        eval_batch_size=eval_batch_size,
        num_workers=num_workers,
        model_inputs={"vocab_size": vocab_size, "max_seq_len": seq_len},
    )


def markov_chain_sequences(successors_VB: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[count, length] token sequences: a uniform first token, then each token followed by one of
    its `branching` successors, uniformly."""
    vocab_size, branching = successors_VB.shape
    tokens_NL = torch.empty(count, length, dtype=torch.long)
    tokens_NL[:, 0] = torch.randint(vocab_size, (count,), generator=generator)
    choice_NL = torch.randint(branching, (count, length), generator=generator)
    for position in range(1, length):
        tokens_NL[:, position] = successors_VB[tokens_NL[:, position - 1], choice_NL[:, position]]
    return tokens_NL


def synthetic_lm(
    vocab_size: int = 256,
    seq_len: int = 64,
    branching: int = 2,
    train_size: int = 4096,
    eval_size: int = 256,
    seed: int = 0,
    batch_size: int = 16,
    eval_batch_size: int = 64,
    num_workers: int = 0,
) -> DataModule:
    """Sequences of a random sparse Markov chain; the loss floor is ln(branching) (module doc)."""
    if not 1 <= branching < vocab_size or seq_len < 2 or train_size < 1 or eval_size < 1:
        raise ValueError(
            "synthetic_lm needs 1 <= branching < vocab_size, seq_len >= 2, train_size >= 1, eval_size >= 1; got "
            f"branching={branching}, vocab_size={vocab_size}, seq_len={seq_len}, train_size={train_size}, eval_size={eval_size}"
        )
    generator = torch.Generator().manual_seed(seed)
    # Distinct successors per token, so every one of the `branching` choices has probability 1/branching.
    successors_VB = torch.stack([torch.randperm(vocab_size, generator=generator)[:branching] for _ in range(vocab_size)])

    def split(count: int) -> TensorDataset:
        tokens_NL = markov_chain_sequences(successors_VB, count, seq_len + 1, generator)
        return TensorDataset(tokens_NL[:, :-1], tokens_NL[:, 1:])

    return DataModule(
        task="language_modeling",
        train_set=split(train_size),
        eval_set=split(eval_size),
        batch_size=batch_size,
        eval_batch_size=eval_batch_size,
        num_workers=num_workers,
        model_inputs={"vocab_size": vocab_size, "max_seq_len": seq_len},
    )

