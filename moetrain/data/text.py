"""Language-modelling data: a local text corpus, token files or token shards, and a learnable synthetic task.

`text(path=...)` reads one file or every supported file of a directory (sorted by name):
  *.txt       one document per file
  *.jsonl     one document per line, the string under `text_key` (gzip-compressed: *.jsonl.gz)
  *.npy       a 1-D array of token ids, already tokenized (vocab_size must be given)
  *.bin       raw token ids of `token_dtype` (uint16 as written by nanoGPT-style preprocessing)
or a directory of token shards written by `moetrain tokenize` (moetrain/data/shards.py), which
are memory-mapped and never read into memory whole. Text is encoded in memory by `tokenizer` (a
tokenizer.json or a directory holding one, moetrain/data/tokenizer.py; null: the byte-level
tokenizer, UTF-8 bytes 0..255 and end-of-text 256); a corpus larger than memory is tokenized once
into shards instead. Shards are read with the tokenizer that wrote them (copied into the shard
directory); a `tokenizer` given with them must be that one (the same SHA-256).

Documents are joined with the end-of-text token into one stream that is packed into fixed-length
sequences: inputs are seq_len tokens, targets the same tokens shifted by one. The last
`eval_fraction` of the stream (or the corpus at `eval_path`) is the validation set, whose
cross-entropy gives the validation perplexity the trainer reports. With `document_mask`, each
item also carries the document of every input position ({"document_ids": [seq_len]}, counted
from 0 within the window; a document's end-of-text token belongs to it), and the language model
keeps attention inside each document (moetrain/models/layers.py).

`synthetic_lm()` draws sequences from a random sparse Markov chain (each token has `branching`
equally likely successors), so the best achievable loss is exactly ln(branching): a smoke test
can check that a model learns, not only that the loss moves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from moetrain.data.base import DataModule
from moetrain.data.corpus import TEXT_SUFFIXES, documents, suffix
from moetrain.data.shards import is_shard_directory, open_shards
from moetrain.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".npy", ".bin")
TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")
ENCODE_BATCH = 1024  # documents per call of the batch encoder


class PackedSequences(Dataset):
    """Non-overlapping windows of a token stream: item i is (tokens[i*L : i*L+L], the next L), and
    with document_ends (the stream position after each document's end-of-text token, ascending)
    also {"document_ids": [L]} of the inputs."""

    def __init__(self, tokens, seq_len: int, document_ends: np.ndarray | None = None):
        self.tokens, self.seq_len, self.document_ends = tokens, seq_len, document_ends
        self.count = max((len(tokens) - 1) // seq_len, 0)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        if not 0 <= index < self.count:
            raise IndexError(f"index {index} out of range for {self.count} sequences")
        start = index * self.seq_len
        window = torch.as_tensor(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        inputs, targets = window[:-1], window[1:]
        if self.document_ends is None:
            return inputs, targets
        # A position belongs to the first document that ends after it.
        documents_T = np.searchsorted(self.document_ends, np.arange(start, start + self.seq_len), side="right")
        return inputs, targets, {"document_ids": torch.as_tensor(documents_T - documents_T[0])}


def corpus_files(path: Path) -> list[Path]:
    """The supported files of a corpus (a file, or a directory's files sorted by name)."""
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if suffix(p) in SUFFIXES)
    else:
        raise FileNotFoundError(f"path={str(path)!r} does not exist")
    if not files or any(suffix(p) not in SUFFIXES for p in files):
        raise ValueError(f"path={str(path)!r} holds no supported file; supported suffixes: {SUFFIXES}")
    kinds = {"text" if suffix(p) in TEXT_SUFFIXES else "tokens" for p in files}
    if len(kinds) > 1:
        raise ValueError(f"path={str(path)!r} mixes text (.txt/.jsonl) and token (.npy/.bin) files; use one kind")
    return files


def encode_documents(texts: list[str], tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """(ids, document lengths): each text's ids followed by the end-of-text token."""
    ids: list[int] = []
    lengths: list[int] = []
    for encoded in tokenizer.encode_batch(texts):
        ids += encoded
        ids.append(tokenizer.eos_id)
        lengths.append(len(encoded) + 1)
    return ids, lengths


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


def _read_stream(path: Path, text_key: str, token_dtype: str, vocab_size: int | None,
                 tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray | None]:
    """(token stream, document ends or None for token files) of a corpus of files."""
    if token_dtype not in TOKEN_DTYPES:
        raise ValueError(f"token_dtype={token_dtype!r}: must be one of {TOKEN_DTYPES}")
    pieces: list[np.ndarray] = []
    lengths: list[int] = []
    for file in corpus_files(path):
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
        else:
            batch: list[str] = []
            for document in documents(file, text_key):
                batch.append(document)
                if len(batch) == ENCODE_BATCH:
                    ids, counts = encode_documents(batch, tokenizer)
                    pieces.append(np.array(ids, dtype=np.int32))
                    lengths += counts
                    batch = []
            if batch:
                ids, counts = encode_documents(batch, tokenizer)
                pieces.append(np.array(ids, dtype=np.int32))
                lengths += counts
    # One file stays memory-mapped; several are joined in memory.
    tokens = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    text = suffix(corpus_files(path)[0]) in TEXT_SUFFIXES
    return tokens, np.cumsum(np.array(lengths, dtype=np.int64)) if text else None


class _Corpus:
    """A corpus read for training: its token stream, document ends, largest id and tokenizer."""

    def __init__(self, path: str, text_key: str, token_dtype: str, vocab_size: int | None,
                 tokenizer: Tokenizer | None, tokenizer_path: str | None):
        if is_shard_directory(Path(path)):
            shards = open_shards(Path(path))
            if tokenizer is not None and tokenizer.sha256 != shards.tokenizer_sha256:
                raise ValueError(
                    f"tokenizer={tokenizer_path!r} ({tokenizer.source}, sha256 {str(tokenizer.sha256)[:12]}) is not the "
                    "tokenizer that wrote "
                    f"the shards at path={path!r} (sha256 {shards.tokenizer_sha256[:12]}...): set tokenizer=None to use "
                    f"theirs, or tokenize the corpus again with it (moetrain tokenize CORPUS OUT --tokenizer "
                    f"{tokenizer_path})")
            self.tokens, self.shards = shards.tokens, shards
            self.tokenizer, self.largest = shards.tokenizer, shards.max_id
            self.vocab_size = _vocabulary(vocab_size, self.tokenizer)
            return
        files = corpus_files(Path(path))
        self.shards = None
        if suffix(files[0]) in TEXT_SUFFIXES:
            self.tokenizer = tokenizer or ByteTokenizer()
        elif vocab_size is None and tokenizer is None:
            raise ValueError("vocab_size=None: token files (.npy/.bin) need vocab_size, which the tokenizer that wrote "
                             "them knows (or give that tokenizer: tokenizer=PATH)")
        else:
            self.tokenizer = tokenizer
        self.vocab_size = _vocabulary(vocab_size, self.tokenizer)
        self.tokens, self._document_ends = _read_stream(Path(path), text_key, token_dtype, self.vocab_size,
                                                        self.tokenizer or ByteTokenizer())
        self.largest = int(self.tokens.max()) if len(self.tokens) else -1

    @property
    def document_ends(self) -> np.ndarray | None:
        """The stream position after each document; None for token files (read from shards only
        when asked)."""
        return self.shards.document_ends if self.shards is not None else self._document_ends


def _vocabulary(vocab_size: int | None, tokenizer: Tokenizer | None) -> int:
    """The vocabulary the model gets: vocab_size when given, at least the tokenizer's, else the tokenizer's."""
    if tokenizer is None:
        return vocab_size
    if vocab_size is not None and vocab_size < tokenizer.vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size} "
                         f"ids, {tokenizer.source}): set vocab_size to at least {tokenizer.vocab_size}, or to null")
    return vocab_size or tokenizer.vocab_size


def _split_ends(document_ends: np.ndarray | None, start: int, stop: int) -> np.ndarray | None:
    """Document ends of the stream's [start, stop) part, counted from start (the part's last,
    possibly cut, document ends where the part does)."""
    if document_ends is None:
        return None
    inside = document_ends[(document_ends > start) & (document_ends < stop)] - start
    return np.append(inside, stop - start)


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
    tokenizer: str | None = None,
    document_mask: bool = False,
) -> DataModule:
    """A packed language-modelling corpus (see the module doc). vocab_size: required for token
    files (.npy/.bin) without a tokenizer; text and shards take their tokenizer's."""
    if path is None:
        raise ValueError("path=None: give the corpus, a file or a directory (path=FILE_OR_DIRECTORY)")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: must be >= 1")
    given = load_tokenizer(tokenizer) if tokenizer is not None else None
    corpus = _Corpus(path, text_key, token_dtype, vocab_size, given, tokenizer)
    vocab_size = corpus.vocab_size
    tokens = corpus.tokens
    held_out = None
    if eval_path is not None:
        held_out = _Corpus(eval_path, text_key, token_dtype, vocab_size, corpus.tokenizer, tokenizer or path)
        if held_out.tokenizer is not None and held_out.tokenizer.sha256 != getattr(corpus.tokenizer, "sha256", None):
            raise ValueError(f"eval_path={eval_path!r} holds shards of another tokenizer than path={path!r}: tokenize "
                             "both with the same one")
        train_tokens, eval_tokens = tokens, held_out.tokens
        largest = max(corpus.largest, held_out.largest)
    else:
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction={eval_fraction}: must be in (0, 1) when eval_path=None")
        split = max(len(tokens) - max(int(len(tokens) * eval_fraction), seq_len + 1), 0)
        train_tokens, eval_tokens = tokens[:split], tokens[split:]
        largest = corpus.largest
    train_ends = eval_ends = None
    if document_mask:
        ends = corpus.document_ends
        if ends is None or (held_out is not None and held_out.document_ends is None):
            raise ValueError("document_mask=True needs document boundaries, which token files (.npy/.bin) do not have: "
                             "tokenize the text with moetrain tokenize and train on the shards, or set "
                             "document_mask=False")
        if held_out is not None:
            train_ends, eval_ends = ends, held_out.document_ends
        else:
            train_ends, eval_ends = _split_ends(ends, 0, split), _split_ends(ends, split, len(tokens))
    train_set = PackedSequences(train_tokens, seq_len, train_ends)
    eval_set = PackedSequences(eval_tokens, seq_len, eval_ends)
    if len(train_set) == 0 or len(eval_set) == 0:
        raise ValueError(
            f"path={str(path)!r} has {len(tokens)} tokens: too few for one training and one validation sequence "
            f"of seq_len={seq_len}; lower seq_len or add text"
        )
    if largest >= vocab_size:
        raise ValueError(f"token id {largest} in path={str(path)!r} is >= vocab_size={vocab_size}: the tokenizer "
                         f"needs vocab_size >= {largest + 1} (or vocab_size=None: the tokenizer's own)")
    return DataModule(
        task="language_modeling",
        train_set=train_set,
        eval_set=eval_set,
        batch_size=batch_size,
        eval_batch_size=eval_batch_size,
        num_workers=num_workers,
        model_inputs={"vocab_size": vocab_size, "max_seq_len": seq_len},
        tokenizer=corpus.tokenizer,
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

