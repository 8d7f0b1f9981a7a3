"""After training, from Python: load_run on run directories the moetrain command wrote (newest or
chosen step, damaged checkpoints, per-rank checkpoints), generation against an argmax loop and
reference filters, Hugging Face export against the run's logits, evaluation against a per-token
reference (bits per byte included) and with quantized experts."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import TINY_RUN, TINY_SYNTHETIC, write_corpus

import moetrain
from moetrain import cli, command_errors
from moetrain.data.text import ByteTokenizer, synthetic_lm
from moetrain.evaluate import evaluate, evaluate_run
from moetrain.export import ExportError, export_hf, matching_architecture
from moetrain.generate import (
    GenerationError,
    generate,
    next_tokens,
    prompt_ids,
    stream_text,
    top_k_filter,
    top_p_filter,
)
from moetrain.models import build_lm, load_hf_checkpoint
from moetrain.moe import moe_layers
from moetrain.parallel import checkpoint as shards
from moetrain.quant import QuantPolicy, quantize_model
from moetrain.run import Run, RunError, build_model, load_run
from moetrain.train import checkpoint

LM_RUN = ["data.seq_len=16", "data.batch_size=4", "data.eval_batch_size=4", "trainer.max_steps=3",
          "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0", "trainer.eval_every=0", "trainer.eval_batches=0",
          "trainer.progress_bar=false", "logger=none"]
SYNTHETIC_LM = ["data.train_size=32", "data.eval_size=8"]


def train(run_dir: Path, *overrides: str) -> Path:
    """A run of the moetrain command, in this process (what `moetrain OVERRIDES` writes)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["moetrain", *overrides, f"hydra.run.dir={run_dir}", "hydra/job_logging=none",
                                    "hydra/hydra_logging=none"])
        cli.main()
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    corpus = root / "corpus"
    write_corpus(corpus)
    return {
        "qwen3": train(root / "qwen3", "+recipe=qwen3_moe_lm", *LM_RUN, *SYNTHETIC_LM),
        "bytes": train(root / "bytes", "+recipe=qwen3_moe_lm", *LM_RUN, "data=text", f"data.path={corpus}",
                       "data.eval_fraction=0.3"),
        "deepseek_v3": train(root / "kimi", "+recipe=kimi_k2_lm", *LM_RUN, *SYNTHETIC_LM),
        "mixtral": train(root / "mixtral", "+recipe=qwen3_moe_lm", "+model.qk_norm=false", *LM_RUN, *SYNTHETIC_LM),
    }


def final_state(run_dir: Path, step: int) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", weights_only=False)


def assert_weights(model: torch.nn.Module, expected: dict) -> None:
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


# ---- load_run ------------------------------------------------------------------------------------
def test_load_run_gives_the_newest_checkpoint_and_a_chosen_step(runs):
    run = moetrain.load_run(runs["qwen3"])
    assert run.step == 3 and run.checkpoint.name == "step_00000003.pt"
    assert_weights(run.model, final_state(runs["qwen3"], 3)["model"])
    assert not run.model.training and run.task == "language_modeling" and run.tokenizer is None
    assert run.model_inputs == {"vocab_size": 256, "max_seq_len": 16}
    assert run.config["model"]["preset"] == "qwen3_moe_tiny" and run.config["gate"]["top_k"] == 4
    json.dumps(run.config)  # plain data, no OmegaConf objects
    older = load_run(runs["qwen3"], step=1)
    assert older.step == 1
    assert_weights(older.model, final_state(runs["qwen3"], 1)["model"])
    # The model it rebuilt computes what the trained model computed: its eval loss is the run's.
    reported = json.loads((runs["qwen3"] / "metrics.json").read_text())["eval/loss"]
    assert evaluate_run(run, progress=False)["eval/loss"] == pytest.approx(reported, rel=1e-5)


def test_load_run_errors_are_one_line(runs, tmp_path):
    cases = [(tmp_path / "missing", None, "does not exist"), (tmp_path, None, "no checkpoint in"),
             (runs["qwen3"], 7, "no checkpoint of step 7: it has step(s) 1, 2, 3"),
             (runs["qwen3"] / "metrics.json", None, "is a file, not a run directory")]
    for run_dir, step, expected in cases:
        with pytest.raises(RunError) as error:
            load_run(run_dir, step=step)
        assert expected in str(error.value) and "\n" not in str(error.value)
        assert isinstance(error.value, ValueError)


def test_a_damaged_newest_checkpoint_is_skipped_unless_chosen(runs, tmp_path, caplog):
    run_dir = tmp_path / "run"
    shutil.copytree(runs["qwen3"], run_dir)
    newest = run_dir / "checkpoints" / "step_00000003.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    (run_dir / "checkpoints" / "step_00000002.pt.sha256").unlink()  # step 2: incomplete
    with caplog.at_level(logging.WARNING):
        run = load_run(run_dir)
    assert run.step == 1
    assert_weights(run.model, final_state(runs["qwen3"], 1)["model"])
    skipped = " ".join(record.getMessage() for record in caplog.records)
    assert "step_00000003.pt" in skipped and "corrupted" in skipped and "step_00000002.pt" in skipped
    with pytest.raises(RunError, match="step 3: .*corrupted"):
        load_run(run_dir, step=3)
    for entry in checkpoint.checkpoints(run_dir / "checkpoints"):
        checkpoint.checksum_path(entry).unlink(missing_ok=True)
    with pytest.raises(RunError, match="no intact checkpoint"):
        load_run(run_dir)


def test_a_per_rank_checkpoint_loads_as_the_whole_model(runs, tmp_path):
    """A step directory of two rank files (experts split between them, as the converter and a
    two-process run write it) loads into the same model as the one-process checkpoint."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs["qwen3"], run_dir)
    state = final_state(run_dir, 3)
    reference = load_run(run_dir)
    state["moe_parallel"] = shards.parallel_metadata(reference.model, 1, 0)
    state["moe_parallel"]["expert_parallel"] = True
    ranks = shards.reshard(state, 2)
    experts_key = next(key for key in state["moe_parallel"]["experts"])
    assert ranks[0]["model"][experts_key].shape[0] == state["model"][experts_key].shape[0] // 2
    shards.write_shards(ranks, str(run_dir / "checkpoints" / "step_00000004"))
    run = load_run(run_dir)
    assert run.step == 3 and run.checkpoint.name == "step_00000004"  # the step number inside the files
    assert_weights(run.model, state["model"])
    (run_dir / "checkpoints" / "step_00000004" / "SHA256SUMS").unlink()
    assert load_run(run_dir).checkpoint.name == "step_00000003.pt"  # the incomplete step directory is skipped


def test_saved_gate_settings_load_field_by_field(runs):
    run = load_run(runs["qwen3"])
    config = copy.deepcopy(run.config)
    del config["gate"]["z_loss_weight"]  # a key an older run did not save: the schema's default
    model = build_model(config, run.model_inputs)
    assert [layer.top_k for layer in moe_layers(model)] == [4, 4, 4]  # the run's, not the preset's or schema's
    model.load_state_dict(run.model.state_dict())
    tokens_BT = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(model.eval()(tokens_BT), run.model(tokens_BT))
    with pytest.raises(RunError, match=r"GateConfig.type='nope' is not one of top\|cosine\|sigmoid"):
        build_model({**config, "gate": {**config["gate"], "type": "nope"}}, run.model_inputs)
    with pytest.raises(RunError, match="brand_new"):
        build_model({**config, "gate": {**config["gate"], "brand_new": 1}}, run.model_inputs)


# ---- generation ----------------------------------------------------------------------------------
def argmax_loop(model, prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            window = torch.tensor([tokens[-model.config.max_seq_len:]])
            tokens.append(int(model(window)[0, -1].argmax()))
    return tokens[len(prompt):]


def test_greedy_generation_is_the_argmax_loop(runs):
    run = load_run(runs["qwen3"])
    prompt = torch.randint(0, 256, (5,)).tolist()
    expected = argmax_loop(run.model, prompt, 20)  # 25 tokens: the window slides past max_seq_len=16
    streamed = []
    assert generate(run.model, prompt, 20, temperature=0, on_token=streamed.append) == expected
    assert streamed == expected
    # top_k=1 leaves only the argmax to draw, whatever the temperature and seed.
    assert generate(run.model, prompt, 20, temperature=1.7, top_k=1, seed=3) == expected


def reference_filter(logits: list[float], top_k: int, top_p: float) -> set[int]:
    """The token ids kept, by the definitions: the k largest; then the smallest most-probable set
    whose probability reaches p."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    kept = order[:top_k] if top_k else order
    total = sum(math.exp(logits[i]) for i in kept)
    nucleus, mass = [], 0.0
    for i in kept:
        nucleus.append(i)
        mass += math.exp(logits[i]) / total
        if mass >= top_p:
            break
    return set(nucleus)


def test_top_k_and_top_p_keep_the_reference_tokens():
    generator = torch.Generator().manual_seed(0)
    logits_BV = torch.randn(6, 40, generator=generator, dtype=torch.float64) * 2
    for top_k in (0, 1, 5, 39):
        for top_p in (1.0, 0.95, 0.5, 0.1, 1e-6):
            filtered_BV = top_p_filter(top_k_filter(logits_BV, top_k), top_p)
            for row in range(logits_BV.size(0)):
                kept = {i for i in range(40) if filtered_BV[row, i] != float("-inf")}
                assert kept == reference_filter(logits_BV[row].tolist(), top_k, top_p), (top_k, top_p, row)
                assert torch.equal(filtered_BV[row, sorted(kept)], logits_BV[row, sorted(kept)])


def test_sampled_tokens_follow_the_filtered_distribution():
    logits_V = torch.randn(8, generator=torch.Generator().manual_seed(1))
    temperature, top_k, top_p = 0.7, 5, 0.8
    scaled = (logits_V / temperature).tolist()
    kept = reference_filter(scaled, top_k, top_p)
    total = sum(math.exp(scaled[i]) for i in kept)
    expected = [math.exp(scaled[i]) / total if i in kept else 0.0 for i in range(8)]
    draws = 40000
    tokens = next_tokens(logits_V.expand(draws, 8), temperature, top_k, top_p, torch.Generator().manual_seed(2))
    frequency = torch.bincount(tokens, minlength=8).double() / draws
    for token in range(8):
        assert frequency[token] == pytest.approx(expected[token], abs=0.01), token
    again = next_tokens(logits_V.expand(draws, 8), temperature, top_k, top_p, torch.Generator().manual_seed(2))
    assert torch.equal(tokens, again)


def test_a_seed_fixes_the_sampled_text_and_settings_are_checked(runs):
    run = load_run(runs["qwen3"])
    first = generate(run.model, [1, 2, 3], 30, temperature=1.5, seed=7)
    assert generate(run.model, [1, 2, 3], 30, temperature=1.5, seed=7) == first
    assert generate(run.model, [1, 2, 3], 30, temperature=1.5, seed=8) != first
    for settings, key in [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0}, "top_p"),
                          ({"max_new_tokens": -1}, "max_new_tokens")]:
        arguments = {"max_new_tokens": 3, **settings}
        with pytest.raises(GenerationError, match=key):
            generate(run.model, [1], **arguments)
    with pytest.raises(GenerationError, match="outside the model's vocabulary"):
        generate(run.model, [256], 1)
    with pytest.raises(GenerationError, match="token ids"):
        prompt_ids(run, "text needs a byte-level run")


def test_byte_level_runs_take_and_stream_text(runs):
    run = load_run(runs["bytes"])
    tokenizer = run.tokenizer
    assert isinstance(tokenizer, ByteTokenizer) and run.model_inputs["vocab_size"] == 257
    prompt = "Le café"
    ids = prompt_ids(run, prompt)
    assert ids == [256] + list(prompt.encode("utf-8"))
    expected_ids = generate(run.model, ids, 40, temperature=1.0, seed=5, eos_id=256)
    pieces = list(stream_text(run, prompt, 40, temperature=1.0, seed=5))
    text_ids = expected_ids[:-1] if expected_ids and expected_ids[-1] == 256 else expected_ids
    assert "".join(pieces) == bytes(text_ids).decode("utf-8", errors="replace")


class ScriptedLM(torch.nn.Module):
    """A stand-in language model whose next token is always the next byte of a script."""

    def __init__(self, script: bytes):
        super().__init__()
        self.script = script
        self.config = dataclasses.make_dataclass("Config", ["vocab_size", "max_seq_len"])(257, 64)
        self.weight = torch.nn.Parameter(torch.zeros(()))

    def forward(self, tokens_BT):
        produced = self.produced
        self.produced += 1
        logits = torch.full((tokens_BT.size(0), tokens_BT.size(1), 257), -10.0)
        logits[:, -1, self.script[produced] if produced < len(self.script) else 256] = 10.0
        return logits


def test_streamed_text_comes_in_whole_characters(runs):
    text = "añ日€x"
    model = ScriptedLM(text.encode("utf-8"))
    model.produced = 0
    run = dataclasses.replace(load_run(runs["bytes"]), model=model)
    pieces = list(stream_text(run, "", 50, temperature=0))
    assert pieces == list(text)  # one piece per character, never half of one; stops at end-of-text


# ---- export --------------------------------------------------------------------------------------
@pytest.mark.parametrize("architecture", ["qwen3", "deepseek_v3", "mixtral"])
def test_export_loads_back_with_the_run_logits(runs, tmp_path, architecture):
    run = load_run(runs[architecture])
    expected_type = {"qwen3": "qwen3_moe"}.get(architecture, architecture)
    assert export_hf(run, tmp_path / "hf") == expected_type
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == expected_type and list((tmp_path / "hf").glob("*.safetensors"))
    loaded = load_hf_checkpoint(tmp_path / "hf")
    tokens_BT = torch.randint(0, run.model_inputs["vocab_size"], (3, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens_BT), run.model(tokens_BT), rtol=1e-5, atol=1e-5)


def test_export_refuses_what_hugging_face_would_compute_otherwise(runs, tmp_path):
    deepseek_moe = build_lm("deepseek_moe_tiny")  # softmax gate with shared experts: no such HF architecture
    with pytest.raises(ExportError, match="fits no Hugging Face architecture") as error:
        matching_architecture(deepseek_moe)
    assert "\n" not in str(error.value)
    capped = build_lm("qwen3_moe_tiny", moe_kwargs={"gate": "top", "top_k": 2, "capacity_factor": 1.0,
                                                    "gate_kwargs": {"normalize": True}})
    with pytest.raises(ExportError, match="capacity_factor=1") as refused:
        export_hf(capped, tmp_path / "capped")
    assert not (tmp_path / "capped").exists()
    # the library names the gate setting as Python does; the command writes the config key
    assert "GateConfig.capacity_factor=1 " in str(refused.value)
    assert "gate.capacity_factor=1 " in command_errors.in_config_keys(str(refused.value))
    assert export_hf(capped, tmp_path / "capped", allow_dropless=True) == "qwen3_moe"
    with pytest.raises(ExportError, match="not an empty folder"):
        export_hf(capped, tmp_path / "capped", allow_dropless=True)
    with pytest.raises(ExportError, match="model_type must be one of"):
        export_hf(capped, tmp_path / "other", model_type="llama", allow_dropless=True)


# ---- evaluation ----------------------------------------------------------------------------------
def reference_metrics(model, dataset, byte_level: bool) -> dict:
    """Per sequence, per position: -log softmax of the target, summed in Python floats."""
    losses, hits, byte_bits, byte_count = [], 0, 0.0, 0
    with torch.no_grad():
        for index in range(len(dataset)):
            inputs_T, targets_T = dataset[index]
            log_probs_TV = torch.log_softmax(model(inputs_T[None])[0].double(), dim=-1)
            for position, target in enumerate(targets_T.tolist()):
                loss = -float(log_probs_TV[position, target])
                losses.append(loss)
                hits += int(log_probs_TV[position].argmax()) == target
                if target < 256:
                    byte_bits += loss / math.log(2)
                    byte_count += 1
    loss = sum(losses) / len(losses)
    metrics = {"eval/loss": loss, "eval/accuracy": hits / len(losses), "eval/perplexity": math.exp(loss)}
    if byte_level:
        metrics["eval/bits_per_byte"] = byte_bits / byte_count
    return metrics


def assert_metrics(actual: dict, expected: dict) -> None:
    assert actual.keys() >= expected.keys()
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value, rel=1e-5), key


def test_evaluation_of_a_byte_level_run_matches_the_reference_with_bits_per_byte(runs):
    run = load_run(runs["bytes"])
    assert any(256 in run.data.eval_set[i][1].tolist() for i in range(len(run.data.eval_set)))  # an end-of-text
    metrics = evaluate_run(run, progress=False)
    assert_metrics(metrics, reference_metrics(run.model, run.data.eval_set, byte_level=True))
    assert metrics["eval/bits_per_byte"] != pytest.approx(metrics["eval/loss"] / math.log(2), rel=1e-6)
    assert "eval/bits_per_byte" not in evaluate_run(load_run(runs["qwen3"]), progress=False)  # token ids


def test_evaluation_on_another_data_config_and_with_quantized_experts(runs):
    run = load_run(runs["qwen3"])
    before = copy.deepcopy(run.model.state_dict())
    other = {**run.config["data"], "seed": 5, "eval_size": 6}
    metrics = evaluate_run(run, data=other, progress=False)
    other_set = synthetic_lm(**{key: value for key, value in other.items() if key != "_target_"}).eval_set
    assert_metrics(metrics, reference_metrics(run.model, other_set, byte_level=False))

    quantized = copy.deepcopy(run.model)
    quantize_model(quantized, QuantPolicy("fp8"))
    metrics = evaluate_run(run, quant="fp8", progress=False)
    assert_metrics(metrics, reference_metrics(quantized, run.data.eval_set, byte_level=False))
    assert metrics["expert_bytes"] < sum(p.numel() * 4 for layer in moe_layers(run.model)
                                         for p in layer.experts.parameters() if p.dim() == 3)
    assert_weights(run.model, before)  # the run's own model stays as trained

    with pytest.raises(RunError, match="vocab_size=300 but the run's model was built with vocab_size=256"):
        evaluate_run(run, data={**run.config["data"], "vocab_size": 300})
    with pytest.raises(RunError, match="hot_format"):
        evaluate_run(run, quant=QuantPolicy("mxfp4", hot_format="fp8"))


def test_the_evaluation_bar_counts_batches(runs, monkeypatch):
    import moetrain.evaluate as evaluation

    bars = []

    class RecordingBar(evaluation.tqdm):
        def close(self):  # tqdm closes a finished iteration itself, then evaluate closes it again
            if not getattr(self, "recorded", False):
                self.recorded = True
                bars.append((self.total, self.n, self.unit))
            super().close()

    monkeypatch.setattr(evaluation, "tqdm", RecordingBar)
    run = load_run(runs["qwen3"])
    loader = torch.utils.data.DataLoader(run.data.eval_set, batch_size=3)  # 8 sequences: 3 batches
    evaluate(run.model, loader, run.task, progress=True)
    evaluate(run.model, loader, run.task, progress=True, max_batches=2)
    assert bars == [(3, 3, "batch"), (2, 2, "batch")]


def test_an_image_run_loads_and_evaluates_but_does_not_generate(tmp_path):
    run_dir = train(tmp_path / "vision", "+recipe=quickstart", *TINY_RUN, *TINY_SYNTHETIC, "logger=none",
                    "trainer.checkpoint_every=3")
    run = load_run(run_dir)
    reported = json.loads((run_dir / "metrics.json").read_text())
    assert run.task == "classification" and run.step == 3
    metrics = evaluate_run(run, eval_batches=1, progress=False)
    assert metrics["eval/accuracy"] == pytest.approx(reported["eval/accuracy"])
    assert "eval/perplexity" not in metrics
    with pytest.raises(GenerationError, match="classification run"):
        prompt_ids(run, [1])
    with pytest.raises(ExportError, match="not a language model"):
        export_hf(run, tmp_path / "hf")
    assert isinstance(run, Run)


class _PaddedVocabularyLM(torch.nn.Module):
    """Random logits over 300 ids whose largest values sit on the padding ids 257-299 (an embedding
    padded past a 257-id tokenizer, as published checkpoints pad theirs)."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=300, max_seq_len=32)
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.generator = torch.Generator().manual_seed(torch.seed() % 2**31)

    def forward(self, tokens_BT):
        logits = torch.randn(*tokens_BT.shape, 300, generator=self.generator) * self.scale
        logits[..., 257:] += 100.0
        return logits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_never_draws_ids_past_the_tokenizer(temperature):
    from moetrain.generate import stream_tokens

    model = _PaddedVocabularyLM()
    drawn = list(stream_tokens(model, [1, 2], 20, temperature=temperature, seed=0, vocab_limit=257))
    assert len(drawn) == 20 and max(drawn) < 257
    unlimited = list(stream_tokens(model, [1, 2], 5, temperature=temperature, seed=0))
    assert min(unlimited) >= 257  # without the limit the padding rows win: the limit is what keeps them out
