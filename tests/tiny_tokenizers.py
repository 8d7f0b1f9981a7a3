"""Tiny tokenizers and corpora made by the tests themselves (nothing is downloaded): a byte-level
BPE trained by `tokenizers` on a few hundred random sentences, saved in the Hugging Face layout."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

WORDS = ("the of and to in is was for on that with as by at from his her an it über café naïve 東京 ✓ "
         "model expert token router layer").split()


def sentences(count: int, seed: int = 0) -> list[str]:
    generator = random.Random(seed)
    return [" ".join(generator.choice(WORDS) for _ in range(generator.randint(3, 40))) + "." for _ in range(count)]


def train_tokenizer(directory: Path, vocab_size: int = 400, seed: int = 0, eos: str = "<|endoftext|>",
                    config: bool = True) -> Path:
    """A byte-level BPE (GPT-2 style) in `directory`: tokenizer.json, and tokenizer_config.json naming
    its end-of-text token when `config`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos, "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(sentences(300, seed), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if config:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "model_max_length": 64}))
        (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": eos}}))
    return directory


def write_text_corpus(folder: Path, seed: int = 0) -> list[str]:
    """A corpus of every kind `moetrain tokenize` reads, in a nested folder; returns its documents
    in the documented order (files sorted by relative path, documents in file order)."""
    texts = sentences(120, seed)
    (folder / "b").mkdir(parents=True)
    (folder / "a.txt").write_text(texts[0], encoding="utf-8")
    (folder / "b" / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts[1:60]) + "\n\n",
                                          encoding="utf-8")
    with gzip.open(folder / "b" / "d.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts[60:])))
    (folder / "notes.md").write_text("not part of the corpus")
    return texts
