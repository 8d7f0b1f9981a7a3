"""Token shards: a text corpus tokenized once (`moetrain tokenize`), read memory-mapped for training.

    OUT/
      tokens.json            what the shards hold (below)
      tokenizer/             the tokenizer that wrote them: its files, copied verbatim
      shard_00000.bin        token ids: uint16 when the vocabulary fits (at most 65536 ids), else uint32
      shard_00000.docs.npy   int64: the position after each document's end-of-text token, in the shard

tokens.json holds the tokenizer's SHA-256 (of its tokenizer.json), its vocabulary size and
end-of-text id, the dtype, the corpus files (name and size), the totals of documents and tokens,
and per shard its file names, tokens, documents, largest id and SHA-256, and the size and SHA-256
of the text it was made from. `complete` is false until the last shard is written.

What a shard holds depends only on the corpus and `shard_bytes`: the corpus files in order
(a directory's .txt / .jsonl / .jsonl.gz files, recursively, sorted by relative path), each
document in file order, shard i taking documents from where shard i-1 stopped until its text
reaches shard_bytes UTF-8 bytes. Workers encode whole shards (the tokenizers batch encoder,
encode_batch), so any number of workers writes the same bytes.

Run again on the same OUT, tokenization continues: the shards tokens.json records are checked
(their text against the corpus, their files against their SHA-256) and kept, the rest is written.
A finished OUT is verified. An OUT written with another tokenizer, another corpus or other
settings is refused, never mixed.

Reading (`open_shards`) maps each shard file (np.memmap): a window reads only its own tokens.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from collections import deque
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moetrain.data.corpus import TEXT_SUFFIXES, documents, suffix
from moetrain.data.tokenizer import Tokenizer, TokenizerError, load_tokenizer

METADATA = "tokens.json"
TOKENIZER_DIR = "tokenizer"
FORMAT, VERSION = "moetrain.tokens", 1
SHARD_BYTES = 64 * 2**20  # text per shard: few files, and little text in memory per worker
ENCODE_BATCH_BYTES = 2**20  # text per call of the batch encoder (whose per-token objects are large)


class ShardError(ValueError):
    """Shards that cannot be written or read as asked: one line naming the problem and the fix."""


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def is_shard_directory(path: Path) -> bool:
    return path.is_dir() and (path / METADATA).is_file()


# ---- reading -------------------------------------------------------------------------------------
class ShardedTokens:
    """The token stream of several memory-mapped arrays, or a part of it: slicing gives another
    part without reading anything; np.asarray(part) reads its tokens."""

    def __init__(self, arrays: list[np.ndarray], start: int = 0, stop: int | None = None):
        self.arrays = arrays
        self.offsets = np.cumsum([0] + [len(array) for array in arrays])
        self.start = start
        self.stop = int(self.offsets[-1]) if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key: slice) -> ShardedTokens:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("ShardedTokens takes contiguous slices only, e.g. tokens[start:stop]")
        start, stop, _ = key.indices(len(self))
        return ShardedTokens(self.arrays, self.start + start, self.start + max(start, stop))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        first = int(np.searchsorted(self.offsets, self.start, side="right")) - 1
        pieces = []
        for index in range(max(first, 0), len(self.arrays)):
            begin, end = int(self.offsets[index]), int(self.offsets[index + 1])
            if begin >= self.stop:
                break
            pieces.append(self.arrays[index][max(self.start, begin) - begin : min(self.stop, end) - begin])
        joined = np.concatenate(pieces) if pieces else np.zeros(0, dtype=self.arrays[0].dtype if self.arrays else None)
        return joined.astype(dtype) if dtype is not None else joined


@dataclass
class Shards:
    """A shard directory opened for reading (see the module doc)."""

    directory: Path
    metadata: dict
    tokens: ShardedTokens
    tokenizer: Tokenizer

    @property
    def tokenizer_sha256(self) -> str:
        return self.metadata["tokenizer_sha256"]

    @property
    def vocab_size(self) -> int:
        return self.metadata["vocab_size"]

    @property
    def max_id(self) -> int:
        return max((shard["max_id"] for shard in self.metadata["shards"]), default=-1)

    @cached_property
    def document_ends(self) -> np.ndarray:
        """int64: the stream position after each document (read only when asked: a document mask)."""
        ends = [np.load(self.directory / shard["documents_file"]) + offset
                for shard, offset in zip(self.metadata["shards"], self.tokens.offsets)]
        return np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)


def _read_metadata(directory: Path) -> dict:
    try:
        metadata = json.loads((directory / METADATA).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ShardError(f"{directory / METADATA} is not readable JSON ({error}): tokenize the corpus again into a "
                         "new folder (moetrain tokenize CORPUS OUT --tokenizer PATH)") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
        raise ShardError(f"{directory / METADATA} was not written by moetrain tokenize (format {FORMAT} version "
                         f"{VERSION}): tokenize the corpus again into a new folder")
    return metadata


def open_shards(directory: Path) -> Shards:
    """The shards of a finished `moetrain tokenize` directory, memory-mapped. ShardError when they
    are incomplete, damaged, or their tokenizer is not the one recorded."""
    metadata = _read_metadata(directory)
    if not metadata["complete"]:
        raise ShardError(f"the shards at {directory} are incomplete (tokenization stopped before the end): run the same "
                         "moetrain tokenize command again to finish them")
    try:
        tokenizer = load_tokenizer(directory / TOKENIZER_DIR)
    except TokenizerError as error:
        raise ShardError(f"the shards' tokenizer: {error}") from None
    if tokenizer.sha256 != metadata["tokenizer_sha256"]:
        raise ShardError(f"{directory / TOKENIZER_DIR} is not the tokenizer that wrote the shards (sha256 "
                         f"{tokenizer.sha256[:12]}... instead of {metadata['tokenizer_sha256'][:12]}...): restore it")
    arrays = []
    itemsize = np.dtype(metadata["dtype"]).itemsize
    for shard in metadata["shards"]:
        file = directory / shard["file"]
        size = file.stat().st_size if file.is_file() else None
        if size != shard["tokens"] * itemsize:
            raise ShardError(f"{file} is {'missing' if size is None else f'{size} bytes'}, not the "
                             f"{shard['tokens'] * itemsize} bytes tokens.json records: the shards are damaged; "
                             "tokenize the corpus again")
        arrays.append(np.memmap(file, dtype=metadata["dtype"], mode="r") if size else np.zeros(0, metadata["dtype"]))
    return Shards(directory, metadata, ShardedTokens(arrays), tokenizer)


# ---- writing -------------------------------------------------------------------------------------
def corpus_sources(corpus: Path) -> tuple[Path, list[Path]]:
    """(root, text files in order) of a corpus file or directory (module doc)."""

    if corpus.is_file():
        if suffix(corpus) not in TEXT_SUFFIXES:
            raise ShardError(f"{corpus}: not a text file of the supported kinds {TEXT_SUFFIXES}")
        return corpus.parent, [corpus]
    if not corpus.is_dir():
        raise ShardError(f"{corpus} does not exist: give a text file or a directory of them {TEXT_SUFFIXES}")
    files = sorted((p for p in corpus.rglob("*") if p.is_file() and suffix(p) in TEXT_SUFFIXES),
                   key=lambda p: p.relative_to(corpus).as_posix())
    if not files:
        raise ShardError(f"{corpus} holds no text file {TEXT_SUFFIXES}")
    return corpus, files


def _chunks(files: list[Path], text_key: str, shard_bytes: int):
    """(documents, UTF-8 bytes, SHA-256 of the text) of each shard in order (module doc)."""

    texts, size, digest = [], 0, hashlib.sha256()
    for file in files:
        for document in documents(file, text_key):
            encoded = document.encode("utf-8")
            digest.update(len(encoded).to_bytes(8, "little"))
            digest.update(encoded)
            texts.append(document)
            size += len(encoded)
            if size >= shard_bytes:
                yield texts, size, digest.hexdigest()
                texts, size, digest = [], 0, hashlib.sha256()
    if texts:
        yield texts, size, digest.hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(2**24):
            digest.update(block)
    return digest.hexdigest()


def encode_shard(tokenizer: Tokenizer, index: int, texts: list[str], directory: Path, dtype: str) -> dict:
    """Encode one shard's documents (each followed by end-of-text) and write its two files
    (through temporary names, so that a file under its own name is whole); its record."""
    pieces, lengths, eos = [], [], np.array([tokenizer.eos_id], dtype=dtype)
    begin = 0
    while begin < len(texts):
        # Batches of about ENCODE_BATCH_BYTES of text: the encoder's per-token objects stay small.
        end, size = begin, 0
        while end < len(texts) and (end == begin or size < ENCODE_BATCH_BYTES):
            size += len(texts[end])
            end += 1
        for ids in tokenizer.encode_batch(texts[begin:end]):
            pieces += [np.asarray(ids, dtype=dtype), eos]
            lengths.append(len(ids) + 1)
        begin = end
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    name = f"shard_{index:05d}"
    data = tokens.tobytes()
    for file, write in ((f"{name}.bin", lambda handle: handle.write(data)),
                        (f"{name}.docs.npy", lambda handle: np.save(handle, np.cumsum(lengths, dtype=np.int64)))):
        partial = directory / f"{file}.tmp"
        with open(partial, "wb") as handle:
            write(handle)
        os.replace(partial, directory / file)
    return {"file": f"{name}.bin", "documents_file": f"{name}.docs.npy", "tokens": len(tokens),
            "documents": len(texts), "max_id": int(tokens.max()) if len(tokens) else -1,
            "sha256": hashlib.sha256(data).hexdigest()}


_WORKER: dict = {}


def _start_worker(tokenizer_path: str) -> None:
    _WORKER["tokenizer"] = load_tokenizer(tokenizer_path)


def _worker_encode(index: int, texts: list[str], directory: str, dtype: str) -> dict:
    return encode_shard(_WORKER["tokenizer"], index, texts, Path(directory), dtype)


def _write_metadata(directory: Path, metadata: dict) -> None:
    partial = directory / f"{METADATA}.tmp"
    partial.write_text(json.dumps(metadata, indent=1))
    os.replace(partial, directory / METADATA)


def _check_resumable(out: Path, existing: dict, metadata: dict) -> None:
    """A re-run continues only what the same command started."""
    for key, what in (("tokenizer_sha256", "another tokenizer"), ("sources", "another corpus (other files or sizes)"),
                      ("text_key", "another text_key"), ("shard_bytes", "another shard size"), ("dtype", "another dtype")):
        if existing.get(key) != metadata[key]:
            raise ShardError(f"{out} holds shards written from {what}: give a new OUT folder, or delete {out} to "
                             "tokenize again")


def tokenize_corpus(corpus: str | Path, out: str | Path, tokenizer: str | Path, workers: int = 1,
                    text_key: str = "text", shard_bytes: int = SHARD_BYTES, progress: bool = True) -> dict:
    """Tokenize `corpus` into shards in `out` (module doc); returns tokens.json's content plus the
    text throughput of this call ("seconds", "text_bytes_encoded"). Raises ShardError."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ShardError(f"--workers must be an integer >= 1, got {workers!r}")
    if shard_bytes < 1:
        raise ShardError(f"shard_bytes must be >= 1, got {shard_bytes}")
    corpus, out = Path(corpus), Path(out)
    try:
        encoder = load_tokenizer(tokenizer)
    except TokenizerError as error:
        raise ShardError(str(error).replace("tokenizer=", "--tokenizer ")) from None
    root, files = corpus_sources(corpus)
    dtype = token_dtype(encoder.vocab_size)
    metadata = {"format": FORMAT, "version": VERSION, "complete": False, "tokenizer_sha256": encoder.sha256,
                "vocab_size": encoder.vocab_size, "eos_id": encoder.eos_id, "dtype": dtype, "text_key": text_key,
                "shard_bytes": shard_bytes,
                "sources": [{"file": p.relative_to(root).as_posix(), "bytes": p.stat().st_size} for p in files],
                "documents": 0, "tokens": 0, "shards": []}
    recorded: list[dict] = []
    if out.exists() and not out.is_dir():
        raise ShardError(f"{out} is a file: give a new or empty folder as OUT")
    if is_shard_directory(out):
        existing = _read_metadata(out)
        _check_resumable(out, existing, metadata)
        recorded = existing["shards"]
    elif out.is_dir() and any(out.iterdir()):
        raise ShardError(f"{out} is not empty and holds no {METADATA}: give a new or empty folder as OUT")
    out.mkdir(parents=True, exist_ok=True)
    encoder.save(out / TOKENIZER_DIR)
    if not recorded:  # from here on, a re-run continues this one (even before its first shard)
        _write_metadata(out, metadata)
    total = None if any(p.name.endswith(".gz") for p in files) else sum(source["bytes"] for source in metadata["sources"])
    bar = tqdm(total=total, desc="tokenize", unit="B", unit_scale=True, dynamic_ncols=True, disable=not progress)
    # fork where there is one: the workers start at once, and the main module is not imported again.
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    pool = context.Pool(workers, _start_worker, (str(tokenizer),)) if workers > 1 else None
    pending: deque = deque()
    started, encoded_bytes = time.perf_counter(), 0

    def finish(record: dict, text_bytes: int, text_sha256: str) -> None:
        metadata["shards"].append({**record, "text_bytes": text_bytes, "text_sha256": text_sha256})
        metadata["documents"] += record["documents"]
        metadata["tokens"] += record["tokens"]
        if len(metadata["shards"]) > len(recorded):  # the recorded ones stay as they are until then
            _write_metadata(out, metadata)
        bar.update(text_bytes)

    try:
        for index, (texts, text_bytes, text_sha256) in enumerate(_chunks(files, text_key, shard_bytes)):
            if index < len(recorded):
                _verify_recorded(out, recorded[index], text_sha256)
                pending.append((None, recorded[index], text_bytes, text_sha256))
            elif pool is None:
                encoded_bytes += text_bytes
                pending.append((None, encode_shard(encoder, index, texts, out, dtype), text_bytes, text_sha256))
            else:
                encoded_bytes += text_bytes
                job = pool.apply_async(_worker_encode, (index, texts, str(out), dtype))
                pending.append((job, None, text_bytes, text_sha256))
            # In order, and at most one shard per worker waiting: memory stays bounded.
            while pending and (pending[0][0] is None or len(pending) > workers + 1):
                job, record, text_bytes, text_sha256 = pending.popleft()
                finish(record if job is None else job.get(), text_bytes, text_sha256)
        while pending:
            job, record, text_bytes, text_sha256 = pending.popleft()
            finish(record if job is None else job.get(), text_bytes, text_sha256)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    if len(metadata["shards"]) < len(recorded):
        raise ShardError(f"{out} records {len(recorded)} shards but the corpus makes {len(metadata['shards'])}: the "
                         f"corpus changed; give a new OUT folder, or delete {out} to tokenize again")
    metadata["complete"] = True
    _write_metadata(out, metadata)
    return {**metadata, "seconds": time.perf_counter() - started, "text_bytes_encoded": encoded_bytes}


def _verify_recorded(out: Path, record: dict, text_sha256: str) -> None:
    """A shard written by an earlier run: made from this text, and its file unchanged since."""
    if record.get("text_sha256") != text_sha256:
        raise ShardError(f"{out / record['file']} was made from other text than the corpus holds now: the corpus "
                         f"changed; give a new OUT folder, or delete {out} to tokenize again")
    file = out / record["file"]
    if not file.is_file() or not (out / record["documents_file"]).is_file() or _file_sha256(file) != record["sha256"]:
        raise ShardError(f"{file} is missing or differs from its SHA-256 in {METADATA}: the shards were changed; delete "
                         f"{out} and tokenize again")
