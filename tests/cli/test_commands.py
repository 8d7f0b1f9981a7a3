"""The commands on a run directory (`moetrain eval|generate|export`) and `moetrain --version`.

Two tiny language-model runs are trained once per module by the moetrain command (one on text
files, one on the synthetic token language). The commands then run as a user runs them: the
console script in a subprocess where that is what is checked (streaming to a pipe, exit codes and
stderr of a real process), otherwise cli.main in this process (an interpreter start costs seconds).
Their output is checked against the library (load_run, generate, stream_text, evaluate_run) and
against references computed here: an argmax loop, a per-token cross-entropy, the logits of the
exported checkpoint loaded back, the architectures in the extension's CUDA ELF headers.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from conftest import write_corpus

import moetrain
from moetrain import cli, commands, ops
from moetrain.data.text import ByteTokenizer
from moetrain.evaluate import evaluate_run
from moetrain.generate import generate, stream_text
from moetrain.models import load_hf_checkpoint
from moetrain.run import load_run

MOETRAIN = str(Path(sys.executable).parent / "moetrain")
TINY_LM = ["+recipe=qwen3_moe_lm", "data.seq_len=16", "data.batch_size=4", "data.eval_batch_size=4",
           "trainer.max_steps=3", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0", "trainer.eval_every=0",
           "trainer.progress_bar=false", "logger=none"]


def moetrain_command(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([MOETRAIN, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def in_process(argv: list[str], monkeypatch) -> None:
    """`moetrain ARGV` through the command's entry point, in this process."""
    monkeypatch.setattr(sys, "argv", ["moetrain", *argv])
    cli.main()


def train(run_dir: Path, *overrides: str) -> Path:
    with pytest.MonkeyPatch.context() as patch:
        in_process([*TINY_LM, *overrides, f"hydra.run.dir={run_dir}", "hydra/job_logging=none",
                    "hydra/hydra_logging=none"], patch)
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    corpus = root / "corpus"
    write_corpus(corpus)
    return {"text": train(root / "text", "data=text", f"data.path={corpus}", "data.eval_fraction=0.3"),
            "ids": train(root / "ids", "data.train_size=32", "data.eval_size=8")}


def argmax_loop(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos_id: int | None) -> list[int]:
    """Greedy decoding by its definition: append the largest logit of the last window position."""
    tokens, window = list(prompt), model.config.max_seq_len
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(torch.tensor([tokens[-window:]]))[0, -1].argmax())
            tokens.append(token)
            if token == eos_id:
                break
    return tokens[len(prompt):]


# ---- generate -----------------------------------------------------------------------------------------
def test_generate_prints_the_greedy_text_of_the_library(runs, tmp_path):
    prompt = "Le café"
    done = moetrain_command("generate", str(runs["text"]), "--prompt", prompt, "--max-tokens", "24",
                            "--temperature", "0", cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    run = load_run(runs["text"])
    eos = ByteTokenizer.eos_id
    new_ids = argmax_loop(run.model, [eos, *prompt.encode()], 24, eos_id=eos)
    expected = bytes(token for token in new_ids if token != eos).decode("utf-8", errors="replace")
    assert done.stdout == expected + "\n"
    assert done.stdout == "".join(stream_text(run, prompt, 24, temperature=0)) + "\n"


def test_generate_tells_a_drawn_seed_that_draws_the_same_text(runs, monkeypatch, capsys):
    in_process(["generate", str(runs["text"]), "--prompt", "plain", "--max-tokens", "12", "--temperature", "1.3",
                "--top-k", "50", "--top-p", "0.9"], monkeypatch)
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    seed = int(line.split()[2])
    assert line == f"moetrain: seed {seed} (--seed {seed} draws the same text again)"
    run = load_run(runs["text"])
    expected = "".join(stream_text(run, "plain", 12, temperature=1.3, top_k=50, top_p=0.9, seed=seed))
    assert captured.out == expected + "\n"


def test_generate_streams_each_token_as_it_comes(runs, tmp_path):
    """A million tokens would take hours: the first one arrives while the command still runs, and
    once the reader is gone (`moetrain generate ... | head -c 4`) it stops quietly."""
    prompt = torch.randint(0, 256, (4,)).tolist()
    process = subprocess.Popen([MOETRAIN, "generate", str(runs["ids"]), "--prompt", " ".join(map(str, prompt)),
                                "--max-tokens", "1000000", "--temperature", "0"], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = b""
        while not first.endswith(b" "):
            byte = process.stdout.read(1)
            assert byte, process.stderr.read().decode()
            first += byte
        assert process.poll() is None
        process.stdout.close()
        assert process.wait(timeout=60) == 141  # 128 + SIGPIPE, as other tools
        assert process.stderr.read() == b""
    finally:
        process.kill()
        process.wait()
    run = load_run(runs["ids"])
    expected = argmax_loop(run.model, prompt, 3, eos_id=None)
    assert int(first) == expected[0]
    assert generate(run.model, prompt, 3, temperature=0) == expected


# ---- eval ------------------------------------------------------------------------------------------------
def reference_loss(model: torch.nn.Module, eval_set) -> tuple[float, float]:
    """Mean cross-entropy in nats and bits per byte over every target, one sequence at a time."""
    losses, byte_losses = [], []
    with torch.no_grad():
        for index in range(len(eval_set)):
            inputs_T, targets_T = eval_set[index]
            loss_T = F.cross_entropy(model(inputs_T[None])[0], targets_T, reduction="none")
            losses += loss_T.tolist()
            byte_losses += loss_T[targets_T < ByteTokenizer.eos_id].tolist()
    return sum(losses) / len(losses), sum(byte_losses) / len(byte_losses) / math.log(2)


def test_eval_prints_the_metrics_of_evaluate_run(runs, tmp_path):
    done = moetrain_command("eval", str(runs["text"]), cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr  # no bar without a terminal
    printed = json.loads(done.stdout)
    run = load_run(runs["text"])
    expected = evaluate_run(run, progress=False)
    assert printed.keys() == {"step", *expected} and printed["step"] == 3
    for key, value in expected.items():
        assert printed[key] == pytest.approx(value, rel=1e-6), key
    loss, bits_per_byte = reference_loss(run.model, run.data.eval_set)
    assert printed["eval/loss"] == pytest.approx(loss, rel=1e-5)
    assert printed["eval/bits_per_byte"] == pytest.approx(bits_per_byte, rel=1e-5)


def test_eval_overrides_data_and_quant_and_picks_a_step(runs, monkeypatch, capsys):
    in_process(["eval", str(runs["ids"]), "quant=fp8", "data.eval_size=6", "--step", "2", "data.seed=5"], monkeypatch)
    printed = json.loads(capsys.readouterr().out)
    run = load_run(runs["ids"], step=2)
    other = {**run.config["data"], "eval_size": 6, "seed": 5}
    expected = evaluate_run(run, data=other, quant="fp8", progress=False)
    assert printed["step"] == 2 and printed.keys() == {"step", *expected}
    for key, value in expected.items():
        assert printed[key] == pytest.approx(value, rel=1e-6), key
    # data=NAME is that option's config file, whatever the order on the command line.
    in_process(["eval", str(runs["ids"]), "data.eval_size=6", "data=synthetic_lm", "data.seq_len=16",
                "data.train_size=8"], monkeypatch)
    printed = json.loads(capsys.readouterr().out)
    option = yaml.safe_load((Path(cli.__file__).parent.parent / "conf" / "data" / "synthetic_lm.yaml").read_text())
    option.update(eval_size=6, seq_len=16, train_size=8)
    expected = evaluate_run(load_run(runs["ids"]), data=option, progress=False)
    assert printed["eval/loss"] == pytest.approx(expected["eval/loss"], rel=1e-6)


# ---- export ------------------------------------------------------------------------------------------------
def test_export_writes_a_checkpoint_with_the_run_logits(runs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "hf"
    in_process(["export", str(runs["text"]), str(out)], monkeypatch)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.startswith(f"{out}: qwen3_moe checkpoint of {runs['text']} step 3 (")
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    run = load_run(runs["text"])
    loaded = load_hf_checkpoint(out)
    tokens_BT = torch.randint(0, run.model_inputs["vocab_size"], (3, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens_BT), run.model(tokens_BT), rtol=1e-5, atol=1e-5)


# ---- --version and --help ------------------------------------------------------------------------------------
def cubin_architectures(library: bytes) -> set[str]:
    """sm_XY of every CUDA ELF (OSABI 0x33 or 0x41) embedded in a library, read from its ELF header's
    e_flags: the architecture in bits 8-15 from ABI version 8 on, in bits 0-7 before."""
    found, start = set(), library.find(b"\x7fELF", 1)
    while start != -1:
        osabi, abi_version = library[start + 7], library[start + 8]
        if osabi in (0x33, 0x41) and library[start + 4] == 2:  # a 64-bit CUDA object
            (flags,) = struct.unpack_from("<I", library, start + 48)
            found.add(f"sm_{(flags >> 8) & 0xFF if abi_version >= 8 else flags & 0xFF}")
        start = library.find(b"\x7fELF", start + 4)
    return found


def test_version_says_which_kernels_are_built_and_run_here(monkeypatch, capsys):
    in_process(["--version"], monkeypatch)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"moetrain {moetrain.__version__} (torch {torch.__version__}, hydra-core " + lines[0].split()[-1]
    extension = ops.load()
    assert lines[1] == f"kernels: {extension.__file__}"
    assert lines[2] == "  CPU:  built; ran here and matches the pure-torch reference"
    if not ops.has_cuda_kernels():
        assert lines[3].startswith("  CUDA: not built")
        return
    built = set(lines[3].split("built for ")[1].split(";")[0].split())
    elves = cubin_architectures(Path(extension.__file__).read_bytes())
    if elves:  # compressed device code shows no ELF header
        assert {name for name in built if name.startswith("sm_")} == elves
    if torch.cuda.is_available():
        assert lines[3].endswith(": ran here and matches the pure-torch reference")
    else:
        assert lines[3].endswith("not run: torch sees no CUDA GPU here")


def test_version_reports_wrong_or_failing_kernels(monkeypatch):
    real_combine = ops.combine

    def off_by_one(buf_RD, dest_TK, weight_TK, impl="kernel"):
        out = real_combine(buf_RD, dest_TK, weight_TK, impl=impl)
        return out + 1 if impl == "kernel" else out

    monkeypatch.setattr(ops, "combine", off_by_one)
    assert commands.version_report().splitlines()[2] == (
        "  CPU:  built; WRONG here: the output differs from the pure-torch reference by up to 1")

    def broken(*args, impl="kernel"):
        raise RuntimeError("no kernel image is available for execution on the device\nsecond line")

    monkeypatch.setattr(ops, "combine", broken)
    assert commands.version_report().splitlines()[2] == (
        "  CPU:  built; fails here (RuntimeError: no kernel image is available for execution on the device "
        "second line)")


def test_architectures_are_read_from_fat_binaries():
    def entry(kind: int, architecture: int, payload: bytes) -> bytes:
        header = struct.pack("<HHIQIIHHI", kind, 0x0101, 64, len(payload), 0, 0, 1, 8, architecture)
        return header.ljust(64, b"\0") + payload

    entries = entry(2, 90, b"\x7fELF" + bytes(60)) + entry(1, 80, b".version 8.0\0") + entry(2, 100, bytes(16))
    fatbin = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(entries)) + entries
    library = os.urandom(1000) + fatbin + bytes(7) + fatbin
    assert commands.cuda_architectures(library) == ["compute_80", "sm_90", "sm_100"]
    assert commands.cuda_architectures(os.urandom(1000)) == []


def test_help_lists_the_commands(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        in_process(["--help"], monkeypatch)
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for usage in ("moetrain eval RUN_DIR", "moetrain generate RUN_DIR --prompt TEXT", "moetrain export RUN_DIR OUT_DIR",
                  "moetrain --version"):
        assert usage in text, usage
    assert "\nrecipe: " in text  # then Hydra's help, as before
    for command in commands.COMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            in_process([command, "--help"], monkeypatch)
        assert exit_info.value.code == 0 and capsys.readouterr().out.startswith(f"usage: moetrain {command} ")


# ---- bad input ------------------------------------------------------------------------------------------------
ERRORS = [
    (["eval", "{missing}"], "run directory {missing} does not exist"),
    (["eval", "{empty}"], "no checkpoint in {empty}/checkpoints"),
    (["eval", "{text}", "--step", "7"], "no checkpoint of step 7: it has step(s) 1, 2, 3"),
    (["eval", "{text}", "--step", "last"], "argument --step: 'last' is not a step number"),
    (["eval", "{text}", "data.seq_len=64"], "max_seq_len=64 but the run's model was built with max_seq_len=16"),
    (["eval", "{text}", "data=synthetic"], "the data is for classification but the run's model does language_modeling"),
    (["eval", "{ids}", "data.vocab_size=300"], "vocab_size=300 but the run's model was built with vocab_size=256"),
    (["eval", "{text}", "data.seq_lne=8"], "unknown key 'data.seq_lne'"),
    (["eval", "{text}", "+data.seq_lne=8"], "unknown key data.seq_lne: moetrain.data.text.text takes"),
    (["eval", "{text}", "data.batch_size=abc"], "bad value for data.batch_size"),
    (["eval", "{text}", "data=txt"], "unknown data option 'txt'"),
    (["eval", "{text}", "quant=mxfp5"], "choose quant=fp8|fp8_block|mixed|mxfp4|none|nvfp4 (did you mean mxfp4?)"),
    (["eval", "{text}", "quant.format=mxfp4", "quant.hot_format=fp8"], "set quant.calibration_batches"),
    (["eval", "{text}", "quant.hot_fraction=abc"], "bad value for quant.hot_fraction"),
    (["eval", "{text}", "quant=mixed", "quant.hot_fraction=1.5"], "quant.hot_fraction must be in [0, 1], got 1.5"),
    (["eval", "{text}", "quant.hot_format=fp8"], "quant.hot_format needs quant.format"),
    (["eval", "{text}", "+quant.scale=2"], "unknown key 'quant.scale': quant has format, hot_format, hot_fraction"),
    (["eval", "{text}", "~quant"], "write quant=none"),
    (["eval", "{text}", "~data.shuffle"], "data.shuffle is not set, so there is nothing to delete"),
    (["eval", "{text}", "data.path=${{nowhere}}"], "data.path: cannot resolve its interpolation"),
    (["eval", "{text}", "quant=fp8", "quant.export=q.pt"], "moetrain eval does not write checkpoints"),
    (["eval", "{text}", "gate.top_k=1"], "moetrain eval takes data and quant overrides only"),
    (["eval", "{text}", "data.seq_len=8,16"], "one value per key"),
    (["eval", "{text}", "data.seq_len=[8"], "data.seq_len=[8"),
    (["eval", "{text}", "--eval-batches", "-1"], "--eval-batches must be >= 0"),
    (["eval", "{text}", "--device", "tpu"], "choose auto, cpu or cuda, not 'tpu'"),
    (["eval", "{text}", "--bogus"], "unrecognized arguments: --bogus"),
    (["eval"], "the following arguments are required: RUN_DIR (see moetrain eval --help)"),
    (["generate", "{text}"], "the following arguments are required: --prompt"),
    (["generate", "{ids}", "--prompt", "hello"], "give ids separated by spaces"),
    (["generate", "{ids}", "--prompt", "1 999"], "prompt token id 999 is outside the model's vocabulary [0, 256)"),
    (["generate", "{text}", "--prompt", "a", "--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["generate", "{text}", "--prompt", "a", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["generate", "{text}", "--prompt", "a", "--max-tokens", "many"], "argument --max-tokens: invalid int value"),
    (["export", "{text}", "{text}"], "is not an empty folder"),
    (["export", "{text}", "{out}", "--format", "llama"], "argument --format: invalid choice: 'llama'"),
    (["export", "{text}", "{out}", "--format", "mixtral"], "mixtral"),
    (["export", "{damaged}", "{out}", "--step", "3"], "is corrupted"),
]


@pytest.mark.parametrize("argv, expected", ERRORS, ids=[" ".join(argv) for argv, _ in ERRORS])
def test_bad_input_is_one_line_with_exit_code_2(runs, tmp_path, monkeypatch, capsys, argv, expected):
    damaged = tmp_path / "damaged"
    if "{damaged}" in argv:
        shutil.copytree(runs["text"], damaged)
        newest = damaged / "checkpoints" / "step_00000003.pt"
        newest.write_bytes(newest.read_bytes()[:-1])
    (tmp_path / "empty").mkdir()
    places = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "out": tmp_path / "out",
              "damaged": damaged, **{name: str(path) for name, path in runs.items()}}
    argv = [arg.format(**places) for arg in argv]
    with pytest.raises(SystemExit) as exit_info:
        in_process(argv, monkeypatch)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("moetrain: error: ") and expected.format(**places) in line, line
    assert captured.out == "" and not (tmp_path / "out").exists()


def test_an_error_through_the_console_script_has_no_traceback(tmp_path):
    done = moetrain_command("eval", str(tmp_path / "nowhere"), "quant=fp8", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"moetrain: error: run directory {tmp_path / 'nowhere'} does not exist: pass the folder a "
                           "moetrain run wrote (runs/<date>_<time>_<name>)\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without a GPU")
def test_a_gpu_asked_for_without_one_is_one_line(runs, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        in_process(["generate", str(runs["ids"]), "--prompt", "1", "--device", "cuda"], monkeypatch)
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == ("moetrain: error: moetrain generate: argument --device: cuda, but no CUDA GPU is visible: use "
                    "--device auto or cpu (see moetrain generate --help)")
