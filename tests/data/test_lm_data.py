"""Language-modelling data: byte tokenizer, corpus formats, packing, validation split, the
synthetic Markov-chain task and its loss floor."""

import json
import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from moetrain.data.text import ByteTokenizer, PackedSequences, synthetic_lm, text


def random_text(rng, words):
    vocabulary = ["moe", "expert", "routing", "tökens", "naïve", "東京", "🙂", "capacity"]
    return " ".join(vocabulary[i] for i in rng.integers(0, len(vocabulary), words))


def test_byte_tokenizer_round_trips_unicode():
    text_value = random_text(np.random.default_rng(0), 50)
    ids = ByteTokenizer().encode(text_value)
    assert ids == list(text_value.encode("utf-8")) and max(ids) < 256
    assert ByteTokenizer().decode(ids + [ByteTokenizer.eos_id]) == text_value


def all_pairs(data_set):
    inputs, targets = zip(*(data_set[i] for i in range(len(data_set))))
    return torch.stack(inputs), torch.stack(targets)


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_text_corpus_is_packed_from_the_byte_stream(tmp_path, kind):
    rng = np.random.default_rng(1)
    documents = [random_text(rng, int(n)) for n in rng.integers(20, 60, 6)]
    if kind == "txt":
        for i, document in enumerate(documents):
            (tmp_path / f"doc{i}.txt").write_text(document, encoding="utf-8")
    else:
        lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(documents)]
        (tmp_path / "corpus.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    # Expected stream, built independently: UTF-8 bytes of each document, then 256.
    stream = [b for d in documents for b in list(d.encode("utf-8")) + [256]]
    data = text(str(tmp_path), seq_len=16, eval_fraction=0.2)
    assert data.task == "language_modeling" and data.model_inputs == {"vocab_size": 257, "max_seq_len": 16}
    inputs, targets = all_pairs(data.train_set)
    for i in range(len(inputs)):
        assert inputs[i].tolist() == stream[16 * i : 16 * i + 16]
        assert targets[i].tolist() == stream[16 * i + 1 : 16 * i + 17]
    # The validation sequences come from the tail of the stream, after the training part.
    eval_inputs, _ = all_pairs(data.eval_set)
    split = len(stream) - max(int(len(stream) * 0.2), 17)
    assert eval_inputs[0].tolist() == stream[split : split + 16]
    assert len(data.train_set) == (split - 1) // 16


@pytest.mark.parametrize("suffix, dtype", [(".npy", np.int32), (".bin", np.uint16)])
def test_token_files_are_read_as_they_are(tmp_path, suffix, dtype):
    tokens = np.random.default_rng(2).integers(0, 1000, 500).astype(dtype)
    path = tmp_path / f"tokens{suffix}"
    np.save(path, tokens) if suffix == ".npy" else tokens.tofile(path)
    data = text(str(path), seq_len=32, eval_fraction=0.1, vocab_size=1000)
    inputs, targets = data.train_set[3]
    assert inputs.tolist() == tokens[96:128].tolist() and targets.tolist() == tokens[97:129].tolist()
    assert inputs.dtype == torch.int64
    with pytest.raises(ValueError, match="vocab_size=None: token files"):
        text(str(path), seq_len=32)
    with pytest.raises(ValueError, match=r"token id \d+ .* >= vocab_size=100"):
        text(str(path), seq_len=32, vocab_size=100)


def test_bad_corpora_are_explained(tmp_path):
    with pytest.raises(ValueError, match="path=None: give the corpus"):
        text(None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        text(str(tmp_path / "missing"))
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(ValueError, match="too few for one training and one validation sequence"):
        text(str(tmp_path / "short.txt"), seq_len=64)
    (tmp_path / "bad.jsonl").write_text('{"content": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected a JSON object with a string under text_key='text'"):
        text(str(tmp_path / "bad.jsonl"))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("x" * 100)
    np.save(mixed / "b.npy", np.arange(10))
    with pytest.raises(ValueError, match="mixes text"):
        text(str(mixed))


def test_packed_sequences_bounds():
    data_set = PackedSequences(np.arange(33), seq_len=8)
    assert len(data_set) == 4 and data_set[3][1].tolist() == list(range(25, 33))
    with pytest.raises(IndexError):
        data_set[4]


def test_synthetic_lm_has_the_stated_loss_floor():
    data = synthetic_lm(vocab_size=16, seq_len=32, branching=3, train_size=2000, eval_size=10, seed=3)
    inputs, targets = data.train_set.tensors
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one
    # Count successors: each token has exactly `branching` of them, about equally often, so the
    # conditional entropy (the best achievable loss) is ln(branching).
    counts = defaultdict(lambda: defaultdict(int))
    for previous, following in zip(inputs.flatten().tolist(), targets.flatten().tolist()):
        counts[previous][following] += 1
    assert all(len(successors) == 3 for successors in counts.values())
    total = sum(sum(s.values()) for s in counts.values())
    entropy = -sum(n / total * math.log(n / sum(s.values())) for s in counts.values() for n in s.values())
    assert entropy == pytest.approx(math.log(3), abs=0.01)
    # The same seed gives the same task; another seed another one.
    again = synthetic_lm(vocab_size=16, seq_len=32, branching=3, train_size=2000, eval_size=10, seed=3)
    assert torch.equal(again.train_set.tensors[0], inputs)
    other = synthetic_lm(vocab_size=16, seq_len=32, branching=3, train_size=2000, eval_size=10, seed=4)
    assert not torch.equal(other.train_set.tensors[0], inputs)


def test_faults_in_text_files_name_the_file_and_its_line(tmp_path):
    rng = np.random.default_rng()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(random_text(rng, 40))
    lines = [random_text(rng, 5) for _ in range(int(rng.integers(3, 30)))]
    bad_line = int(rng.integers(1, len(lines) + 1))  # 1-based, as editors count
    raw = [line.encode("utf-8") for line in lines]
    raw[bad_line - 1] += b" \xff"  # never valid UTF-8
    (corpus / "b.txt").write_bytes(b"\n".join(raw))
    offset = len(b"\n".join(raw[:bad_line])) - 1  # the 0xff byte
    with pytest.raises(ValueError, match=rf"corpus/b.txt:{bad_line}: not UTF-8 text \(byte 0xff at offset {offset}\)"):
        text(str(corpus))

    records = [json.dumps({"text": random_text(rng, 4)}) for _ in range(int(rng.integers(150, 250)))]
    broken = int(rng.integers(1, len(records) + 1))
    records[broken - 1] = records[broken - 1][:-1] + ", }"  # a trailing comma: a name is expected there
    column = len(records[broken - 1])  # the "}" closes the line
    (tmp_path / "docs.jsonl").write_text("\n".join(records) + "\n")
    with pytest.raises(ValueError, match=rf"docs.jsonl:{broken}: invalid JSON at column {column}"):
        text(str(tmp_path / "docs.jsonl"))


@pytest.mark.parametrize("suffix", [".npy", ".bin"])
def test_token_ids_outside_the_vocabulary_name_the_file_and_position(tmp_path, suffix):
    rng = np.random.default_rng()
    folder = tmp_path / "tokens"
    folder.mkdir()
    good = rng.integers(0, 100, 500).astype(np.int32)
    bad = rng.integers(0, 100, 500).astype(np.int32)
    position = int(rng.integers(0, 500))
    write = (lambda path, ids: np.save(path, ids)) if suffix == ".npy" else (lambda path, ids: ids.tofile(path))
    write(folder / f"a{suffix}", good)
    for value, message in ((-int(rng.integers(1, 50)), "is negative"), (100 + int(rng.integers(0, 50)), ">= vocab_size=100")):
        bad_ids = bad.copy()
        bad_ids[position] = value
        write(folder / f"b{suffix}", bad_ids)
        with pytest.raises(ValueError, match=rf"tokens/b{suffix}: token id {value} .*{message}") as error:
            text(str(folder), seq_len=16, vocab_size=100, token_dtype="int32")
        assert f"position {position}" in str(error.value)
    (folder / f"b{suffix}").unlink()
    if suffix == ".bin":  # a size that is no whole number of ids: the wrong token_dtype
        (folder / "a.bin").write_bytes(b"\x01\x02\x03")
        with pytest.raises(ValueError, match="a.bin: 3 bytes is not a whole number of int32 token ids"):
            text(str(folder), seq_len=16, vocab_size=100, token_dtype="int32")


def test_calibration_and_evaluation_forward_the_document_ids_a_batch_carries():
    """forward_batch (quantized evaluation's calibration, moetrain eval's) gives the model what the
    trainer gives it: a document-masked batch's ids reach the model, a plain batch adds nothing."""
    from moetrain.data.base import forward_batch

    seen = []

    class Recorder(torch.nn.Module):
        def forward(self, tokens_BT, **arguments):
            seen.append((tokens_BT, arguments))
            return tokens_BT

    inputs, targets = torch.randint(0, 9, (2, 5)), torch.randint(0, 9, (2, 5))
    document_ids = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])
    forward_batch(Recorder(), (inputs, targets, {"document_ids": document_ids}), torch.device("cpu"))
    forward_batch(Recorder(), (inputs, targets), torch.device("cpu"))
    assert torch.equal(seen[0][0], inputs) and torch.equal(seen[0][1]["document_ids"], document_ids)
    assert seen[1][1] == {}
