"""Crafted Hugging Face checkpoints are refused with one line before anything large is allocated.

Each safetensors file here is written byte by byte as an attacker would (a header size of 2^63,
a header past the end, non-JSON, offsets past the end or overlapping, an unknown dtype, a shape
whose size disagrees with its bytes) and must be refused by SafetensorsFile and by
load_hf_checkpoint, naming the file. A config.json claiming absurd sizes beside good weights
(hidden_size=10**9, 10**9 layers, 10**9 experts) must be refused before the model is built: the
constructor is watched, and never called.
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from test_hf_loading import qwen3_checkpoint, write_checkpoint

from moetrain.models import CheckpointError, hf, load_hf_checkpoint
from moetrain.models.safetensors_format import SafetensorsFile


def crafted(header: bytes, data: bytes = b"", size: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if size is None else size) + header + data


def header(entries: dict) -> bytes:
    return json.dumps(entries).encode()


F32_8 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
CRAFTED = {
    "header size 2^63": (crafted(b"{}", size=2**63), "header too large"),
    "header past the end": (crafted(b"{}", size=1000), "invalid header length"),
    "shorter than its header size": (b"\x01\x02\x03", "header too small"),
    "non-JSON header": (crafted(b"{not json"), "invalid JSON"),
    "offsets past the end": (crafted(header({"a": {**F32_8, "shape": [4], "data_offsets": [0, 16]}}), bytes(8)),
                             "not fully covered"),
    "overlapping offsets": (crafted(header({"a": F32_8, "b": {**F32_8, "data_offsets": [4, 12]}}), bytes(12)),
                            "invalid offset for tensor `b`"),
    "unknown dtype": (crafted(header({"a": {**F32_8, "dtype": "Q7"}}), bytes(8)), "unknown variant `Q7`"),
    "shape disagreeing with its bytes": (crafted(header({"a": {**F32_8, "shape": [3]}}), bytes(8)),
                                         "invalid shape, data type, or offset"),
    "shape of 2^80 elements": (crafted(header({"a": {**F32_8, "shape": [2**40, 2**40]}}), bytes(8)), "overflow"),
}


def test_a_well_formed_file_is_read(tmp_path):
    """The control: the same byte layout, honest, reads back (so the refusals below are the checks')."""
    values = torch.randn(2)
    path = tmp_path / "ok.safetensors"
    path.write_bytes(crafted(header({"a": F32_8}), values.numpy().tobytes()))
    opened = SafetensorsFile(path)
    assert opened.names() == ["a"] and opened.shape("a") == [2] and torch.equal(opened.get("a"), values)


@pytest.mark.parametrize("name", list(CRAFTED))
def test_a_crafted_safetensors_file_is_refused(tmp_path, name):
    content, check = CRAFTED[name]
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError) as refused:
        SafetensorsFile(path)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and check in message, message


@pytest.fixture
def good_checkpoint(tmp_path):
    config, weights = qwen3_checkpoint(torch.Generator().manual_seed(0))
    directory = tmp_path / "good"
    write_checkpoint(directory, config, weights)
    return directory


@pytest.mark.parametrize("name", ["header size 2^63", "overlapping offsets", "unknown dtype"])
def test_load_hf_checkpoint_refuses_a_crafted_shard(good_checkpoint, tmp_path, name):
    directory = tmp_path / "crafted"
    shutil.copytree(good_checkpoint, directory)
    victim = sorted(directory.glob("*.safetensors"))[-1]
    victim.write_bytes(CRAFTED[name][0])
    with pytest.raises(CheckpointError) as refused:
        load_hf_checkpoint(directory)
    assert "\n" not in str(refused.value) and victim.name in str(refused.value) and CRAFTED[name][1] in str(refused.value)


ABSURD = {
    "hidden_size": ({"hidden_size": 10**9}, "hidden_size=1000000000, larger than any tensor dimension"),
    "vocab_size": ({"vocab_size": 63}, "model.embed_tokens.weight has shape (64, 32), not (63, 32)"),
    "num_hidden_layers": ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000"),
    "some layers": ({"num_hidden_layers": 3}, "hold 2 layer(s)"),
    "num_experts": ({"num_experts": 10**9}, "num_experts=1000000000"),
    "moe_intermediate_size": ({"moe_intermediate_size": 10**9}, "moe_intermediate_size=1000000000"),
    "negative heads": ({"num_attention_heads": -4}, "num_attention_heads=-4"),
    "a string": ({"hidden_size": "32"}, "hidden_size='32': it must be a whole number"),
}


@pytest.mark.parametrize("name", list(ABSURD))
def test_absurd_config_sizes_are_refused_before_the_model_is_built(good_checkpoint, monkeypatch, name):
    changes, expected = ABSURD[name]
    path = good_checkpoint / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    built = []
    original = hf.MoETransformerLM
    monkeypatch.setattr(hf, "MoETransformerLM", lambda *args, **kwargs: built.append(args) or original(*args, **kwargs))
    with pytest.raises(CheckpointError) as refused:
        load_hf_checkpoint(good_checkpoint)
    assert "\n" not in str(refused.value) and expected in str(refused.value), str(refused.value)
    assert built == []


def test_the_unchanged_checkpoint_builds_and_loads(good_checkpoint, monkeypatch):
    """The control of the test above: the spy sees the build of a checkpoint whose sizes hold."""
    built = []
    original = hf.MoETransformerLM
    monkeypatch.setattr(hf, "MoETransformerLM", lambda *args, **kwargs: built.append(args) or original(*args, **kwargs))
    assert load_hf_checkpoint(good_checkpoint).config.dim == 32 and len(built) == 1


def test_a_huge_config_json_is_not_read(good_checkpoint):
    (good_checkpoint / "config.json").write_bytes(b" " * (hf.MAX_CONFIG_BYTES + 1))
    with pytest.raises(CheckpointError, match="not a model's config.json"):
        load_hf_checkpoint(good_checkpoint)
