"""Real tokenizers and token shards: `data.tokenizer=PATH`, `moetrain tokenize`, data=text on shards,
and what a run records of its tokenizer. Every tokenizer is a tiny BPE trained here
(tiny_tokenizers.py); the references are the `tokenizers` package itself and streams built by hand."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_tokenizers import sentences, train_tokenizer, write_text_corpus

from moetrain import cli
from moetrain.data.shards import ShardError, ShardedTokens, open_shards, token_dtype, tokenize_corpus
from moetrain.data.text import PackedSequences, text
from moetrain.data.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer
from moetrain.evaluate import evaluate

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tok")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    folder = tmp_path_factory.mktemp("corpus") / "corpus"
    return folder, write_text_corpus(folder)


def reference_stream(tokenizer_dir: Path, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Each document's ids by tokenizers itself, each followed by the end-of-text id; document ends."""
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = backend.token_to_id("<|endoftext|>")
    pieces = [backend.encode(t, add_special_tokens=False).ids + [eos] for t in texts]
    return np.array([i for piece in pieces for i in piece]), np.cumsum([len(piece) for piece in pieces])


# ---- the tokenizer ----------------------------------------------------------------------------------
def test_a_tokenizer_directory_is_read_and_saved_verbatim(tokenizer_dir, tmp_path):
    tokenizer = load_tokenizer(tokenizer_dir)
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    text_value = sentences(1, seed=5)[0]
    assert tokenizer.encode(text_value) == backend.encode(text_value, add_special_tokens=False).ids
    assert tokenizer.decode(tokenizer.encode(text_value)) == text_value
    assert tokenizer.vocab_size == backend.get_vocab_size() and tokenizer.eos_id == backend.token_to_id("<|endoftext|>")
    assert tokenizer.sha256 == hashlib.sha256((tokenizer_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert load_tokenizer(tokenizer_dir / "tokenizer.json").sha256 == tokenizer.sha256  # the file itself
    saved = tokenizer.save(tmp_path / "copy")
    names = sorted(p.name for p in saved.iterdir())
    assert names == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (saved / name).read_bytes() == (tokenizer_dir / name).read_bytes()


def test_the_end_of_text_token_comes_from_the_config_first(tmp_path):
    # Both tokens exist; the config names the second: it wins over the name-based guess.
    directory = train_tokenizer(tmp_path / "tok", eos="</s>", config=False)
    assert load_tokenizer(directory).eos_id == tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")).token_to_id("</s>")
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    assert load_tokenizer(directory).eos_id == 1  # <pad>: the second special token


def test_token_bytes_add_up_to_the_text(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    lengths = tokenizer.byte_lengths()
    for text_value in sentences(20, seed=3):
        ids = tokenizer.encode(text_value)
        assert lengths[ids].sum() == len(text_value.encode("utf-8"))
    assert lengths[tokenizer.eos_id] == 0
    assert ByteTokenizer().byte_lengths().sum() == 256


def test_bad_tokenizers_are_explained(tmp_path, tokenizer_dir):
    with pytest.raises(TokenizerError, match="does not exist: give a tokenizer.json"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="holds no tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "broken.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerError, match="is not a readable tokenizer.json"):
        load_tokenizer(tmp_path / "broken.json")
    no_eos = train_tokenizer(tmp_path / "no_eos", eos="<unk>", config=False)
    with pytest.raises(TokenizerError, match="no end-of-text token"):
        load_tokenizer(no_eos)
    bad_config = tmp_path / "bad_config"
    shutil.copytree(tokenizer_dir, bad_config)
    (bad_config / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json is not valid JSON"):
        load_tokenizer(bad_config)


# ---- moetrain tokenize --------------------------------------------------------------------------------
def test_shards_hold_the_reference_stream_whatever_the_worker_count(tokenizer_dir, corpus, tmp_path):
    folder, texts = corpus
    written = {}
    for workers in (1, 2):
        result = tokenize_corpus(folder, tmp_path / f"w{workers}", tokenizer_dir, workers=workers, shard_bytes=700,
                                 progress=False)
        written[workers] = {p.name: p.read_bytes() for p in (tmp_path / f"w{workers}").rglob("*") if p.is_file()}
    assert written[1] == written[2]  # every file, tokens.json included
    assert len(result["shards"]) > 3 and result["complete"] and result["dtype"] == "uint16"
    stream, ends = reference_stream(tokenizer_dir, texts)
    shards = open_shards(tmp_path / "w1")
    assert np.array_equal(np.asarray(shards.tokens), stream)
    assert np.array_equal(shards.document_ends, ends)
    assert result["documents"] == len(texts) and result["tokens"] == len(stream)
    assert result["tokenizer_sha256"] == load_tokenizer(tokenizer_dir).sha256
    assert result["eos_id"] == load_tokenizer(tokenizer_dir).eos_id and result["vocab_size"] == load_tokenizer(tokenizer_dir).vocab_size > 300
    assert [s["file"] for s in result["sources"]] == ["a.txt", "b/c.jsonl", "b/d.jsonl.gz"]
    assert all(isinstance(array, np.memmap) for array in shards.tokens.arrays)
    assert token_dtype(2**16) == "uint16" and token_dtype(2**16 + 1) == "uint32"


def test_an_interrupted_tokenization_continues_and_a_finished_one_verifies(tokenizer_dir, corpus, tmp_path):
    folder, _ = corpus
    out = tmp_path / "out"
    tokenize_corpus(folder, out, tokenizer_dir, shard_bytes=700, progress=False)
    finished = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    # As an interruption leaves it: the last two shards unrecorded, one of them half written.
    metadata = json.loads((out / "tokens.json").read_text())
    dropped = metadata["shards"][-2:]
    metadata["shards"], metadata["complete"] = metadata["shards"][:-2], False
    (out / "tokens.json").write_text(json.dumps(metadata))
    (out / dropped[0]["file"]).write_bytes(b"\0\1")
    (out / dropped[1]["file"]).unlink()
    with pytest.raises(ShardError, match="incomplete"):
        open_shards(out)
    resumed = tokenize_corpus(folder, out, tokenizer_dir, shard_bytes=700, progress=False)
    assert resumed["text_bytes_encoded"] == sum(shard["text_bytes"] for shard in dropped)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == finished
    assert tokenize_corpus(folder, out, tokenizer_dir, shard_bytes=700, progress=False)["text_bytes_encoded"] == 0

    # Never mixed: another tokenizer, another shard size, a changed corpus, a damaged shard.
    other = train_tokenizer(tmp_path / "other", vocab_size=300, seed=1)
    with pytest.raises(ShardError, match="another tokenizer"):
        tokenize_corpus(folder, out, other, shard_bytes=700, progress=False)
    with pytest.raises(ShardError, match="another shard size"):
        tokenize_corpus(folder, out, tokenizer_dir, shard_bytes=900, progress=False)
    changed = tmp_path / "changed"
    shutil.copytree(folder, changed)
    (changed / "a.txt").write_text((folder / "a.txt").read_text()[::-1])  # same size, other text
    with pytest.raises(ShardError, match="other text than the corpus holds now"):
        tokenize_corpus(changed, out, tokenizer_dir, shard_bytes=700, progress=False)
    first = out / metadata["shards"][0]["file"]
    first.write_bytes(bytes(reversed(first.read_bytes())))
    with pytest.raises(ShardError, match="differs from its SHA-256"):
        tokenize_corpus(folder, out, tokenizer_dir, shard_bytes=700, progress=False)
    # Interrupted before its first shard was recorded: tokens.json exists, a re-run starts it over.
    started = tmp_path / "started"
    tokenize_corpus(folder, started, tokenizer_dir, shard_bytes=700, progress=False)
    metadata = json.loads((started / "tokens.json").read_text())
    (started / "tokens.json").write_text(json.dumps({**metadata, "shards": [], "complete": False}))
    tokenize_corpus(folder, started, tokenizer_dir, shard_bytes=700, progress=False)
    assert {p.name: p.read_bytes() for p in started.iterdir() if p.is_file()} == finished
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ShardError, match="not empty and holds no tokens.json"):
        tokenize_corpus(folder, tmp_path / "busy", tokenizer_dir, progress=False)


def test_the_command_tokenizes_and_refuses_bad_input_in_one_line(tokenizer_dir, corpus, tmp_path, monkeypatch, capsys):
    folder, texts = corpus

    def command(*argv):
        monkeypatch.setattr(sys, "argv", ["moetrain", "tokenize", *argv])
        try:
            cli.main()
            return 0
        except SystemExit as exit_request:
            return exit_request.code

    assert command(str(folder), str(tmp_path / "out"), "--tokenizer", str(tokenizer_dir), "--workers", "2") == 0
    captured = capsys.readouterr()
    assert f"{len(texts)} documents" in captured.out
    assert "1 shard(s) kept fewer than --workers=2 busy" in captured.err  # a small corpus is one shard
    assert np.array_equal(np.asarray(open_shards(tmp_path / "out").tokens), reference_stream(tokenizer_dir, texts)[0])
    for argv, message in [((str(folder), str(tmp_path / "new"), "--tokenizer", str(tmp_path / "none")), "does not exist"),
                          ((str(tmp_path / "nothing"), str(tmp_path / "new"), "--tokenizer", str(tokenizer_dir)),
                           "does not exist"),
                          ((str(folder), str(tmp_path / "new"), "--tokenizer", str(tokenizer_dir), "--workers", "0"),
                           "--workers must be an integer >= 1")]:
        assert command(*argv) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and error.startswith("moetrain: error: ") and message in error
        assert not (tmp_path / "new").exists()


# ---- data=text on shards and on text with a tokenizer -------------------------------------------------
def test_text_data_trains_from_shards_memory_mapped(tokenizer_dir, corpus, tmp_path):
    folder, texts = corpus
    tokenize_corpus(folder, tmp_path / "out", tokenizer_dir, shard_bytes=700, progress=False)
    stream, ends = reference_stream(tokenizer_dir, texts)
    data = text(str(tmp_path / "out"), seq_len=16, batch_size=2, eval_fraction=0.2, document_mask=True)
    assert isinstance(data.train_set.tokens, ShardedTokens) and data.model_inputs["vocab_size"] == data.tokenizer.vocab_size
    assert data.tokenizer.sha256 == load_tokenizer(tokenizer_dir).sha256
    split = len(data.train_set.tokens)
    for dataset, start in ((data.train_set, 0), (data.eval_set, split)):
        for index in (0, 1, len(dataset) - 1):
            inputs, targets, extra = dataset[index]
            begin = start + index * 16
            assert inputs.tolist() == stream[begin : begin + 16].tolist()
            assert targets.tolist() == stream[begin + 1 : begin + 17].tolist()
            # The document of each position, counted from the window's first: by a loop over ends.
            documents = [sum(1 for end in ends if end <= position) for position in range(begin, begin + 16)]
            assert extra["document_ids"].tolist() == [d - documents[0] for d in documents]
    # Text through data.tokenizer, in memory (a directory's own files: b/ holds the .jsonl and .jsonl.gz).
    in_memory = text(str(folder / "b"), seq_len=16, batch_size=2, eval_fraction=0.2, tokenizer=str(tokenizer_dir))
    assert in_memory.train_set[3][0].tolist() == reference_stream(tokenizer_dir, texts[1:])[0][48:64].tolist()
    assert len(in_memory.train_set[3]) == 2  # no document ids without document_mask


def test_shards_of_another_tokenizer_and_too_small_vocabularies_are_refused(tokenizer_dir, corpus, tmp_path):
    folder, _ = corpus
    tokenize_corpus(folder, tmp_path / "out", tokenizer_dir, progress=False)
    other = train_tokenizer(tmp_path / "other", vocab_size=300, seed=1)
    with pytest.raises(ValueError, match="is not the tokenizer that wrote the shards"):
        text(str(tmp_path / "out"), seq_len=16, tokenizer=str(other))
    with pytest.raises(ValueError, match="smaller than the tokenizer's vocabulary"):
        text(str(folder), seq_len=16, tokenizer=str(tokenizer_dir), vocab_size=260)
    assert text(str(tmp_path / "out"), seq_len=16, tokenizer=str(tokenizer_dir)).model_inputs["vocab_size"] == load_tokenizer(tokenizer_dir).vocab_size
    with pytest.raises(ValueError, match="document_mask=True needs document boundaries"):
        np.save(tmp_path / "ids.npy", np.arange(100) % 7)
        text(str(tmp_path / "ids.npy"), seq_len=8, vocab_size=7, document_mask=True)


# ---- bits per byte -------------------------------------------------------------------------------------
class _Logits(torch.nn.Module):
    """A stand-in language model: fixed random logits per position, whatever the input."""

    def __init__(self, vocab_size: int, seq_len: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(seq_len, vocab_size, generator=torch.Generator().manual_seed(4)))

    def forward(self, tokens_BT):
        return self.table[None, : tokens_BT.shape[1]].expand(tokens_BT.shape[0], -1, -1)


def test_bits_per_byte_is_text_nats_over_text_bytes(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    texts = sentences(6, seed=9)
    stream = np.array([i for t in texts for i in tokenizer.encode(t) + [tokenizer.eos_id]])
    dataset = PackedSequences(stream, seq_len=12)
    model = _Logits(tokenizer.vocab_size, 12)
    loader = torch.utils.data.DataLoader(dataset, batch_size=3)
    metrics = evaluate(model, loader, "language_modeling", token_bytes=torch.as_tensor(tokenizer.byte_lengths()),
                       progress=False)
    # By hand: every scored target's cross-entropy; the text's bytes from decoding the targets, which
    # are one contiguous run of the stream (windows do not overlap).
    targets = torch.stack([dataset[i][1] for i in range(len(dataset))])
    nats = F.cross_entropy(model.table.detach().expand(len(dataset), -1, -1).flatten(0, 1), targets.flatten(), reduction="none")
    text_targets = targets.flatten() != tokenizer.eos_id
    text_bytes = len(tokenizer.decode(targets.flatten().tolist()).encode("utf-8"))
    expected = float(nats[text_targets].sum()) / text_bytes / math.log(2)
    assert metrics["eval/bits_per_byte"] == pytest.approx(expected, rel=1e-6)
    assert metrics["eval/loss"] == pytest.approx(float(nats.mean()), rel=1e-6)
    assert metrics["eval/perplexity"] == pytest.approx(math.exp(float(nats.mean())), rel=1e-6)
