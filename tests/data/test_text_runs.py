"""A language model trained through the command on real tokenizers: text with data.tokenizer, and
token shards of `moetrain tokenize` (document mask on). The run directory records its tokenizer;
`moetrain generate` and `moetrain eval` use it; bad input ends in one line before any run
directory exists; resuming on shards continues at the exact token position."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from tiny_tokenizers import train_tokenizer, write_text_corpus

from moetrain import cli
from moetrain.data.shards import tokenize_corpus
from moetrain.data.tokenizer import load_tokenizer
from moetrain.evaluate import evaluate_run
from moetrain.run import load_run
from moetrain.train import checkpoint

pytest.importorskip("tokenizers")

TINY_LM = ["+recipe=qwen3_moe_lm", "data=text", "data.seq_len=16", "data.batch_size=4", "data.eval_batch_size=4",
           "data.eval_fraction=0.2", "trainer.max_steps=3", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0",
           "trainer.eval_every=0", "trainer.progress_bar=false", "logger=none", "hydra/job_logging=none",
           "hydra/hydra_logging=none"]


def moetrain(argv: list[str], monkeypatch) -> int:
    """`moetrain ARGV` in this process; its exit code."""
    monkeypatch.setattr(sys, "argv", ["moetrain", *argv])
    try:
        cli.main()
    except SystemExit as exit_request:
        return exit_request.code
    return 0


def last_checkpoint(run_dir: Path) -> Path:
    return checkpoint.checkpoints(run_dir / checkpoint.CHECKPOINT_DIR)[-1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("text_runs")
    tokenizer_dir = train_tokenizer(root / "tok")
    write_text_corpus(root / "corpus")
    tokenize_corpus(root / "corpus", root / "shards", tokenizer_dir, shard_bytes=900, progress=False)
    with pytest.MonkeyPatch.context() as patch:
        assert moetrain([*TINY_LM, f"data.path={root / 'corpus' / 'b'}", f"data.tokenizer={tokenizer_dir}",
                         f"hydra.run.dir={root / 'text_run'}"], patch) == 0
        assert moetrain([*TINY_LM, f"data.path={root / 'shards'}", "data.document_mask=true",
                         f"hydra.run.dir={root / 'shard_run'}"], patch) == 0
    return root


def test_a_run_records_its_tokenizer(setup):
    source = load_tokenizer(setup / "tok")
    for name in ("text_run", "shard_run"):
        recorded = setup / name / "tokenizer"
        assert sorted(p.name for p in recorded.iterdir()) == sorted(source.files)
        for file, content in source.files.items():
            assert (recorded / file).read_bytes() == content
        state = checkpoint.load(last_checkpoint(setup / name))
        assert state["config"]["tokenizer"]["sha256"] == source.sha256
        assert state["config"]["tokenizer"]["eos_id"] == source.eos_id
        run = load_run(setup / name)
        assert run.tokenizer.sha256 == source.sha256 and run.model.config.vocab_size == source.vocab_size


def test_generate_encodes_and_decodes_with_the_run_tokenizer(setup, monkeypatch, capsys):
    run = load_run(setup / "text_run")
    tokenizer = run.tokenizer
    prompt = "the expert router"
    tokens = [tokenizer.eos_id] + tokenizer.encode(prompt)
    generated = []
    with torch.no_grad():  # greedy decoding by its definition
        for _ in range(12):
            token = int(run.model(torch.tensor([tokens[-16:]]))[0, -1].argmax())
            if token == tokenizer.eos_id:
                break
            tokens.append(token)
            generated.append(token)
    assert moetrain(["generate", str(setup / "text_run"), "--prompt", prompt, "--max-tokens", "12",
                     "--temperature", "0"], monkeypatch) == 0
    assert capsys.readouterr().out == tokenizer.decode(generated) + "\n"


def test_eval_reports_bits_per_byte_with_the_run_tokenizer(setup, monkeypatch, capsys):
    assert moetrain(["eval", str(setup / "shard_run")], monkeypatch) == 0
    printed = json.loads(capsys.readouterr().out)
    run = load_run(setup / "shard_run")
    lengths = torch.as_tensor(run.tokenizer.byte_lengths())
    nats = text_bytes = 0.0
    losses, count = 0.0, 0
    with torch.no_grad():
        for index in range(len(run.data.eval_set)):
            inputs, targets, extra = run.data.eval_set[index]
            logits = run.model(inputs[None], document_ids=extra["document_ids"][None])[0]
            loss_T = torch.nn.functional.cross_entropy(logits, targets, reduction="none").double()
            nats += float(loss_T[lengths[targets] > 0].sum())
            text_bytes += float(lengths[targets].sum())
            losses, count = losses + float(loss_T.sum()), count + len(targets)
    assert printed["eval/loss"] == pytest.approx(losses / count, rel=1e-5)
    assert printed["eval/perplexity"] == pytest.approx(math.exp(losses / count), rel=1e-5)
    assert printed["eval/bits_per_byte"] == pytest.approx(nats / text_bytes / math.log(2), rel=1e-5)


@pytest.mark.parametrize("case", ["missing", "corrupt", "other_shards", "vocabulary"])
def test_bad_tokenizer_input_is_one_line_before_any_run_directory(setup, case, tmp_path, monkeypatch, capsys):
    (tmp_path / "broken.json").write_text('{"model": {')
    other = train_tokenizer(tmp_path / "other", vocab_size=300, seed=2)
    overrides, message = {
        "missing": ([f"data.path={setup / 'corpus' / 'b'}", f"data.tokenizer={tmp_path / 'nothing'}"],
                    "data.tokenizer="),
        "corrupt": ([f"data.path={setup / 'corpus' / 'b'}", f"data.tokenizer={tmp_path / 'broken.json'}"],
                    "is not a readable tokenizer.json"),
        "other_shards": ([f"data.path={setup / 'shards'}", f"data.tokenizer={other}"],
                         "is not the tokenizer that wrote the shards"),
        "vocabulary": ([f"data.path={setup / 'shards'}", "+model.vocab_size=300"],
                       "more than model.vocab_size=300"),
    }[case]
    code = moetrain([*TINY_LM, *overrides, f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch)
    error = capsys.readouterr().err
    assert code == 2 and error.count("\n") == 1 and error.startswith("moetrain: error: "), error
    assert message in error
    assert not (tmp_path / "run").exists()


def test_a_run_on_shards_resumes_at_the_exact_token_position(setup, tmp_path, monkeypatch):
    """Four steps straight, and two steps then two more from the checkpoint: the same weights, and
    the stream position the checkpoint records is the next batch's. A constant learning rate, so
    that the two-step run's schedule is the first half of the four-step one's."""
    common = [*TINY_LM, f"data.path={setup / 'shards'}", "data.document_mask=true", "trainer.checkpoint_every=2",
              "optim.warmup_steps=0", "optim.min_lr_ratio=1.0"]
    assert moetrain([*common, "trainer.max_steps=4", f"hydra.run.dir={tmp_path / 'straight'}"], monkeypatch) == 0
    assert moetrain([*common, "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'resumed'}"], monkeypatch) == 0
    assert checkpoint.load(last_checkpoint(tmp_path / "resumed"))["data"] == {"epoch": 0, "position": 2}
    assert moetrain([*common, "trainer.max_steps=4", "trainer.resume=auto", f"hydra.run.dir={tmp_path / 'resumed'}"],
                    monkeypatch) == 0
    straight, resumed = checkpoint.load(last_checkpoint(tmp_path / "straight")), checkpoint.load(last_checkpoint(tmp_path / "resumed"))
    assert straight["step"] == resumed["step"] == 4
    assert straight["data"] == resumed["data"]
    for name, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name


def test_eval_on_data_of_another_tokenizer_is_refused(setup, tmp_path, monkeypatch, capsys):
    other = train_tokenizer(tmp_path / "other", vocab_size=300, seed=2)
    code = moetrain(["eval", str(setup / "text_run"), f"data.tokenizer={other}"], monkeypatch)
    error = capsys.readouterr().err
    assert code == 2 and "not by the run's tokenizer" in error and error.count("\n") == 1
    assert evaluate_run(load_run(setup / "text_run"), progress=False)["eval/bits_per_byte"] > 0


def test_a_run_loads_with_its_own_tokenizer_copy_once_the_original_is_gone(setup, tmp_path):
    moved = tmp_path / "text_run"
    shutil.copytree(setup / "text_run", moved)
    original = setup / "tok"
    hidden = tmp_path / "hidden_tok"
    original.rename(hidden)
    try:
        run = load_run(moved)
        assert run.data.tokenizer.sha256 == load_tokenizer(hidden).sha256
        assert evaluate_run(run, progress=False)["eval/bits_per_byte"] > 0
    finally:
        hidden.rename(original)
