"""Training from a published checkpoint: `moetrain model=hf model.path=DIR`, then `moetrain export`.

The checkpoints are tiny random Qwen3-MoE, Mixtral and DeepSeek-V3 models written by transformers'
save_pretrained (bf16 and float32), with a BPE tokenizer trained here by `tokenizers` and saved as a
PreTrainedTokenizerFast. What is checked against an independent reference: after `optim.lr=0`
the export holds DIR's tensors byte for byte (names, shapes, dtypes), and after real training
transformers' own model and tokenizer, loaded from the export, give the logits of
moetrain.load_run(RUN).model and the ids of the tokenizer the run started with. The composed run
routes as DIR's config.json says, under the user's gate keys; keys the checkpoint fixes are refused;
every damaged checkpoint ends the command in one line before a run directory exists. The bad-input
checkpoints are written by moetrain itself, so those tests need no transformers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import moetrain
from moetrain import cli
from moetrain.models import build_lm, save_hf_checkpoint

TRAINER = ["trainer.eval_every=0", "trainer.progress_bar=false", "trainer.device=cpu", "logger=none"]
RUN = ["data=synthetic_lm", "data.seq_len=16", "data.train_size=32", "data.eval_size=8", "data.batch_size=4",
       "data.eval_batch_size=4", *TRAINER]
TEXT = "the quick brown fox jumps over the lazy dog; a mixture of experts routes every token. " * 20


def in_process(argv: list[str]) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["moetrain", *argv])
        cli.main()


def train(run_dir: Path, *overrides: str) -> Path:
    in_process([*RUN, *overrides, f"hydra.run.dir={run_dir}", "hydra/job_logging=none", "hydra/hydra_logging=none"])
    return run_dir


def checked_command_line(overrides: list[str], multirun: bool):
    """What the command composes and checks for a command line, in this process (no run directory)."""
    cli.register_configs()
    return cli.check_command_line(overrides, multirun)


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.flatten().view(torch.uint8),
                                                                     b.flatten().view(torch.uint8))


# ---- checkpoints written by transformers ---------------------------------------------------------------
def hf_config(model_type: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if model_type == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                           moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                           norm_topk_prob=True)
    if model_type == "mixtral":
        return transformers.MixtralConfig(**common, num_key_value_heads=2, intermediate_size=16, num_local_experts=4,
                                          num_experts_per_tok=2)
    return transformers.DeepseekV3Config(**common, num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=16,
                                         n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                         n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                                         qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5)


def write_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer of 290 ids trained on TEXT, in Hugging Face's directory layout."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=290, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(directory)


def write_hf_checkpoint(directory: Path, model_type: str, dtype: torch.dtype, seed: int = 0) -> Path:
    """save_pretrained of a random model (every weight, and DeepSeek-V3's balancing bias, drawn
    afresh: transformers' initialisation leaves some of them zero or one)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(model_type))
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(".weight") or name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.2)
    model.to(dtype).save_pretrained(directory)
    write_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {f"{model_type}-{str(dtype)[6:]}": write_hf_checkpoint(root / f"{model_type}-{str(dtype)[6:]}",
                                                                   model_type, dtype)
            for model_type in ("qwen3_moe", "mixtral", "deepseek_v3") for dtype in (torch.bfloat16, torch.float32)}


def export(run_dir: Path, out: Path) -> Path:
    in_process(["export", str(run_dir), str(out)])
    return out


def edited_copy(source: Path, destination: Path, edit) -> Path:
    shutil.copytree(source, destination)
    config = json.loads((destination / "config.json").read_text())
    (destination / "config.json").write_text(json.dumps(edit(config)))
    return destination


def transformers4_layout(config: dict) -> dict:
    """A transformers-5 Qwen3-MoE config.json as transformers 4 wrote it."""
    config = dict(config)
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["num_experts"] = config.pop("num_local_experts")
    config["torch_dtype"] = config.pop("dtype")
    return config


# ---- lr=0: the export is the checkpoint ----------------------------------------------------------------
@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral", "deepseek_v3", "kimi_k2", "qwen3_moe-transformers4"])
def test_an_untrained_step_exports_the_checkpoint_byte_for_byte(checkpoints, tmp_path, variant):
    """optim.lr=0 with AdamW's default weight decay (0.05): the float32 master weights stay the
    bf16 values exactly, and export writes every tensor back in its own dtype. Kimi-K2 is
    DeepSeek-V3's architecture under its own model_type; the transformers-4 layout is the same
    Qwen3-MoE checkpoint with that version's config keys."""
    model_type = variant.split("-")[0]
    source = checkpoints[f"{'deepseek_v3' if model_type == 'kimi_k2' else model_type}-bfloat16"]
    if model_type == "kimi_k2":
        source = edited_copy(source, tmp_path / "kimi", lambda config: config | {"model_type": "kimi_k2"})
    if variant.endswith("transformers4"):
        source = edited_copy(source, tmp_path / "v4", transformers4_layout)
    bias = ["gate.bias_update_rate=0"] if model_type in ("deepseek_v3", "kimi_k2") else []
    run = train(tmp_path / "run", "model=hf", f"model.path={source}", "optim.lr=0", "trainer.max_steps=1", *bias)
    out = export(run, tmp_path / "out")
    theirs, ours = tensors(source), tensors(out)
    assert sorted(ours) == sorted(theirs)
    assert all(value.dtype == torch.bfloat16 for value in theirs.values())
    different = [name for name in theirs if not same_bytes(theirs[name], ours[name])]
    assert not different, different
    written, original = json.loads((out / "config.json").read_text()), json.loads((source / "config.json").read_text())
    assert written["model_type"] == model_type and written["torch_dtype"] == written.get("dtype", "bfloat16") == "bfloat16"
    for key in ("architectures", "max_position_embeddings", "num_experts_per_tok", "vocab_size", "eos_token_id"):
        assert written.get(key) == original.get(key), key
    assert (out / "generation_config.json").read_text() == (source / "generation_config.json").read_text()


@pytest.mark.slow
def test_an_untrained_step_of_two_expert_parallel_processes_exports_the_checkpoint(checkpoints, tmp_path):
    """Two CPU processes (Gloo), each holding half the experts: the per-rank checkpoint gathers
    into the whole model, written back byte for byte."""
    source = checkpoints["qwen3_moe-bfloat16"]
    run = train(tmp_path / "run", "model=hf", f"model.path={source}", "optim.lr=0", "trainer.max_steps=1",
                "parallel.nproc_per_node=2", "parallel.strategy=expert")
    theirs, ours = tensors(source), tensors(export(run, tmp_path / "out"))
    assert sorted(ours) == sorted(theirs)
    assert [name for name in theirs if not same_bytes(theirs[name], ours[name])] == []


@pytest.mark.cuda
def test_an_untrained_step_on_a_gpu_exports_the_checkpoint_byte_for_byte(checkpoints, tmp_path):
    """The same on CUDA: bf16 autocast, the kernels' dispatch, fused AdamW."""
    source = checkpoints["deepseek_v3-bfloat16"]
    on_gpu = [o for o in RUN if not o.startswith("trainer.device=")] + ["trainer.device=cuda"]
    in_process([*on_gpu, "model=hf", f"model.path={source}", "optim.lr=0", "trainer.max_steps=2",
                "gate.bias_update_rate=0", f"hydra.run.dir={tmp_path / 'run'}", "hydra/job_logging=none",
                "hydra/hydra_logging=none"])
    theirs, ours = tensors(source), tensors(export(tmp_path / "run", tmp_path / "out"))
    assert sorted(ours) == sorted(theirs)
    assert [name for name in theirs if not same_bytes(theirs[name], ours[name])] == []


def test_a_real_step_changes_the_export_and_the_balancing_bias_moves_at_lr_zero(checkpoints, tmp_path):
    """What must change does: one step at lr > 0 moves the weights; at lr=0 DeepSeek-V3's balancing
    bias still follows the load (gate.bias_update_rate, the documented rule) and nothing else moves."""
    source = checkpoints["deepseek_v3-bfloat16"]
    theirs = tensors(source)
    trained = tensors(export(train(tmp_path / "a", "model=hf", f"model.path={source}", "optim.lr=0.01",
                                   "optim.warmup_steps=0", "trainer.max_steps=1"), tmp_path / "a_out"))
    assert sum(not same_bytes(theirs[name], trained[name]) for name in theirs) > len(theirs) // 2
    biased = tensors(export(train(tmp_path / "b", "model=hf", f"model.path={source}", "optim.lr=0",
                                  "trainer.max_steps=1", "gate.bias_update_rate=0.05"), tmp_path / "b_out"))
    moved = sorted(name for name in theirs if not same_bytes(theirs[name], biased[name]))
    assert moved == ["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert (biased[moved[0]].float() - theirs[moved[0]].float()).abs().max() == pytest.approx(0.05, rel=0.02)


# ---- back to transformers -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen3_moe-bfloat16", "mixtral-float32", "deepseek_v3-bfloat16"])
def test_transformers_loads_the_export_with_the_run_logits_and_tokenizer(checkpoints, tmp_path, name):
    """The end-to-end path: DIR -> moetrain model=hf (2 real steps) -> moetrain export -> transformers."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    source = checkpoints[name]
    run_dir = train(tmp_path / "run", "model=hf", f"model.path={source}", "trainer.max_steps=2", "optim.lr=0.01",
                    "optim.warmup_steps=0")
    # The run's tokenizer as the data half records it (RUN/tokenizer/, Hugging Face's files).
    shutil.copytree(source, run_dir / "tokenizer",
                    ignore=lambda folder, names: [n for n in names if not n.startswith(("tokenizer", "special"))])
    out = export(run_dir, tmp_path / "out")
    run = moetrain.load_run(run_dir)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    written = tensors(out)
    assert {key: value.dtype for key, value in written.items()} == {key: value.dtype for key, value in
                                                                    tensors(source).items()}
    # The export holds the run's float32 weights in the checkpoint's dtype: compare at that precision.
    model = run.model
    exported_dtype = next(iter(written.values())).dtype
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(exported_dtype).float())
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = model(tokens), theirs(tokens).logits
    assert (got - expected).abs().max() < 1e-4 * expected.abs().max()
    reference = Tokenizer.from_file(str(source / "tokenizer.json"))
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    for text in (TEXT[:120], "unseen words: zebra, quartz, ünïcödé"):
        assert loaded(text)["input_ids"] == reference.encode(text).ids
    assert loaded.eos_token == "<|endoftext|>"


def test_a_one_process_run_reads_the_checkpoint_once(checkpoints, tmp_path, monkeypatch):
    """The command reads the weights before making the run directory, and trains that model."""
    from moetrain.models import hf

    calls = []
    original = hf.load_hf_checkpoint
    monkeypatch.setattr(hf, "load_hf_checkpoint", lambda *args, **kwargs: calls.append(args) or original(*args, **kwargs))
    train(tmp_path / "run", "model=hf", f"model.path={checkpoints['mixtral-bfloat16']}", "trainer.max_steps=1")
    assert len(calls) == 1 and (tmp_path / "run" / "checkpoints").is_dir()


def test_the_run_routes_as_the_checkpoint_under_the_users_gate_keys(checkpoints):
    source = checkpoints["deepseek_v3-bfloat16"]
    gate = checked_command_line(["model=hf", f"model.path={source}", "data=synthetic_lm"], False).gate
    assert (gate.type, gate.top_k, gate.capacity_factor, gate.n_group, gate.topk_group) == ("sigmoid", 2, 0, 2, 1)
    assert gate.routed_scaling_factor == 2.5 and gate.normalize is True and gate.balance_loss_weight == 0.0001
    changed = checked_command_line(["model=hf", f"model.path={source}", "data=synthetic_lm", "gate.top_k=1",
                                      "gate.capacity_factor=1.5"], False).gate
    assert (changed.type, changed.top_k, changed.capacity_factor, changed.n_group) == ("sigmoid", 1, 1.5, 2)
    qwen = checked_command_line(["model=hf", f"model.path={checkpoints['qwen3_moe-bfloat16']}", "data=synthetic_lm",
                                   "trainer.max_steps=7", "parallel.strategy=data"], False)
    assert (qwen.gate.type, qwen.gate.top_k, qwen.gate.normalize, qwen.gate.balance_loss_weight) == ("top", 2, True, 0.001)
    assert qwen.trainer.max_steps == 7 and qwen.parallel.strategy.value == "data"


def test_a_sweep_over_a_checkpoint_composes_each_job_with_its_routing(checkpoints):
    qwen, deepseek = checkpoints["qwen3_moe-bfloat16"], checkpoints["deepseek_v3-bfloat16"]
    assert checked_command_line(["model=hf", f"model.path={qwen}", "data=synthetic_lm", "gate.top_k=1,3"], True) is None
    with pytest.raises(cli.ConfigError, match="route differently"):
        checked_command_line(["model=hf", f"model.path={qwen},{deepseek}", "data=synthetic_lm"], True)


@pytest.mark.parametrize("override", ["model.dim=64", "+model.num_experts=8", "+model.vocab_size=1000",
                                      "+model.moe_kwargs={top_k:1}"])
def test_keys_the_checkpoint_fixes_are_refused(checkpoints, override):
    key = override.lstrip("+").split("=")[0]
    with pytest.raises(cli.ConfigError, match=f"{key} is fixed by the checkpoint"):
        checked_command_line(["model=hf", f"model.path={checkpoints['qwen3_moe-bfloat16']}", "data=synthetic_lm",
                                override], False)


def test_a_learning_rate_of_zero_is_allowed_and_a_negative_one_refused(checkpoints):
    base = ["model=hf", f"model.path={checkpoints['qwen3_moe-bfloat16']}", "data=synthetic_lm"]
    assert checked_command_line([*base, "optim.lr=0"], False).optim.lr == 0
    with pytest.raises(cli.ConfigError, match="optim.lr must be >= 0, got -0.1"):
        checked_command_line([*base, "optim.lr=-0.1"], False)


def test_the_checkpoints_tokenizer_is_the_runs_unless_data_tokenizer_names_one(tmp_path):
    with_tokenizer, without = tmp_path / "with", tmp_path / "without"
    with_tokenizer.mkdir()
    without.mkdir()
    (with_tokenizer / "tokenizer.json").write_text("{}")
    assert cli.checkpoint_tokenizer(str(with_tokenizer), None) == str(with_tokenizer)
    assert cli.checkpoint_tokenizer(str(with_tokenizer), "other/tokenizer.json") == "other/tokenizer.json"
    assert cli.checkpoint_tokenizer(str(without), None) is None  # byte-level
    composed = OmegaConf.create({"model": {"path": str(with_tokenizer)}, "data": {"tokenizer": None}})
    cli.apply_checkpoint_tokenizer(composed)
    assert composed.data.tokenizer == str(with_tokenizer)
    untouched = OmegaConf.create({"model": {"path": str(with_tokenizer)}, "data": {"vocab_size": 256}})
    cli.apply_checkpoint_tokenizer(untouched)
    assert "tokenizer" not in untouched.data


# ---- bad checkpoints: one line, nothing written ---------------------------------------------------------
@pytest.fixture(scope="module")
def own_checkpoint(tmp_path_factory) -> Path:
    """A Qwen3-MoE checkpoint of 300 ids and 64 positions written by moetrain, in two shards."""
    directory = tmp_path_factory.mktemp("own") / "qwen3"
    torch.manual_seed(0)
    model = build_lm("qwen3_moe_tiny", vocab_size=300, max_seq_len=64, depth=2)
    save_hf_checkpoint(model, directory, "qwen3_moe", max_shard_bytes=200_000)
    assert len(list(directory.glob("*.safetensors"))) >= 2
    return directory


@pytest.fixture(scope="module")
def small_vocabulary_checkpoint(tmp_path_factory) -> Path:
    """A Qwen3-MoE checkpoint of 200 ids: fewer than the byte-level tokenizer's 257."""
    directory = tmp_path_factory.mktemp("small") / "qwen3"
    torch.manual_seed(0)
    save_hf_checkpoint(build_lm("qwen3_moe_tiny", vocab_size=200, max_seq_len=64, depth=1), directory, "qwen3_moe")
    return directory


def test_byte_level_text_needs_a_checkpoint_of_257_ids_or_more(small_vocabulary_checkpoint, tmp_path, monkeypatch,
                                                               capsys):
    """No tokenizer in DIR and data.tokenizer null: the text is read as bytes, which must fit."""
    (tmp_path / "corpus.txt").write_text(TEXT)
    line = refused(tmp_path, monkeypatch, capsys, "model=hf", f"model.path={small_vocabulary_checkpoint}", "data=text",
                   f"data.path={tmp_path / 'corpus.txt'}", "data.seq_len=16", base=TRAINER)
    assert "the data's 257 token ids do not fit" in line and "embedding of 200" in line and "data.tokenizer" in line


def refused(tmp_path: Path, monkeypatch, capsys, *overrides: str, base: list[str] = RUN) -> str:
    """The one error line of a command that must fail with exit code 2 and write no run directory."""
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        in_process([*base, *overrides, "hydra/job_logging=none", "hydra/hydra_logging=none"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("moetrain: error: "), lines
    assert not (tmp_path / "runs").exists()
    return lines[0]


def damaged(own_checkpoint: Path, tmp_path: Path, damage) -> Path:
    copy = tmp_path / "checkpoint"
    shutil.copytree(own_checkpoint, copy)
    damage(copy)
    return copy


def _first_shard(directory: Path) -> Path:
    return sorted(directory.glob("*.safetensors"))[0]


def _truncate(directory: Path) -> None:
    shard = _first_shard(directory)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _reshape_a_weight(directory: Path) -> None:
    from safetensors.torch import load_file, save_file

    shard = _first_shard(directory)
    weights = load_file(shard)
    weights["model.embed_tokens.weight"] = torch.zeros(300, 48)
    save_file(weights, shard, metadata={"format": "pt"})


def _unsupported_type(directory: Path) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))


BAD_CHECKPOINTS = {
    "unsupported model_type": (_unsupported_type, ["model_type 'llama'", "qwen3_moe, mixtral, deepseek_v3, kimi_k2"]),
    "missing config.json": (lambda d: (d / "config.json").unlink(), ["has no config.json", "save_pretrained"]),
    "config.json not JSON": (lambda d: (d / "config.json").write_text("{"), ["not valid JSON"]),
    "missing shard": (lambda d: _first_shard(d).unlink(), ["lacks 1 of the", "download them again"]),
    "no safetensors": (lambda d: [p.unlink() for p in d.glob("model*")], ["no *.safetensors"]),
    "truncated shard": (_truncate, ["model-00001-of-", "is not a complete safetensors file", "download it again"]),
    "weight of the wrong shape": (_reshape_a_weight, ["model.embed_tokens.weight", "shape (300, 48)", "(300, 64)",
                                                         "download the checkpoint again"]),
}


@pytest.mark.parametrize("name", list(BAD_CHECKPOINTS))
def test_a_bad_checkpoint_is_one_line_before_any_run_directory(own_checkpoint, tmp_path, monkeypatch, capsys, name):
    damage, says = BAD_CHECKPOINTS[name]
    line = refused(tmp_path, monkeypatch, capsys, "model=hf", f"model.path={damaged(own_checkpoint, tmp_path, damage)}")
    for text in says:
        assert text in line, (text, line)


@pytest.mark.parametrize("overrides, says", [
    (["model=hf"], ["set model.path=DIR"]),
    (["model=hf", "model.path=no/such/folder"], ["no/such/folder is not a directory"]),
    (["data.vocab_size=400"], ["400 token ids do not fit", "300", "data.tokenizer"]),
    (["data.seq_len=65"], ["data.seq_len=65 is longer than the 64 positions", "data.seq_len=64 or less"]),
    (["+model.max_seq_len=100"], ["model.max_seq_len=100 is longer than the 64 positions"]),
    (["gate.top_k=17"], ["gate.top_k=17 exceeds the 16 experts", "lower gate.top_k"]),
    (["parallel.nproc_per_node=3"], ["the 16 experts of model.path=", "cannot be sharded over parallel.nproc_per_node=3"]),
    (["data=synthetic"], ["model=hf is a language model", "data=text or data=synthetic_lm"]),
])
def test_a_checkpoint_that_does_not_fit_the_run_is_one_line(own_checkpoint, tmp_path, monkeypatch, capsys, overrides,
                                                            says):
    path = [] if overrides[0].startswith("model") else ["model=hf", f"model.path={own_checkpoint}"]
    line = refused(tmp_path, monkeypatch, capsys, *path, *overrides,
                   base=TRAINER if "data=synthetic" in overrides else RUN)
    for text in says:
        assert text in line, (text, line)


def test_the_real_command_refuses_an_unsupported_checkpoint_without_a_traceback(own_checkpoint, tmp_path):
    checkpoint = damaged(own_checkpoint, tmp_path, _unsupported_type)
    result = subprocess.run([str(Path(sys.executable).parent / "moetrain"), "model=hf", f"model.path={checkpoint}",
                             "data=synthetic_lm"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "model_type 'llama'" in result.stderr and not (tmp_path / "runs").exists()
