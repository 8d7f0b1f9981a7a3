"""Load Hugging Face-format checkpoints (config.json + *.safetensors) into MoETransformerLM, and
save one the other way.

    from moetrain.models import load_hf_checkpoint, save_hf_checkpoint
    model = load_hf_checkpoint("path/to/Qwen3-30B-A3B", dtype=torch.bfloat16, device="cuda")
    save_hf_checkpoint(model, "path/to/finetuned", "qwen3_moe")
    model = pretrained_lm("path/to/Qwen3-30B-A3B")   # to train: float32 weights, `model=hf model.path=...`

Supported model_type values: qwen3_moe, mixtral, deepseek_v3 and kimi_k2 (Kimi-K2 ships the
DeepSeek-V3 architecture under its own name). Tensors keep their HF names on disk; here each of
moetrain's parameters says which HF tensors it is made of (per-expert matrices are stacked into
[E, D, H] / [E, H, D]). Any parameter without its tensors, or any tensor nothing uses, is an error
that names them. Blockwise-FP8 weights (DeepSeek-V3 / Kimi-K2 releases: `weight` in float8 with a
`weight_scale_inv` per 128x128 block) are dequantised on load. The multi-token-prediction layers
of DeepSeek-V3 (model.layers.{num_hidden_layers}...) are not part of the model and are skipped.
Routing is dropless (capacity_factor=0) unless overridden, so logits match the reference code.
config.json is read in the layout of transformers 4 and of transformers 5 (rope_parameters,
num_local_experts); a setting that changes the outputs and cannot be read is an error, not a default.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from moetrain.models.lm import LMConfig, MoETransformerLM
from moetrain.models.safetensors_format import SafetensorsFile, save_file
from moetrain.moe import MoELayer, is_expert_param, moe_layers

MODEL_TYPES = ("qwen3_moe", "mixtral", "deepseek_v3", "kimi_k2")


class CheckpointError(ValueError):
    """The checkpoint does not fit the architecture its config.json names."""


def _require(config: dict, condition: bool, message: str) -> None:
    if not condition:
        raise CheckpointError(f"unsupported {config.get('model_type')} config: {message}")


# Keys that change the numbers but not the tensor shapes have no default here: a config.json
# without one is an error naming it (the tensors check everything that has a shape).
_MISSING = object()


def _read(config: dict, *keys: str):
    """The value of the key present (not null) among `keys`, a dotted key looking inside a dict
    ("rope_parameters.rope_theta"); none present, or two with different values, is a CheckpointError
    naming them."""
    found = {}
    for key in keys:
        value = config
        for part in key.split("."):
            value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
        if value is not _MISSING and value is not None:
            found[key] = value
    if not found:
        either = " or ".join(repr(key) for key in keys)
        raise CheckpointError(f"config.json has no {either}: moetrain assumes no default for it (a wrong "
                              f"guess would change the model's outputs); add it")
    values = list(found.values())
    if any(value != values[0] for value in values[1:]):
        settings = " and ".join(f"{key}={value!r}" for key, value in found.items())
        raise CheckpointError(f"config.json sets {settings}: they must agree")
    return values[0]


# The layouts of the rotary settings: transformers < 5 writes `rope_theta` and `rope_scaling` at the
# top level; transformers 5 writes one `rope_parameters` dict with `rope_type`, `rope_theta` and the
# scaling keys. Both are read; a checkpoint converted by hand may hold both, if they agree.
_YARN_KEYS = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}
_ROPE_KIND_KEYS = ("type", "rope_type")


def _rope_theta(config: dict) -> float:
    return float(_read(config, "rope_theta", "rope_parameters.rope_theta"))


def _rope_scaling(config: dict) -> dict | None:
    """The YaRN settings ({"type": "yarn", ...}) of either layout, or None for plain rotary."""
    layouts = {}
    legacy = config.get("rope_scaling")
    if legacy is not None:
        layouts["rope_scaling"] = legacy
    parameters = config.get("rope_parameters")
    if parameters is not None:
        _require(config, isinstance(parameters, dict) and not any(isinstance(v, dict) for v in parameters.values()),
                 f"rope_parameters must be one dict of rotary settings (per-layer-type settings are not "
                 f"implemented), got {parameters!r}")
        scaling = {key: value for key, value in parameters.items()
                   if key not in ("rope_theta", "partial_rotary_factor")}
        partial = parameters.get("partial_rotary_factor", 1.0)
        _require(config, partial == 1.0,
                 f"rope_parameters.partial_rotary_factor={partial} (partial rotary is not implemented)")
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            layouts["rope_parameters"] = scaling
    found = []
    for where, scaling in layouts.items():
        _require(config, isinstance(scaling, dict), f"{where} must be a dict, got {scaling!r}")
        kinds = {scaling[key] for key in _ROPE_KIND_KEYS if key in scaling}
        _require(config, kinds == {"yarn"}, f"{where} type {sorted(kinds) or None} (supported: none, 'yarn')")
        unknown = sorted(set(scaling) - _YARN_KEYS - set(_ROPE_KIND_KEYS))
        _require(config, not unknown, f"{where} has YaRN settings moetrain does not implement: {unknown}")
        for key in ("factor", "original_max_position_embeddings"):
            if key not in scaling:
                raise CheckpointError(f"config.json {where} has no {key!r}, which YaRN needs: add it")
        found.append({key: value for key, value in scaling.items() if key in _YARN_KEYS} | {"type": "yarn"})
    if len(found) == 2 and found[0] != found[1]:
        raise CheckpointError(f"config.json has YaRN settings in rope_scaling and rope_parameters that differ: "
                              f"{found[0]} and {found[1]}")
    return found[0] if found else None


def config_from_hf(config: dict, max_seq_len: int = 4096) -> LMConfig:
    """LMConfig for an HF config.json dict (as written by transformers 4 or 5). max_seq_len caps the
    rotary tables (the HF value can be 128K+ positions; pass a larger one to run longer sequences)."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"config.json model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    _require(config, _read(config, "hidden_act") == "silu", f"hidden_act {config.get('hidden_act')!r} (need 'silu')")
    rope_scaling = _rope_scaling(config)
    common = dict(
        vocab_size=_read(config, "vocab_size"),
        dim=_read(config, "hidden_size"),
        depth=_read(config, "num_hidden_layers"),
        num_heads=_read(config, "num_attention_heads"),
        norm_eps=float(_read(config, "rms_norm_eps")),
        rope_theta=_rope_theta(config),
        max_seq_len=min(max_seq_len, config.get("max_position_embeddings") or max_seq_len),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),  # a wrong guess fails on the lm_head tensor
        expert="swiglu",
        activation="silu",
    )
    top_k = _read(config, "num_experts_per_tok")
    if model_type in ("qwen3_moe", "mixtral"):
        _require(config, rope_scaling is None, "rope scaling (rope_scaling / rope_parameters.rope_type) must be none")
        head_dim = config.get("head_dim") or common["dim"] // common["num_heads"]
    if model_type == "qwen3_moe":
        _require(config, not config.get("mlp_only_layers"), "mlp_only_layers must be empty")
        _require(config, not config.get("use_sliding_window", False),
                 "use_sliding_window must be false (sliding-window attention is not implemented)")
        return LMConfig(
            **common,
            num_kv_heads=_read(config, "num_key_value_heads"),
            head_dim=head_dim,
            qk_norm=True,
            attention_bias=bool(config.get("attention_bias", False)),
            # transformers 5 writes Qwen3-MoE's expert count as num_local_experts.
            num_experts=_read(config, "num_experts", "num_local_experts"),
            expert_hidden_size=_read(config, "moe_intermediate_size"),
            dense_hidden_size=_read(config, "intermediate_size"),
            moe_every=config.get("decoder_sparse_step", 1),
            moe_kwargs={"gate": "top", "top_k": top_k, "capacity_factor": 0,
                        "gate_kwargs": {"normalize": bool(_read(config, "norm_topk_prob"))}},
        )
    if model_type == "mixtral":
        window = config.get("sliding_window")
        _require(config, window is None or window >= common["max_seq_len"],
                 f"sliding_window={window} shorter than max_seq_len (sliding-window attention is not implemented)")
        return LMConfig(
            **common,
            num_kv_heads=_read(config, "num_key_value_heads"),
            head_dim=head_dim,
            num_experts=_read(config, "num_local_experts"),
            expert_hidden_size=_read(config, "intermediate_size"),
            # Mixtral's softmax over the chosen logits equals a full softmax renormalised over the top-k.
            moe_kwargs={"gate": "top", "top_k": top_k, "capacity_factor": 0,
                        "gate_kwargs": {"normalize": True}},
        )
    # deepseek_v3 / kimi_k2. scoring_func and topk_method are not written by transformers (its code
    # implements only sigmoid / noaux_tc), so absent means those.
    _require(config, config.get("moe_layer_freq", 1) == 1, "moe_layer_freq must be 1")
    _require(config, config.get("scoring_func", "sigmoid") == "sigmoid", "scoring_func must be 'sigmoid'")
    _require(config, config.get("topk_method", "noaux_tc") == "noaux_tc", "topk_method must be 'noaux_tc'")
    _require(config, not config.get("attention_bias", False), "attention_bias must be false")
    # transformers' default (and DeepSeek's code) rotates interleaved pairs, as moetrain's MLA does.
    _require(config, config.get("rope_interleave", True) is True, "rope_interleave must be true")
    return LMConfig(
        **common,
        attention="mla",
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=_read(config, "kv_lora_rank"),
        qk_nope_head_dim=_read(config, "qk_nope_head_dim"),
        qk_rope_head_dim=_read(config, "qk_rope_head_dim"),
        v_head_dim=_read(config, "v_head_dim"),
        rope_scaling=rope_scaling,
        num_experts=_read(config, "n_routed_experts", "num_local_experts"),
        expert_hidden_size=_read(config, "moe_intermediate_size"),
        dense_hidden_size=_read(config, "intermediate_size"),
        num_shared_experts=config.get("n_shared_experts") or 0,
        first_dense=config.get("first_k_dense_replace", 0),
        moe_kwargs={"gate": "sigmoid", "top_k": top_k, "capacity_factor": 0,
                    "gate_kwargs": {"n_group": _read(config, "n_group"), "topk_group": _read(config, "topk_group"),
                                    "routed_scaling_factor": float(_read(config, "routed_scaling_factor")),
                                    "normalize": bool(_read(config, "norm_topk_prob"))}},
    )


# --- parameter name mapping -------------------------------------------------------------------
# A source is (HF tensor names, function from those tensors to moetrain's parameter, and the
# inverse function from the parameter to those tensors).


def _same(name: str):
    return [name], lambda tensors: tensors[0], lambda tensor: [tensor]


def _stacked_transposed(names: list[str]):
    # HF nn.Linear weights are [out, in] per expert; moetrain's experts hold [E, in, out].
    return names, lambda tensors: torch.stack(tensors).transpose(1, 2), lambda tensor: list(tensor.transpose(1, 2))


def _stacked_gate_up(gate_names: list[str], up_names: list[str]):
    """The gate and up projections of every expert as one fused [E, D, 2H] tensor, in the column
    order of moetrain.ops.swiglu (imported here: only experts with the fused parameter need it)."""
    from moetrain.ops import swiglu

    count = len(gate_names)

    def combine(tensors):
        return swiglu.interleave_gate_up(torch.stack(tensors[:count]).transpose(1, 2),
                                         torch.stack(tensors[count:]).transpose(1, 2))

    def split(tensor):
        gate, up = swiglu.split_gate_up(tensor)
        return list(gate.transpose(1, 2)) + list(up.transpose(1, 2))

    return gate_names + up_names, combine, split


def _attention_sources(ours: str, hf: str, config: LMConfig) -> dict:
    if config.attention == "mla":
        pairs = {"kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b_proj": "kv_b_proj", "o_proj": "o_proj"}
        if config.q_lora_rank is None:
            pairs["q_proj"] = "q_proj"
        else:
            pairs.update(q_a_proj="q_a_proj", q_a_norm="q_a_layernorm", q_b_proj="q_b_proj")
    else:
        pairs = {name: name for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        if config.qk_norm:
            pairs.update(q_norm="q_norm", k_norm="k_norm")
    sources = {f"{ours}.{mine}.weight": _same(f"{hf}.{theirs}.weight") for mine, theirs in pairs.items()}
    if config.attention_bias:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sources[f"{ours}.{name}.bias"] = _same(f"{hf}.{name}.bias")
    return sources


def _moe_sources(ours: str, hf: str, layer: MoELayer, model_type: str) -> dict:
    experts = range(layer.num_experts)
    if model_type == "mixtral":
        hf_moe, names = f"{hf}.block_sparse_moe", {"w_gate": "w1", "w_down": "w2", "w_up": "w3"}
    else:
        hf_moe, names = f"{hf}.mlp", {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
    sources = {f"{ours}.gate.weight_ED": _same(f"{hf_moe}.gate.weight")}
    per_expert = {mine: [f"{hf_moe}.experts.{e}.{theirs}.weight" for e in experts] for mine, theirs in names.items()}
    if "w_gate_up" in dict(layer.experts.named_parameters()):  # SwiGLU experts holding gate and up as one tensor
        sources[f"{ours}.experts.w_gate_up"] = _stacked_gate_up(per_expert.pop("w_gate"), per_expert.pop("w_up"))
    for mine, hf_names in per_expert.items():
        sources[f"{ours}.experts.{mine}"] = _stacked_transposed(hf_names)
    if model_type in ("deepseek_v3", "kimi_k2"):
        sources[f"{ours}.gate.expert_bias"] = _same(f"{hf_moe}.gate.e_score_correction_bias")
    if layer.shared is not None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            sources[f"{ours}.shared.{name}.weight"] = _same(f"{hf_moe}.shared_experts.{name}.weight")
    return sources


def hf_sources(model: MoETransformerLM, model_type: str) -> dict[str, tuple[list[str], Callable, Callable]]:
    """moetrain parameter/buffer name -> (HF tensor names, combine function, split function)."""
    config = model.config
    sources = {"embed.weight": _same("model.embed_tokens.weight"), "norm.weight": _same("model.norm.weight")}
    if not config.tie_embeddings:
        sources["lm_head.weight"] = _same("lm_head.weight")
    for i, block in enumerate(model.blocks):
        ours, hf = f"blocks.{i}", f"model.layers.{i}"
        sources[f"{ours}.attn_norm.weight"] = _same(f"{hf}.input_layernorm.weight")
        sources[f"{ours}.ffn_norm.weight"] = _same(f"{hf}.post_attention_layernorm.weight")
        sources.update(_attention_sources(f"{ours}.attn", f"{hf}.self_attn", config))
        if isinstance(block.ffn, MoELayer):
            sources.update(_moe_sources(f"{ours}.ffn", hf, block.ffn, model_type))
        else:
            for name in ("gate_proj", "up_proj", "down_proj"):
                sources[f"{ours}.ffn.{name}.weight"] = _same(f"{hf}.mlp.{name}.weight")
    return sources


# --- reading ----------------------------------------------------------------------------------


def _open_checkpoint(directory: Path) -> dict[str, SafetensorsFile]:
    """Every tensor name -> its file, each file's header checked (moetrain.models.safetensors_format)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {directory}")
    where: dict[str, SafetensorsFile] = {}
    for path in files:
        try:
            opened = SafetensorsFile(path)
        except ValueError as error:
            raise CheckpointError(str(error)) from None
        for name in opened.names():
            if name in where:
                raise CheckpointError(f"tensor {name!r} is in both {where[name].path.name} and {path.name}")
            where[name] = opened
    return where


# The LMConfig fields that size the model: each is checked against the weight files before anything
# is built, so that a config.json claiming hidden_size=10**9 costs no memory (nor a model of 10**9 layers).
SIZES = ("vocab_size", "dim", "depth", "num_heads", "num_experts", "expert_hidden_size", "dense_hidden_size",
         "num_kv_heads", "head_dim", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
         "v_head_dim", "num_shared_experts", "moe_every", "first_dense")
# Where config.json gives each (the first key present; the field's own name otherwise).
HF_KEYS = {"vocab_size": ("vocab_size",), "dim": ("hidden_size",), "depth": ("num_hidden_layers",),
           "num_heads": ("num_attention_heads",), "num_kv_heads": ("num_key_value_heads",),
           "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
           "expert_hidden_size": ("moe_intermediate_size", "intermediate_size"), "dense_hidden_size": ("intermediate_size",),
           "num_shared_experts": ("n_shared_experts",), "moe_every": ("decoder_sparse_step",),
           "first_dense": ("first_k_dense_replace",)}
MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")  # MLA only
MAX_CONFIG_BYTES = 1 << 24
EMBEDDING = "model.embed_tokens.weight"  # [vocab_size, hidden_size] in every supported layout  # a config.json is a few kB: larger is not one


def _check_sizes(config: LMConfig, hf_config: dict, tensors: dict[str, SafetensorsFile], directory: Path) -> None:
    """Refuse sizes the weight files cannot back: the embedding must be [vocab_size, hidden_size] as
    config.json says, there must be as many layers as num_hidden_layers, and no size can exceed the
    largest dimension of any tensor in the files (every size is one of them, or a factor of one)."""
    shapes = {name: file.shape(name) for name, file in tensors.items()}
    largest = max((size for shape in shapes.values() for size in shape), default=0)
    layers = {int(m.group(1)) for name in shapes if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    for field in SIZES:
        value = getattr(config, field)
        unused = (field in MLA_SIZES and config.attention != "mla") or \
            (field == "dense_hidden_size" and not config.first_dense and config.moe_every == 1)  # no dense block
        if unused or (value is None and field in ("dense_hidden_size", "num_kv_heads", "head_dim", "q_lora_rank")):
            continue
        key = next((key for key in HF_KEYS.get(field, ()) if key in hf_config), field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{directory}/config.json gives {key}={value!r}: it must be a whole number >= 0")
        if value > max(largest, 1):
            raise CheckpointError(f"{directory}/config.json gives {key}={value}, larger than any tensor dimension "
                                  f"in its weight files ({largest}): the config does not describe these weights")
    embedding = shapes.get(EMBEDDING)
    if embedding is not None and embedding != [config.vocab_size, config.dim]:
        raise CheckpointError(f"{directory}/config.json gives vocab_size={config.vocab_size}, hidden_size={config.dim}, "
                              f"but {EMBEDDING} has shape {tuple(embedding)}, not {(config.vocab_size, config.dim)}: the config "
                              "does not describe these weights")
    if config.depth > len(layers):
        raise CheckpointError(f"{directory}/config.json gives num_hidden_layers={config.depth}, but the weight files "
                              f"hold {len(layers)} layer(s): the config does not describe these weights")


def _dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """weight (float8) * its 128x128-block scale -> float32 (DeepSeek-V3's weight_scale_inv)."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def load_hf_checkpoint(
    directory: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    max_seq_len: int = 4096,
    **overrides,
) -> MoETransformerLM:
    """Build the model its config.json describes and load its safetensors weights.

    dtype: default the config's torch_dtype (float32 when absent). overrides: LMConfig fields to
    change after conversion, e.g. moe_kwargs={..., "impl": "torch"} or dropout.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory} has no config.json")
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{config_path} is {config_path.stat().st_size} bytes: not a model's config.json")
    try:
        hf_config = json.loads(config_path.read_text())
        if not isinstance(hf_config, dict):
            raise CheckpointError(f"it holds a JSON {type(hf_config).__name__}, not an object")
        config = config_from_hf(hf_config, max_seq_len)
    except (CheckpointError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{config_path}: {' '.join(str(error).split())}") from None
    except TypeError as error:  # a size given as a string, a list, ...
        raise CheckpointError(f"{config_path} has a setting of the wrong type ({error})") from None
    if overrides:
        config = config.replace(**overrides)
    if dtype is None:
        dtype = getattr(torch, str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"))
    model_type = hf_config["model_type"]

    # The weight files' headers first: the sizes config.json claims are checked against them before
    # the model is built, and every tensor's shape before any memory is allocated.
    tensors = _open_checkpoint(directory)
    _check_sizes(config, hf_config, tensors, directory)
    with torch.device("meta"):
        model = MoETransformerLM(config)
    sources = hf_sources(model, model_type)

    # DeepSeek-V3 ships its multi-token-prediction module as extra layers after the last one.
    mtp_layer = re.compile(r"model\.layers\.(\d+)\.")
    skipped = {n for n in tensors if (m := mtp_layer.match(n)) and int(m.group(1)) >= config.depth
               and hf_config.get("num_nextn_predict_layers", 0) > 0}
    scales = {n for n in tensors if n.endswith(".weight_scale_inv")}
    wanted = {name for names, _, _ in sources.values() for name in names}
    missing = sorted(n for n in wanted if n not in tensors)
    unexpected = sorted(n for n in tensors if n not in wanted and n not in skipped and n not in scales)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing tensor(s): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensor(s): {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
        raise CheckpointError(f"checkpoint {directory} does not fit {model_type} ({config.depth} layers): " + "; ".join(parts))
    block = (hf_config.get("quantization_config") or {}).get("weight_block_size", [128, 128])
    planned = model.state_dict()  # on the meta device: shapes only
    for ours, (names, combine, _) in sources.items():
        value = combine([torch.empty(tensors[name].shape(name), device="meta") for name in names])
        if value.shape != planned[ours].shape:
            raise CheckpointError(
                f"tensor(s) {names[0]}{' ...' if len(names) > 1 else ''} give {ours} shape {tuple(value.shape)}, "
                f"the config implies {tuple(planned[ours].shape)}"
            )

    def get(name: str) -> torch.Tensor:
        try:
            return tensors[name].get(name)
        except ValueError as error:  # a dtype torch cannot hold
            raise CheckpointError(str(error)) from None

    def read(name: str) -> torch.Tensor:
        tensor = get(name)
        scale_name = name[: -len("weight")] + "weight_scale_inv"
        if scale_name in tensors:
            tensor = _dequantize_block_fp8(tensor, get(scale_name), block)
        return tensor

    # Allocate on the target device only now, then copy each parameter in (keeping the Parameter
    # objects, whose attributes mark the routed experts).
    # Moving off the meta device makes new Parameter objects: remember which ones are routed experts.
    expert_names = {name for name, param in model.named_parameters() if is_expert_param(param)}
    model.to(dtype=dtype)
    for layer in moe_layers(model):
        layer.gate.float()  # routers stay float32, as in the reference code (the bias decides ties)
    model.to_empty(device=device)
    model.tie_weights()
    for name, param in model.named_parameters():
        if name in expert_names:
            param.moe_expert = True
    state = model.state_dict()
    for ours, (names, combine, _) in sources.items():
        value = combine([read(name) for name in names])  # its shape was checked above
        with torch.no_grad():
            state[ours].copy_(value)
    _reset_derived_buffers(model)
    return model.eval()


def _reset_derived_buffers(model: MoETransformerLM) -> None:
    """Non-persistent buffers are not in checkpoints: counters start at zero, rotary tables are
    recomputed from the config."""
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            getattr(module, name).zero_()
    model.reset_rotary()


# --- starting a training run from a checkpoint ---------------------------------------------------

# How the safetensors header names the floating-point dtypes a checkpoint's weights are kept in. A
# tensor of another dtype (the float8 of block-quantised releases) is written back in the
# config's torch_dtype, dequantised.
_STORED_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class Pretrained:
    """Where a model built by pretrained_lm comes from, so that it can be written back in the same
    form (save_hf_checkpoint's `source`): the checkpoint directory, its config.json, and the dtype
    each HF tensor is written in."""

    path: Path
    config: dict
    dtypes: dict[str, torch.dtype]

    @property
    def model_type(self) -> str:
        return self.config["model_type"]


def read_pretrained_config(directory: str | Path) -> tuple[dict, LMConfig]:
    """The config.json of a checkpoint directory and the LMConfig it describes, checked before any
    weight is read: the directory holds config.json, it parses, names a supported model_type with
    settings moetrain implements, and every shard its model.safetensors.index.json names exists.
    CheckpointError with one line naming the problem otherwise."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory: give the folder of a Hugging Face checkpoint "
                              "(config.json and *.safetensors)")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory} has no config.json: give the folder of a Hugging Face checkpoint "
                              "(config.json and *.safetensors), as save_pretrained writes it")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{config_path} is not valid JSON ({error}): restore it from the checkpoint's "
                              "source") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} holds a JSON {type(config).__name__}, not an object of settings: "
                              "restore it from the checkpoint's source")
    if config.get("model_type") not in MODEL_TYPES:
        raise CheckpointError(f"{config_path} has model_type {config.get('model_type')!r}; moetrain builds "
                              f"{', '.join(MODEL_TYPES)}: start from a checkpoint of one of those")
    try:
        lm_config = config_from_hf(config)
    except CheckpointError as error:
        raise CheckpointError(f"{config_path}: {error}") from None
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            shards = set(json.loads(index_path.read_text())["weight_map"].values())
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index_path} is not a safetensors index (a JSON object with a weight_map): "
                                  "restore it from the checkpoint's source") from None
        missing = sorted(name for name in shards if not (directory / str(name)).is_file())
        if missing:
            raise CheckpointError(f"{directory} lacks {len(missing)} of the {len(shards)} shard(s) its "
                                  f"{index_path.name} names: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}; "
                                  "download them again")
    elif not any(directory.glob("*.safetensors")):
        raise CheckpointError(f"{directory} has no *.safetensors weights (moetrain reads safetensors, not "
                              "pytorch_model.bin): convert them or download the safetensors release")
    return config, lm_config


def stored_dtypes(directory: str | Path, config: dict) -> dict[str, torch.dtype]:
    """The dtype of each tensor of a checkpoint directory, as its safetensors headers give it (no
    tensor is read); float8 tensors and their block scales map to the config's torch_dtype. A shard
    whose header is damaged, or whose data does not reach as far as the header says (a truncated
    download), is a CheckpointError naming it."""
    from safetensors import SafetensorError, safe_open  # only where a checkpoint's own dtypes are kept

    written = getattr(torch, str(config.get("torch_dtype") or config.get("dtype") or "float32"))
    dtypes = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as opened:
                for name in opened.keys():
                    dtypes[name] = _STORED_FLOAT_DTYPES.get(opened.get_slice(name).get_dtype(), written)
        except SafetensorError as error:
            raise CheckpointError(f"{path} is not a complete safetensors file ({error}): it is damaged or "
                                  "truncated; download it again") from None
    return dtypes


def training_routing(config: dict, lm_config: LMConfig) -> dict:
    """The routing to train a checkpoint with (MoELayer keyword arguments): its own, as
    config_from_hf reads it, with the load-balancing loss its config.json names: the weight
    router_aux_loss_coef (Qwen3-MoE, Mixtral) or aux_loss_alpha (DeepSeek-V3's own config files,
    whose seq_aux asks for the per-sequence loss). Without one, the published value: DeepSeek-V3's
    sequence-wise 0.0001 for its layout, transformers' router_aux_loss_coef default 0.001 otherwise."""
    routing = dict(lm_config.moe_kwargs)
    weight = config.get("router_aux_loss_coef", config.get("aux_loss_alpha"))
    if not isinstance(weight, (int, float)) or isinstance(weight, bool):
        weight = 0.0001 if lm_config.attention == "mla" else 0.001
    routing["balance_loss_weight"] = float(weight)
    if config.get("seq_aux"):
        routing["balance_loss"] = "sequence"
    return routing


def pretrained_lm(path: str, max_seq_len: int | None = None, dropout: float = 0.0, vocab_size: int | None = None,
                  moe_kwargs: dict | None = None) -> MoETransformerLM:
    """The model of a Hugging Face checkpoint directory with its weights, ready to train: the
    architecture and (without moe_kwargs) the routing of its config.json, every weight in float32
    (the optimizer's master copy; bf16 checkpoints convert exactly, and save_hf_checkpoint writes
    them back in their own dtype). The command's `model=hf model.path=DIR`.

    max_seq_len: the longest sequence trained (the data's); at most the checkpoint's
    max_position_embeddings. vocab_size: the data's vocabulary, which must fit the checkpoint's
    embedding (the model keeps its own size). moe_kwargs: the routing of every MoE layer, replacing
    the checkpoint's whole (the command passes the checkpoint's own with the user's gate.* keys)."""
    config, lm_config = read_pretrained_config(path)
    positions = config.get("max_position_embeddings")
    if max_seq_len is not None and positions is not None and max_seq_len > positions:
        raise CheckpointError(f"sequences of {max_seq_len} tokens are longer than the {positions} positions of "
                              f"{Path(path) / 'config.json'} (max_position_embeddings): train on shorter sequences")
    if vocab_size is not None and vocab_size > lm_config.vocab_size:
        raise CheckpointError(f"the data's {vocab_size} token ids do not fit the {lm_config.vocab_size}-row embedding "
                              f"of {path}: use the checkpoint's tokenizer, or one whose vocabulary fits")
    moe_kwargs = training_routing(config, lm_config) if moe_kwargs is None else moe_kwargs
    overrides = {"dropout": dropout, "moe_kwargs": moe_kwargs}
    lm_config.replace(**overrides)  # a routing the layers refuse is the caller's error, raised here as it is
    dtypes = stored_dtypes(path, config)  # before the weights: names a truncated shard
    try:
        model = load_hf_checkpoint(path, dtype=torch.float32, max_seq_len=max_seq_len or 4096, **overrides)
    except ValueError as error:  # CheckpointError included: a tensor missing, left over, misshapen or unreadable
        raise CheckpointError(f"{path}: {' '.join(str(error).split())}: its weights do not fit its config.json; "
                              "download the checkpoint again (or fix config.json)") from None
    model.pretrained = Pretrained(Path(path), config, dtypes)
    return model.train()


# --- writing ----------------------------------------------------------------------------------


def hf_config(config: LMConfig, model_type: str) -> dict:
    """The HF config.json of a moetrain LM config, for an architecture it fits (else CheckpointError)."""
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    moe, gate_kwargs = config.moe_kwargs, config.moe_kwargs.get("gate_kwargs") or {}
    gate = moe.get("gate", "top")
    mla = model_type in ("deepseek_v3", "kimi_k2")
    problems = []
    if config.expert != "swiglu" or config.activation != "silu":
        problems.append(f"expert={config.expert!r}, activation={config.activation!r} (need swiglu experts with silu)")
    if config.attention != ("mla" if mla else "mha"):
        problems.append(f"attention={config.attention!r} (need {'mla' if mla else 'mha'})")
    if gate != ("sigmoid" if mla else "top"):
        problems.append(f"gate {gate!r} (need {'sigmoid' if mla else 'top'})")
    if model_type == "mixtral" and (config.qk_norm or config.first_dense or config.moe_every != 1 or config.num_shared_experts
                                    or not gate_kwargs.get("normalize", False)):
        problems.append("Mixtral has no q/k norm, no dense or shared FFN, and renormalised top-k weights")
    if model_type == "qwen3_moe" and (not config.qk_norm or config.first_dense or config.num_shared_experts):
        problems.append("Qwen3-MoE has q/k norms and no dense-first or shared experts")
    if mla and config.moe_every != 1:
        problems.append(f"moe_every={config.moe_every} (DeepSeek-V3 layouts need 1)")
    if problems:
        raise CheckpointError(f"this model does not fit {model_type}: " + "; ".join(problems))
    hf = {
        "model_type": model_type, "vocab_size": config.vocab_size, "hidden_size": config.dim,
        "num_hidden_layers": config.depth, "num_attention_heads": config.num_heads, "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta, "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu", "num_experts_per_tok": moe.get("top_k", 2),
    }
    if mla:
        return hf | {
            "q_lora_rank": config.q_lora_rank, "kv_lora_rank": config.kv_lora_rank,
            "qk_nope_head_dim": config.qk_nope_head_dim, "qk_rope_head_dim": config.qk_rope_head_dim,
            "v_head_dim": config.v_head_dim, "rope_scaling": config.rope_scaling, "attention_bias": False,
            "n_routed_experts": config.num_experts, "moe_intermediate_size": config.expert_hidden_size,
            "intermediate_size": config.dense_hidden_size or config.expert_hidden_size,
            "n_shared_experts": config.num_shared_experts, "first_k_dense_replace": config.first_dense,
            "moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "n_group": gate_kwargs.get("n_group", 1), "topk_group": gate_kwargs.get("topk_group", 1),
            "routed_scaling_factor": gate_kwargs.get("routed_scaling_factor", 1.0),
            "norm_topk_prob": gate_kwargs.get("normalize", True), "num_nextn_predict_layers": 0,
        }
    head_dim = config.head_dim or config.dim // config.num_heads
    hf |= {"num_key_value_heads": config.num_kv_heads or config.num_heads, "head_dim": head_dim}
    if model_type == "mixtral":
        return hf | {"num_local_experts": config.num_experts, "intermediate_size": config.expert_hidden_size,
                     "sliding_window": None}
    return hf | {
        "num_experts": config.num_experts, "moe_intermediate_size": config.expert_hidden_size,
        "intermediate_size": config.dense_hidden_size or config.expert_hidden_size,
        "decoder_sparse_step": config.moe_every, "mlp_only_layers": [], "attention_bias": config.attention_bias,
        "norm_topk_prob": gate_kwargs.get("normalize", False),
    }


# Settings of a source checkpoint's config.json that moetrain's model does not hold as the checkpoint
# has them (its max_seq_len is the trained sequence length): written back as they were.
_SOURCE_KEEPS = ("max_position_embeddings", "sliding_window")


def save_hf_checkpoint(model: MoETransformerLM, directory: str | Path, model_type: str,
                       max_shard_bytes: int = 5 * 2**30, source: Pretrained | None = None) -> None:
    """Write config.json, *.safetensors shards (HF parameter names) and their index, which
    load_hf_checkpoint and the HF implementations of `model_type` read.

    source: the checkpoint the model was started from (pretrained_lm sets `model.pretrained`), of
    this model_type. Each tensor is then written in the dtype it has there (float32 master weights
    of a bf16 checkpoint go back to bf16: untrained ones bit for bit), and config.json keeps the
    source's other keys (token ids, architectures, max_position_embeddings) beside moetrain's,
    which say the architecture and routing; a quantization_config goes, as the weights are
    written dequantised. The source's generation_config.json (its decoding defaults) is copied."""
    directory = Path(directory)
    config = hf_config(model.config, model_type)
    state = model.state_dict()
    tensors = {}
    for ours, (names, _, split) in hf_sources(model, model_type).items():
        tensors.update((name, tensor.detach().cpu().contiguous()) for name, tensor in zip(names, split(state[ours])))
    if source is not None:
        if source.model_type != model_type:
            raise CheckpointError(f"the model comes from a {source.model_type} checkpoint ({source.path}): write it as "
                                  f"{source.model_type}, or without its source to write {model_type}")
        tensors = {name: tensor.to(source.dtypes.get(name, tensor.dtype)) for name, tensor in tensors.items()}
        kept = {key: source.config[key] for key in _SOURCE_KEEPS if key in source.config}
        config = {key: value for key, value in source.config.items() if key != "quantization_config"} | config | kept
    # What load_hf_checkpoint builds in; transformers 5 reads "dtype", earlier versions "torch_dtype".
    config["torch_dtype"] = str(tensors["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    if "dtype" in config:
        config["dtype"] = config["torch_dtype"]
    shards: list[dict] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if source is not None and (source.path / "generation_config.json").is_file():
        shutil.copyfile(source.path / "generation_config.json", directory / "generation_config.json")
