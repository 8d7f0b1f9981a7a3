"""Hugging Face config.json in both layouts: as transformers 4 writes it (and as the released
checkpoints carry it) and as transformers 5 writes it, which
  - moves `rope_theta` and the `rope_scaling` settings into one `rope_parameters` dict with a
    `rope_type` ("default" or "yarn"; the legacy "type" key is kept beside it),
  - saves Qwen3-MoE's expert count as `num_local_experts` (Qwen3MoeConfig maps num_experts onto it),
  - writes the dtype as `dtype`.
Both layouts of the same tiny checkpoint load to the same model, whose logits match the
independent implementation of tests/models/test_hf_loading.py; a key that changes the numbers and cannot
be read is an error naming it and the file, never a default.
"""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.models import CheckpointError, load_hf_checkpoint
from test_hf_loading import (deepseek_checkpoint, mixtral_checkpoint, qwen3_checkpoint, reference_logits,
                             write_checkpoint)

CHECKPOINTS = {"qwen3_moe": qwen3_checkpoint, "mixtral": mixtral_checkpoint, "deepseek_v3": deepseek_checkpoint}


def transformers5_layout(config: dict) -> dict:
    """The config.json transformers 5 saves for a model loaded from `config` (the legacy layout)."""
    new = {key: value for key, value in config.items() if key not in ("rope_theta", "rope_scaling", "torch_dtype")}
    new["dtype"] = config["torch_dtype"]
    new["transformers_version"] = "5.0.0"
    scaling = config.get("rope_scaling")
    if scaling is None:
        new["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    else:
        parameters = dict(scaling, rope_theta=config["rope_theta"], rope_type=scaling["type"])
        for key in ("beta_fast", "beta_slow", "factor"):  # transformers 5 stores these as floats
            parameters[key] = float(parameters[key])
        new["rope_parameters"] = parameters
    if config["model_type"] == "qwen3_moe":
        new["num_local_experts"] = new.pop("num_experts")
    return new


def checkpoint(tmp_path, model_type, layout="legacy", edit=None):
    """(directory, legacy config, weights) of one tiny checkpoint, its config.json in `layout`."""
    gen = torch.Generator().manual_seed(sum(map(ord, model_type)) + 1)
    config, weights = CHECKPOINTS[model_type](gen)
    written = config if layout == "legacy" else transformers5_layout(config)
    if edit is not None:
        written = json.loads(json.dumps(written))
        edit(written)
    directory = tmp_path / f"{model_type}_{layout}"
    write_checkpoint(directory, written, weights)
    return directory, config, weights


@pytest.mark.parametrize("model_type", list(CHECKPOINTS))
def test_both_layouts_give_the_same_right_logits(tmp_path, model_type):
    legacy_dir, config, weights = checkpoint(tmp_path, model_type, "legacy")
    new_dir, _, _ = checkpoint(tmp_path, model_type, "transformers5")
    assert "rope_theta" not in json.loads((new_dir / "config.json").read_text())
    legacy, new = load_hf_checkpoint(legacy_dir), load_hf_checkpoint(new_dir)
    assert new.config == legacy.config
    tokens = torch.randint(0, config["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        legacy_logits, new_logits = legacy(tokens), new(tokens)
    assert torch.equal(new_logits, legacy_logits)
    for b in range(2):
        expected = reference_logits(config, weights, tokens[b])
        torch.testing.assert_close(new_logits[b], expected, rtol=1e-4, atol=1e-4)

        # The settings the old reader lost would show at this tolerance: rope_theta 10000 instead of
        # the config's, and no YaRN (the test is not blind to them).
        if config["rope_theta"] != 10000.0:
            lost = reference_logits(dict(config, rope_theta=10000.0), weights, tokens[b])
            assert not torch.allclose(lost, expected, rtol=1e-4, atol=1e-4)
        if config.get("rope_scaling"):
            plain = dict(config["rope_scaling"], factor=1.0, mscale_all_dim=0.0)  # YaRN at factor 1 is plain rotary
            lost = reference_logits(dict(config, rope_scaling=plain), weights, tokens[b])
            assert not torch.allclose(lost, expected, rtol=1e-4, atol=1e-4)


def test_a_hand_merged_config_with_both_layouts_loads_when_they_agree(tmp_path):
    directory, config, _ = checkpoint(tmp_path, "deepseek_v3", "transformers5",
                                      edit=lambda c: c.update(rope_theta=10000, rope_scaling=legacy_scaling(c)))
    model = load_hf_checkpoint(directory)
    assert model.config.rope_theta == 10000.0
    assert model.config.rope_scaling == dict(config["rope_scaling"], type="yarn")


def legacy_scaling(config: dict, **changes) -> dict:
    """A transformers-5 rope_parameters dict as a legacy rope_scaling dict (without rope_theta)."""
    return {key: value for key, value in config["rope_parameters"].items() if key != "rope_theta"} | changes


def _drop(*paths):
    def edit(config):
        for path in paths:
            *parents, key = path.split(".")
            target = config
            for parent in parents:
                target = target[parent]
            del target[key]
    return edit


@pytest.mark.parametrize("model_type, layout, edit, message", [
    ("mixtral", "legacy", _drop("rope_theta"), "'rope_theta' or 'rope_parameters.rope_theta'"),
    ("mixtral", "transformers5", _drop("rope_parameters.rope_theta"), "'rope_theta' or 'rope_parameters.rope_theta'"),
    ("qwen3_moe", "transformers5", _drop("num_local_experts"), "'num_experts' or 'num_local_experts'"),
    ("qwen3_moe", "legacy", _drop("norm_topk_prob"), "'norm_topk_prob'"),
    ("qwen3_moe", "legacy", _drop("rms_norm_eps"), "'rms_norm_eps'"),
    ("deepseek_v3", "legacy", _drop("routed_scaling_factor"), "'routed_scaling_factor'"),
    ("deepseek_v3", "transformers5", _drop("n_group"), "'n_group'"),
    ("deepseek_v3", "transformers5", _drop("rope_parameters.factor"), "rope_parameters has no 'factor'"),
    ("deepseek_v3", "legacy", _drop("rope_scaling.original_max_position_embeddings"),
     "rope_scaling has no 'original_max_position_embeddings'"),
])
def test_a_key_that_changes_the_numbers_and_is_missing_is_an_error(tmp_path, model_type, layout, edit, message):
    directory, _, _ = checkpoint(tmp_path, model_type, layout, edit)
    with pytest.raises(CheckpointError) as error:
        load_hf_checkpoint(directory)
    text = str(error.value)
    assert text.startswith(str(directory / "config.json") + ": ") and message in text and "\n" not in text


@pytest.mark.parametrize("model_type, edit, message", [
    ("mixtral", lambda c: c.update(rope_theta=10000.0), "rope_theta=10000.0 and rope_parameters.rope_theta=1000000.0"),
    ("qwen3_moe", lambda c: c.update(num_experts=6), "num_experts=6 and num_local_experts=8"),
    ("deepseek_v3", lambda c: c.update(rope_scaling=legacy_scaling(c, factor=8.0)),
     "YaRN settings in rope_scaling and rope_parameters that differ"),
    ("mixtral", lambda c: c["rope_parameters"].update(rope_type="linear", factor=2.0), "type ['linear']"),
    ("deepseek_v3", lambda c: c["rope_parameters"].update(attention_factor=1.2),
     "YaRN settings moetrain does not implement: ['attention_factor']"),
    ("deepseek_v3", lambda c: c.update(rope_interleave=False), "rope_interleave must be true"),
    ("qwen3_moe", lambda c: c.update(use_sliding_window=True, sliding_window=8), "use_sliding_window must be false"),
])
def test_conflicting_or_unsupported_settings_are_errors(tmp_path, model_type, edit, message):
    directory, _, _ = checkpoint(tmp_path, model_type, "transformers5", edit)
    with pytest.raises(CheckpointError) as error:
        load_hf_checkpoint(directory)
    assert message in str(error.value), str(error.value)
