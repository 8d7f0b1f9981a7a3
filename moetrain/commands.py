"""The commands that start from a run directory, and `moetrain --version`:

    moetrain eval RUN_DIR                                     # its own evaluation set
    moetrain eval RUN_DIR data.path=other.txt quant=fp8       # Hydra-style overrides of data and quant
    moetrain generate RUN_DIR --prompt "Once upon a time" --temperature 0.8 --top-p 0.95 --seed 0
    moetrain export RUN_DIR exported/ [--format qwen3_moe|deepseek_v3|mixtral|kimi_k2]
    moetrain convert-checkpoint --trust RUN_DIR               # rewrite old checkpoints you trust as data only
    moetrain tokenize corpus/ shards/ --tokenizer tokenizer.json --workers 4
    moetrain --version                                        # versions, and which kernels run here

moetrain.cli's entry point hands a command line to `dispatch` before Hydra reads it: a run
directory's checkpoints hold the config that trained them (moetrain.run.load_run), so these
commands need only what changes. Each one is a thin layer over the library (moetrain.run,
moetrain.evaluate, moetrain.generate, moetrain.export, moetrain.data.shards); every mistake in its input, theirs included,
ends like a training command's: one line `moetrain: error: ...` and exit code 2.

This module is command-line code beside cli.py: it reads eval's overrides with Hydra's override
grammar and checks them with the checks that both share (moetrain.command_errors) and the config
schema, so `data.batch_size=abc` or `quant=mxfp5` are refused with the same lines as in a training
command.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import struct
import sys
import textwrap
from importlib import resources
from pathlib import Path

import hydra
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import moetrain
from moetrain import ops
from moetrain.command_errors import (
    CONFIG_MODULE, EXIT_CONFIG_ERROR, EXIT_INTERRUPTED, check_target, explain, fail, in_config_keys, one_line,
    target_arguments,
)
from moetrain.config import ConfigError, Device, QuantConfig, SettingError, did_you_mean
from moetrain.data.shards import SHARD_BYTES, ShardError, tokenize_corpus
from moetrain.data.tokenizer import TokenizerError
from moetrain.evaluate import evaluate_run
from moetrain.export import ARCHITECTURES, EXPORTABLE, ExportError, export_hf
from moetrain.generate import check_settings, stream_text
from moetrain.models.hf import CheckpointError as HFCheckpointError
from moetrain.moe import MoELayer
from moetrain.ops import ExtensionUnavailable
from moetrain.quant import FORMATS, QuantPolicy
from moetrain.run import Run, RunError, load_run
from moetrain.train import checkpoint, resolve_device
from moetrain.train.checkpoint import CheckpointError

COMMANDS = ("eval", "generate", "export", "tokenize", "convert-checkpoint")
# The config groups eval's overrides may choose or change; the model is the run's own.
EVAL_GROUPS = ("data", "quant")
REPORTED = (ConfigError, RunError, SettingError, CheckpointError, HFCheckpointError, ExtensionUnavailable, ShardError,
            TokenizerError, OSError)

USAGE = """\
usage: moetrain [+recipe=NAME] [GROUP=OPTION] [KEY=VALUE ...]   train (the config groups and keys are below)
       moetrain eval RUN_DIR [data=NAME] [data.KEY=VALUE ...] [quant=NAME] [quant.KEY=VALUE ...]
                                       evaluate a run on its own evaluation set or other data, quantized or not
       moetrain generate RUN_DIR --prompt TEXT [--max-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
                                       generate text from a language-model run, printed as it comes
       moetrain export RUN_DIR OUT_DIR [--format qwen3_moe|deepseek_v3|mixtral|kimi_k2]
                                       write a language-model run as a Hugging Face checkpoint, with its tokenizer
       moetrain convert-checkpoint --trust RUN_DIR|CHECKPOINT
                                       rewrite checkpoints you trust that hold objects other than data (those
                                       of an earlier moetrain) as tensors, containers and numbers
       moetrain tokenize CORPUS OUT --tokenizer PATH [--workers N] [--text-key KEY]
                                       turn .txt/.jsonl/.jsonl.gz text into token shards for data=text data.path=OUT
       moetrain --version              versions, and which compiled kernels are built and run here
       moetrain COMMAND --help         a command's options (all of them: --step N picks a checkpoint)
"""


# ---- the parser ------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line (argparse prints the usage, then the error)."""

    def error(self, message: str):
        # parse_intermixed_args names the optional overrides as required too when RUN_DIR is missing.
        message = message.replace(", KEY=VALUE", "")
        fail(f"{self.prog}: {message} (see {self.prog} --help)", EXIT_CONFIG_ERROR)


def _step(text: str) -> int:
    if not re.fullmatch(r"\d+", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number (the N of checkpoints/step_N.pt)")
    return int(text)


def _device(text: str) -> torch.device:
    try:
        return resolve_device(Device(text))
    except ValueError:  # SettingError is a ValueError too: cuda without a GPU
        if text in {device.value for device in Device}:
            raise argparse.ArgumentTypeError("cuda, but no CUDA GPU is visible: use --device auto or cpu") from None
        raise argparse.ArgumentTypeError(f"choose auto, cpu or cuda, not {text!r}") from None


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                        help="a run directory the moetrain command wrote (runs/<date>_<time>_<name>)")
    parser.add_argument("--step", type=_step, default=None, metavar="N",
                        help="the checkpoint of this step (default: the newest intact one)")
    parser.add_argument("--device", type=_device, default="auto", metavar="{auto,cpu,cuda}",
                        help="auto (CUDA when a GPU is visible), cpu or cuda (default: auto)")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """One parser per command (each parses its own arguments, overrides and options intermixed)."""

    def command(name: str, description: str, epilog: str | None = None) -> argparse.ArgumentParser:
        parser = _Parser(prog=f"moetrain {name}", description=textwrap.fill(description, 100), epilog=epilog,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
        _run_arguments(parser)
        return parser

    evaluate = command(
        "eval", "Evaluate a run's model, as trained or with quantized routed experts, on its own evaluation set or "
                "on another data config; the metrics are printed as JSON.",
        epilog="overrides, in Hydra's syntax (group choices first, then keys, as in training):\n"
               "  data=NAME          the data config of that option (" + "|".join(_options("data")) + ")\n"
               "  data.KEY=VALUE     a key of the run's data config, or of data=NAME's; +data.KEY=VALUE adds one\n"
               "  quant=NAME         quantized routed experts (" + "|".join(_options("quant")) + ")\n"
               "  quant.KEY=VALUE    format, hot_format, hot_fraction, calibration_batches\n"
               "examples:\n"
               "  moetrain eval runs/RUN\n"
               "  moetrain eval runs/RUN data.path=held_out.txt quant=mxfp4 --eval-batches 20")
    evaluate.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="data and quant overrides (below)")
    evaluate.add_argument("--eval-batches", type=int, default=0, metavar="N",
                          help="evaluate the first N batches only (default 0: the whole evaluation set)")
    evaluate.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                          help="auto: bf16 autocast on CUDA, fp32 on a CPU (default: auto)")

    generate = command(
        "generate", "Generate from a language-model run, printing the new text as it comes (the prompt is not "
                    "repeated). Runs on text files take text; runs on token ids take ids separated by spaces.")
    generate.add_argument("--prompt", required=True, metavar="TEXT",
                          help="the text to continue (token ids '17 4 99' for runs on token ids)")
    generate.add_argument("--max-tokens", type=int, default=100, metavar="N",
                          help="tokens to generate (default 100; fewer when the end-of-text token comes)")
    generate.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0: greedy (default 1)")
    generate.add_argument("--top-k", type=int, default=0, metavar="K",
                          help="draw from the k most probable tokens (default 0: off)")
    generate.add_argument("--top-p", type=float, default=1.0, metavar="P",
                          help="then from the smallest set whose probability reaches p (default 1: off)")
    generate.add_argument("--seed", type=int, default=None, metavar="S",
                          help="seeds the draws (default: a fresh one, printed on stderr afterwards)")

    export = command(
        "export", "Write a language-model run's model as a Hugging Face checkpoint (config.json and safetensors, "
                  "and the run's tokenizer files) that transformers and moetrain.models.load_hf_checkpoint load with "
                  "the same logits. A run that started from a checkpoint (model=hf) is written as that checkpoint's "
                  "model_type, each tensor in its dtype there.")
    export.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="a new or empty folder")
    export.add_argument("--format", choices=EXPORTABLE, default=None,
                        help="the architecture to write (default: that of the checkpoint a model=hf run started "
                             "from, else the first of " + ", ".join(ARCHITECTURES) + " the model matches)")
    export.add_argument("--allow-dropless", action="store_true",
                        help="export a run trained with an expert capacity, whose tokens Hugging Face's models never "
                             "drop (their logits differ wherever the run dropped a token)")

    convert = _Parser(prog="moetrain convert-checkpoint", formatter_class=argparse.RawDescriptionHelpFormatter,
                      description=textwrap.fill(
                          "Rewrite checkpoints that hold objects other than tensors, containers and numbers (the "
                          "random states of an earlier moetrain), which every other command refuses to load, as "
                          "data only, with new checksums. This loads them once in full: any code a crafted file "
                          "holds runs, so --trust says you trust where they come from.", 100))
    convert.add_argument("path", metavar="RUN_DIR|CHECKPOINT", type=Path,
                         help="a run directory (every checkpoint in it), a step_N.pt file or a step_N/ directory")
    convert.add_argument("--trust", action="store_true",
                         help="required: you trust these files to run no harmful code while they are read")
    tokenize = _Parser(prog="moetrain tokenize", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=textwrap.fill(
                           "Tokenize a text corpus once into token shards that data=text data.path=OUT trains from, "
                           "memory-mapped. The shards are the same for any --workers; run the command again after an "
                           "interruption to continue (or, when it finished, to verify the shards).", 100))
    tokenize.add_argument("corpus", metavar="CORPUS", type=Path,
                          help="a .txt, .jsonl or .jsonl.gz file, or a directory of them (recursively)")
    tokenize.add_argument("out", metavar="OUT", type=Path, help="the shard directory: new, empty, or this command's own")
    tokenize.add_argument("--tokenizer", required=True, type=Path, metavar="PATH",
                          help="a tokenizer.json or a directory holding one (the Hugging Face layout)")
    tokenize.add_argument("--workers", type=int, default=1, metavar="N", help="processes that encode shards (default 1)")
    tokenize.add_argument("--text-key", default="text", metavar="KEY",
                          help="the field of each .jsonl line that holds its text (default: text)")
    return {"eval": evaluate, "generate": generate, "export": export, "tokenize": tokenize,
            "convert-checkpoint": convert}


# ---- eval's overrides --------------------------------------------------------------------------------
def _options(group: str) -> list[str]:
    """The options of a config group: conf/GROUP/*.yaml."""
    folder = resources.files(CONFIG_MODULE) / group
    return sorted(entry.name[: -len(".yaml")] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def _group_option(group: str, name) -> DictConfig:
    options = _options(group)
    if name not in options:
        raise ConfigError(f"unknown {group} option '{name}': choose {group}=" + "|".join(options)
                          + did_you_mean(name, options))
    return OmegaConf.load(resources.files(CONFIG_MODULE) / group / f"{name}.yaml")


def _apply(root: DictConfig, override) -> None:
    """One parsed override on the eval config (data and quant only)."""
    key = override.key_or_group
    group, _, rest = key.partition(".")
    if group not in EVAL_GROUPS:
        raise ConfigError(
            f"'{override.input_line}': moetrain eval takes data and quant overrides only (data=NAME, data.KEY=VALUE, "
            "quant=NAME, quant.KEY=VALUE); the model, gate and seed are the run's own")
    if override.is_sweep_override():
        raise ConfigError(f"'{override.input_line}': one value per key (moetrain eval does not sweep); run it once "
                          "per value")
    if not rest:
        if override.is_delete():
            instead = "data=NAME: a run is evaluated on some data" if group == "data" else "quant=none"
            raise ConfigError(f"'{override.input_line}': write {instead}")
        option = _group_option(group, override.value())
        root[group] = option if group == "data" else OmegaConf.merge(OmegaConf.structured(QuantConfig), option)
        return
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(root, parent_key)
    if override.is_delete():
        if not isinstance(parent, DictConfig) or leaf not in parent:
            raise ConfigError(f"'{override.input_line}': {key} is not set, so there is nothing to delete")
        del parent[leaf]
        return
    if isinstance(parent, DictConfig) and leaf not in parent and (group == "quant" or not override.is_add()):
        keys = [str(k) for k in parent.keys()]
        message = f"unknown key '{key}': {parent_key} has " + ", ".join(keys) + did_you_mean(leaf, keys)
        if group == "data":
            message += f"; to pass a new argument to data._target_, write +{key}=VALUE"
        raise ConfigError(message)
    OmegaConf.update(root, key, override.value(), merge=False, force_add=group == "data")


def eval_config(run: Run, overrides: list[str]) -> tuple[dict, QuantConfig]:
    """The data config and quant settings of `moetrain eval`: the run's data config and no
    quantization, with the overrides applied as Hydra applies them (data=NAME replaces the data
    config by that option's, data.KEY=VALUE changes a key; group choices first). The data config is
    checked as a training command checks it (its target takes each key, with a value of its type);
    the quant keys are typed by the schema (quant_policy checks their values). Raises ConfigError."""
    parser, parsed = OverridesParser.create(), []
    for text in overrides:  # one at a time, so that a message names the one that does not parse
        try:
            parsed += parser.parse_overrides([text])
        except HydraException as error:
            raise ConfigError(f"'{text}': {one_line(error)}") from None
    parsed.sort(key=lambda override: "." in override.key_or_group)
    # The run's seed too: a data option may read ${seed} (the held-out split of data=folder).
    root = OmegaConf.create({"seed": run.config.get("seed", 0), "data": run.config["data"]})
    root.quant = OmegaConf.structured(QuantConfig)
    try:
        for override in parsed:
            _apply(root, override)
        data = OmegaConf.to_container(root.data, resolve=True)
        quant: QuantConfig = OmegaConf.to_object(root.quant)
    except OmegaConfBaseException as error:  # a value of the wrong type, an interpolation that does not resolve
        raise ConfigError(explain(error, overrides)) from None
    if not isinstance(data.get("_target_"), str):
        raise ConfigError("data has no _target_: choose a data option (data=NAME) or set data._target_")
    check_target("data", data)
    return data, quant


def quant_policy(quant: QuantConfig) -> QuantPolicy | None:
    """The experts' formats eval's quant keys ask for (None: quant=none); ConfigError naming the key."""
    for key in ("format", "hot_format"):
        value = getattr(quant, key)
        if value is not None and value not in FORMATS:
            raise ConfigError(f"quant.{key} must be one of {'|'.join(FORMATS)} or null, got {value!r}"
                              + did_you_mean(value, FORMATS))
    if quant.format is None:
        if quant.hot_format is not None:
            raise ConfigError("quant.hot_format needs quant.format (the other experts' format) as well")
        return None
    if quant.calibration_batches < 0:
        raise ConfigError(f"quant.calibration_batches must be >= 0, got {quant.calibration_batches}")
    if not 0.0 <= quant.hot_fraction <= 1.0:
        raise ConfigError(f"quant.hot_fraction must be in [0, 1], got {quant.hot_fraction}")
    policy = QuantPolicy(quant.format, quant.hot_format, quant.hot_fraction)
    if policy.needs_calibration and quant.calibration_batches <= 0:
        raise ConfigError("quant.hot_format picks the most used experts: set quant.calibration_batches to a number > 0 "
                          "(training batches of the evaluated data)")
    return policy


# ---- the commands ------------------------------------------------------------------------------------
def _load(args) -> Run:
    return load_run(args.run_dir, step=args.step, device=args.device)


def run_eval(args) -> None:
    if args.eval_batches < 0:
        raise ConfigError(f"--eval-batches must be >= 0 (0: the whole evaluation set), got {args.eval_batches}")
    run = _load(args)
    data, quant = eval_config(run, args.overrides)
    if quant.export is not None:
        raise ConfigError("quant.export: moetrain eval does not write checkpoints; write a quantized one with "
                          f"moetrain +recipe=... mode=eval trainer.resume={args.run_dir} quant.export=PATH")
    policy = quant_policy(quant)
    metrics = evaluate_run(run, data=None if data == run.config["data"] else data, quant=policy,
                           calibration_batches=quant.calibration_batches, eval_batches=args.eval_batches,
                           progress=sys.stderr.isatty(), precision=args.precision)
    print(json.dumps({"step": run.step, **metrics}, indent=2))


def _prompt(run: Run, text: str) -> str | list[int]:
    """The prompt as the run takes it: text for byte-level runs, token ids for id runs."""
    if run.task != "language_modeling" or run.tokenizer is not None:
        return text  # text runs encode it; image runs are refused by generate itself
    if not re.fullmatch(r"\s*\d+([\s,]+\d+)*\s*", text):
        raise ConfigError(f"--prompt {text!r}: this run trained on token ids ({run.config['data']['_target_']}), "
                          "not text: give ids separated by spaces, e.g. --prompt '17 4 99'")
    return [int(token) for token in re.split(r"[\s,]+", text.strip())]


def run_generate(args) -> None:
    # The settings first: a mistake there costs no model load.
    check_settings(args.temperature, args.top_k, args.top_p, args.max_tokens)
    run = _load(args)
    prompt = _prompt(run, args.prompt)
    seed, drawn = args.seed, args.seed is None and args.temperature > 0 and args.top_k != 1
    if drawn:  # a fresh seed, told afterwards so that a text worth keeping can be drawn again
        seed = random.SystemRandom().randrange(2**31)
    try:
        for piece in stream_text(run, prompt, args.max_tokens, args.temperature, args.top_k, args.top_p, seed):
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        _end_text(seed if drawn else None)
        sys.exit(EXIT_INTERRUPTED)
    _end_text(seed if drawn else None)


def _end_text(drawn_seed: int | None) -> None:
    print(flush=True)  # the shell's prompt on a line of its own
    if drawn_seed is not None:
        print(f"moetrain: seed {drawn_seed} (--seed {drawn_seed} draws the same text again)", file=sys.stderr)


def run_export(args) -> None:
    run = _load(args)
    try:
        model_type = export_hf(run, args.out_dir, model_type=args.format, allow_dropless=args.allow_dropless)
    except ExportError as error:  # the library's argument is this command's flag
        raise ExportError(str(error).replace("allow_dropless=True", "--allow-dropless")) from None
    files = sorted(path.name for path in args.out_dir.iterdir())
    print(f"{args.out_dir}: {model_type} checkpoint of {args.run_dir} step {run.step} ({', '.join(files)})")


def run_convert_checkpoint(args) -> None:
    from moetrain.parallel import checkpoint as shards  # torch.distributed only for multi-process checkpoints
    from moetrain.parallel import sharded_checkpoint as sharded

    if not args.trust:
        raise ConfigError(f"convert-checkpoint loads {args.path} in full, which runs any code a crafted file holds: "
                          "add --trust if you trust where it comes from (every other command refuses such files)")
    if not args.path.exists():
        raise ConfigError(f"{args.path} does not exist: give a run directory, a step_N.pt file or a step_N/ directory")
    converted, entries = 0, checkpoint.candidates(str(args.path), args.path)[::-1]
    for entry in entries:
        if entries == [args.path]:  # the one checkpoint named: it must be complete
            checkpoint.check_complete(entry)
        elif not checkpoint.is_complete(entry):  # of a run directory: the others are still converted
            print(f"moetrain: warning: skipping {entry}: incomplete (the run stopped while saving it)", file=sys.stderr)
            continue
        if not entry.is_dir():
            digest = checkpoint.convert_trusted(entry)
            if digest is not None:
                checkpoint.write_checksums(checkpoint.checksum_path(entry), {entry.name: digest})
            changed = digest is not None
        elif sharded.is_sharded_checkpoint(entry):
            changed = sharded.convert_trusted(entry)
        else:
            changed = shards.convert_trusted(str(entry))
        converted += changed
        print(f"{entry}: {'converted to data only' if changed else 'data only already, left as it is'}")
    print(f"{converted} checkpoint(s) rewritten")


def run_tokenize(args) -> None:
    result = tokenize_corpus(args.corpus, args.out, args.tokenizer, workers=args.workers, text_key=args.text_key,
                             progress=sys.stderr.isatty())
    encoded = result["text_bytes_encoded"]
    speed = (f"{encoded / 1e6:.1f} MB of text at {encoded / 1e6 / result['seconds']:.1f} MB/s" if encoded
             else "every shard was already there and is verified")
    print(f"{args.out}: {result['documents']} documents, {result['tokens']} tokens in {len(result['shards'])} "
          f"{result['dtype']} shard(s); {speed}")
    if encoded and args.workers > len(result["shards"]):
        print(f"moetrain: note: {len(result['shards'])} shard(s) kept fewer than --workers={args.workers} busy: a worker "
              f"encodes one shard at a time, a shard holds about {SHARD_BYTES // 2**20} MiB of text (whole documents; a .txt "
              "file is one document), so a corpus spreads over N workers from N times that size", file=sys.stderr)


# ---- --version --------------------------------------------------------------------------------------
FATBIN_MAGIC = 0xBA55ED50  # a CUDA fat binary inside a shared library: the device code of each architecture
FATBIN_PTX, FATBIN_CUBIN = 1, 2


def cuda_architectures(library: bytes) -> list[str]:
    """The GPU architectures a shared library holds device code for, read from its fat binaries:
    sm_XY for compiled code (runs on that architecture), compute_XY for PTX (compiled by the driver
    for XY and newer). Each fat binary is a 16-byte header (magic, version, header size, size of
    the entries) and entries of their own header (kind, header size, payload size, ..., the
    architecture as a 32-bit number at byte 28) and payload."""
    found = set()
    start = library.find(struct.pack("<I", FATBIN_MAGIC))
    while start != -1 and start + 16 <= len(library):
        _, header_size, entries_size = struct.unpack_from("<HHQ", library, start + 4)
        entry, end = start + header_size, min(start + header_size + entries_size, len(library))
        while entry + 32 <= end:
            kind, _, entry_header_size, payload_size = struct.unpack_from("<HHIQ", library, entry)
            (architecture,) = struct.unpack_from("<I", library, entry + 28)
            if kind in (FATBIN_PTX, FATBIN_CUBIN) and 0 < architecture < 1000:
                found.add(("compute_" if kind == FATBIN_PTX else "sm_") + str(architecture))
            if entry_header_size == 0:
                break  # not a fat binary after all: the magic number also occurs by chance
            entry += entry_header_size + payload_size
        start = library.find(struct.pack("<I", FATBIN_MAGIC), start + 4)
    return sorted(found, key=lambda name: (int(name.rpartition("_")[2]), name))


def kernel_check(device: torch.device) -> str | None:
    """Run the compiled kernels on `device` (an MoE layer's forward and backward: routing, dispatch,
    experts, combine) against the pure-torch reference; None when they agree, else what differs."""
    x_TD = torch.randn(37, 16, generator=torch.Generator().manual_seed(0)).to(device)
    layers = [MoELayer(model_dim=16, num_experts=4, hidden_size=24, top_k=2, impl=impl) for impl in ("kernel", "torch")]
    layers[1].load_state_dict(layers[0].state_dict())
    outputs, gradients = [], []
    for layer in layers:
        layer.to(device).eval()  # eval: no router noise, the two layers route alike
        x = x_TD.clone().requires_grad_(True)
        y_TD = layer(x)
        y_TD.square().sum().backward()
        outputs.append(y_TD.detach().cpu())
        gradients.append(x.grad.cpu())
    for name, (kernel, reference) in (("output", outputs), ("input gradient", gradients)):
        if not torch.allclose(kernel, reference, rtol=1e-4, atol=1e-5):
            worst = float((kernel - reference).abs().max())
            return f"the {name} differs from the pure-torch reference by up to {worst:.3g}"
    return None


def _ran(device: torch.device) -> str:
    try:
        problem = kernel_check(device)
    except Exception as error:  # noqa: BLE001 - the report is the point: say how it failed, in one line
        return f"fails here ({type(error).__name__}: {one_line(error)[:300]})"
    return "ran here and matches the pure-torch reference" if problem is None else f"WRONG here: {problem}"


def version_report() -> str:
    lines = [f"moetrain {moetrain.__version__} (torch {torch.__version__}, hydra-core {hydra.__version__})"]
    try:
        extension = ops.load()
    except ExtensionUnavailable as error:
        lines.append(f"kernels: unavailable: {one_line(error)}")
        lines.append("  without them a run needs gate.impl=torch (the pure-torch path)")
        return "\n".join(lines)
    lines.append(f"kernels: {extension.__file__}")
    lines.append(f"  CPU:  built; {_ran(torch.device('cpu'))}")
    if not ops.has_cuda_kernels():
        lines.append("  CUDA: not built (compiled without nvcc or with MOETRAIN_CUDA=0): on a GPU, runs need "
                     "gate.impl=torch or a rebuild with CUDA")
        return "\n".join(lines)
    architectures = cuda_architectures(Path(extension.__file__).read_bytes())
    built = f"built for {' '.join(architectures)}" if architectures else "built (architectures not readable)"
    if not torch.cuda.is_available():
        lines.append(f"  CUDA: {built}; not run: torch sees no CUDA GPU here")
        return "\n".join(lines)
    major, minor = torch.cuda.get_device_capability()
    gpu = f"{torch.cuda.get_device_name()}, sm_{major}{minor}"
    lines.append(f"  CUDA: {built}; on GPU 0 ({gpu}): {_ran(torch.device('cuda'))}")
    return "\n".join(lines)


# ---- the entry --------------------------------------------------------------------------------------
RUNNERS = {"eval": run_eval, "generate": run_generate, "export": run_export, "tokenize": run_tokenize,
           "convert-checkpoint": run_convert_checkpoint}


def dispatch(argv: list[str]) -> bool:
    """Run the command argv asks for when it is one of this module's (then True); for `--help`,
    print their usage first and leave the rest of the help to Hydra (False), as for training."""
    if argv[:1] and argv[0] in COMMANDS:
        main(argv)
        return True
    if "--version" in argv:  # anywhere, as Hydra's own --version would be: before Hydra's parser
        print(version_report())
        return True
    if "--help" in argv or "-h" in argv:
        print(USAGE)
    return False


def main(argv: list[str]) -> None:
    """`moetrain eval|generate|export|tokenize|convert-checkpoint ...`: a mistake is one line and exit code 2."""
    logging.basicConfig(level=logging.WARNING, format="moetrain: warning: %(message)s")  # skipped checkpoints
    name, *arguments = argv
    args = _parsers()[name].parse_intermixed_args(arguments)
    try:
        RUNNERS[name](args)
    except BrokenPipeError:
        raise  # `moetrain generate ... | head`: cli.main ends quietly, as for --help
    except REPORTED as error:
        fail(_error_line(error), EXIT_CONFIG_ERROR)
    except KeyboardInterrupt:
        fail("interrupted", EXIT_INTERRUPTED)


def _error_line(error: BaseException) -> str:
    if isinstance(error, OSError):
        where = f" {error.filename}" if error.filename else ""
        return f"cannot use{where}: {error.strerror or error}: fix the path or its permissions"
    if isinstance(error, RunError) and error.data_target:  # the data builder's arguments are data.KEY
        return in_config_keys(str(error), "data", target_arguments(error.data_target))
    return in_config_keys(str(error))
