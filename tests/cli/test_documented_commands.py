"""Every `moetrain ...` line of README.md and docs/*.md runs, in a short form.

The lines are read from the pages themselves (fenced blocks, `$ `-prompted or not, and inline code),
so a line added or changed there is tested without touching this file. Each runs through the
command's entry point in this process, in a scratch folder:
- a training line trains for two steps at tiny data sizes, or, where it needs a GPU, a download or
  several processes, composes and checks its config with `--cfg job` (a GPU line with
  trainer.device=cpu, since the device is checked too);
- eval, generate, export and tokenize run on small runs, a corpus, shards and a tokenizer made
  here, which stand in for the pages' placeholders (runs/RUN, CORPUS, shards/, tokenizer/, ...);
- a sweep (-m) runs each of its combinations so;
- a usage synopsis (RUN_DIR, [--flag N]), or a command named in prose (`moetrain eval`), runs as
  its command's --help;
- a `$ ` line whose page shows `moetrain: error: ...` under it must end with exit code 2 and that line.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import hydra
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from image_folders import write_class_folders
from omegaconf import OmegaConf
from tiny_tokenizers import train_tokenizer, write_text_corpus

from moetrain import cli, commands
from moetrain.data.shards import tokenize_corpus
from moetrain.models import build_lm
from moetrain.models.hf import save_hf_checkpoint

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHORT = ["trainer.max_steps=2", "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.checkpoint_every=0",
         "trainer.progress_bar=false", "logger=none"]
# Smaller data where the data option has the key (a run's data sizes do not change its model).
TINY_DATA = {"train_size": 32, "eval_size": 8, "batch_size": 4, "eval_batch_size": 4}


@dataclass
class Line:
    page: str
    number: int
    text: str
    error: str | None = None  # the `moetrain: error: ...` the page shows under it

    def __str__(self) -> str:
        return f"{self.page}:{self.number}"


def documented_lines() -> list[Line]:
    found = []
    for page in PAGES:
        rows = page.read_text().splitlines()
        fenced, index = False, 0
        while index < len(rows):
            row, number = rows[index].strip(), index + 1
            index += 1
            if row.startswith("```"):
                fenced = not fenced
                continue
            if not fenced:
                found += [Line(page.name, number, text.split(" | ")[0])
                          for text in re.findall(r"`(moetrain [^`]*)`", rows[number - 1])]
                continue
            prompted = row.startswith("$ ")
            text = row[2:] if prompted else row
            if not text.startswith("moetrain ") or re.match(r"moetrain (\d|error:)", text):
                continue  # not a command: its output (`moetrain 0.1.0 (torch ...)`, `moetrain: error: ...`)
            while text.endswith("\\") and index < len(rows):  # a command continued on the next line
                text, index = text[:-1] + rows[index].strip(), index + 1
            error = None
            if prompted and index < len(rows) and rows[index].startswith("moetrain: error: "):
                error = rows[index][len("moetrain: error: "):]
            found.append(Line(page.name, number, text.split(" # ")[0].split(" | ")[0].strip(), error))
    return found


LINES = documented_lines()


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, Path]:
    """What the pages' placeholders stand for: small runs, a corpus, shards, a tokenizer, photos, a
    Hugging Face checkpoint."""
    root = tmp_path_factory.mktemp("documented")
    tokenizer = train_tokenizer(root / "tokenizer")
    write_text_corpus(root / "corpus")
    tokenize_corpus(root / "corpus", root / "shards", tokenizer, progress=False)
    write_class_folders(root / "photos", per_class=6, size=8)
    save_hf_checkpoint(build_lm("qwen3_moe_tiny"), root / "checkpoint", "qwen3_moe")
    with pytest.MonkeyPatch.context() as patch:
        for name, overrides in (("lm_run", ["+recipe=qwen3_moe_lm", "data=text", f"data.path={root / 'shards'}",
                                            "data.seq_len=16", "data.batch_size=4", "data.eval_batch_size=4"]),
                                ("image_run", ["+recipe=quickstart", "data.train_size=32", "data.eval_size=8",
                                               "data.batch_size=4", "data.eval_batch_size=4"])):
            assert run(["moetrain", *overrides, *SHORT, f"hydra.run.dir={root / name}"], patch)[0] == 0
    return {"root": root, "tokenizer": tokenizer, "corpus": root / "corpus", "shards": root / "shards",
            "photos": root / "photos", "lm_run": root / "lm_run", "image_run": root / "image_run",
            "checkpoint": root / "checkpoint"}


def run(argv: list[str], monkeypatch) -> tuple[int, str]:
    """(exit code, stderr) of `moetrain ARGV` through the entry point, in this process."""
    monkeypatch.setattr(sys, "argv", argv)
    code = 0
    try:
        cli.main()
    except SystemExit as exit_request:
        code = exit_request.code or 0
    return code, ""


def substitute(words: list[str], places: dict[str, Path], scratch: Path) -> list[str]:
    """The pages' placeholders replaced by what `places` made, and outputs sent to `scratch`."""
    replaced = []
    for position, word in enumerate(words):
        key, _, value = word.partition("=")
        after_flag = replaced[-1:] == ["--tokenizer"]
        if after_flag:
            word = str(places["tokenizer"])
        elif position == 1 and words[0] in ("eval", "generate", "export"):
            word = str(places["lm_run"])  # runs/RUN
        elif position == 2 and words[0] == "export":
            word = str(scratch / "exported")
        elif words[0] == "convert-checkpoint" and position >= 1 and not word.startswith("--"):
            word = str(places["image_run"])  # data only already: reported and left as it is
        elif position in (1, 2) and words[0] == "tokenize":
            word = str(places["corpus"] if position == 1 else scratch / "shards")
        elif key == "trainer.resume" and value != "auto":
            word = f"trainer.resume={places['image_run']}"
        elif key == "data.path":
            where = {"photos": places["photos"], "shards/": places["shards"]}.get(value, places["corpus"] / "b")
            word = f"data.path={where}"
        elif key == "model.path":
            word = f"model.path={places['checkpoint']}"  # a published checkpoint's layout, at CPU size
        elif key == "data.tokenizer":
            word = f"data.tokenizer={places['tokenizer']}"
        elif key == "quant" and value == "Q":
            word = "quant=mxfp4"
        elif key == "quant.export":
            word = f"quant.export={scratch / 'model.q.pt'}"
        replaced.append(word)
    return replaced


def is_synopsis(words: list[str]) -> bool:
    return any(word.startswith("[") or re.fullmatch(r"[A-Z][A-Z_]+", word) for word in words)


def short_form(words: list[str], scratch: Path) -> list[str]:
    """A training command line made short: two steps at tiny sizes, or --cfg job when the config
    asks for a GPU, a download or several processes."""
    overrides = [word for position, word in enumerate(words)
                 if not word.startswith("-") and words[position - 1:position] != ["--cfg"]]
    cli.register_configs()
    with hydra.initialize_config_module(config_module=cli.CONFIG_MODULE, version_base="1.3"):
        composed = OmegaConf.to_container(hydra.compose(config_name=cli.CONFIG_NAME, overrides=overrides),
                                          enum_to_str=True)
    needs_more = (composed["trainer"]["device"] == "cuda" or composed["data"].get("download", False)
                  or composed["parallel"]["nproc_per_node"] > 1)
    if needs_more or "--cfg" in words:
        # The device is checked even for --cfg: a GPU line is composed for the CPU here.
        on_cpu = ["trainer.device=cpu"] if composed["trainer"]["device"] == "cuda" else []
        return words + on_cpu + ([] if "--cfg" in words else ["--cfg", "job"])
    tiny = [f"data.{key}={value}" for key, value in TINY_DATA.items() if key in composed["data"]]
    return words + SHORT + tiny + [f"hydra.run.dir={scratch / 'run'}"]


@pytest.mark.parametrize("line", LINES, ids=str)
def test_the_documented_line_runs(line, places, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # runs/, data/ and relative outputs land in the scratch folder
    words = shlex.split(line.text)[1:]
    if line.error is not None:  # documented to fail: as the page shows it
        code, _ = run(["moetrain", *substitute(words, places, tmp_path)], monkeypatch)
        error = capsys.readouterr().err
        assert code == 2 and error.count("\n") == 1, error
        shown = error.removeprefix("moetrain: error: ").strip()
        for part in line.error.split("..."):
            assert part.strip() in shown, f"{line}: the page shows {line.error!r}, the command says {shown!r}"
        return
    if words[0] in commands.COMMANDS and (is_synopsis(words) or len(words) == 1):  # a synopsis, or its name
        words = [words[0], "--help"]
    elif words == ["COMMAND", "--help"]:
        words = ["eval", "--help"]
    elif words[0] in commands.COMMANDS:
        words = substitute(words, places, tmp_path)
        if words[0] == "generate":
            words += ["--max-tokens", "4"]
    elif "-m" in words:  # a sweep: each of its runs, on its own
        overrides = substitute([word for word in words if word != "-m"], places, tmp_path)
        for index, combination in enumerate(cli.sweep_runs(OverridesParser.create().parse_overrides(overrides))):
            words = short_form(combination, tmp_path / str(index))
            code, _ = run(["moetrain", *words], monkeypatch)
            assert code == 0, f"{line}: `moetrain {' '.join(words)}` exited {code}: {capsys.readouterr().err[-500:]}"
        return
    elif not {"--help", "--version"} & set(words):
        words = short_form(substitute(words, places, tmp_path), tmp_path)
    code, _ = run(["moetrain", *words], monkeypatch)
    assert code == 0, f"{line}: `moetrain {' '.join(words)}` exited {code}: {capsys.readouterr().err[-500:]}"


def test_the_pages_are_read():
    """The extraction finds the kinds of lines the pages hold (so a change to it cannot skip them all)."""
    texts = [line.text for line in LINES]
    assert "moetrain +recipe=quickstart" in texts and any(t.startswith("moetrain eval ") for t in texts)
    assert any(line.error for line in LINES) and len(LINES) > 40
    assert "moetrain +recipe=moe_1b5_h200_lm data=text data.path=CORPUS" in texts
