"""Shared fixtures: small CIFAR-10 and MNIST folders in torchvision's real on-disk formats, and
in-process Hydra composition of moetrain's configs. Also the GPU markers' rules (docs/testing.md):
a test marked `cuda` (one GPU) or `multigpu` (two or more) is skipped on a machine without them,
a test that skips for want of a GPU without carrying one of those markers fails (so every GPU
test is selected by `python -m pytest -m "cuda or multigpu"`), and the run ends with a count of
the GPU tests per marker."""

from __future__ import annotations

import gzip
import logging
import pickle
import re
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _logging_handlers_restored():
    """In-process runs of the command let Hydra configure logging, with handlers on the streams of
    the test that ran them (captured, closed afterwards): every test starts and ends with the logging
    handlers and levels it found, so no later test writes into a closed stream."""
    loggers = [logging.getLogger()] + [logger for logger in logging.root.manager.loggerDict.values()
                                       if isinstance(logger, logging.Logger)]
    saved = [(logger, list(logger.handlers), logger.level, logger.propagate) for logger in loggers]
    yield
    for logger, handlers, level, propagate in saved:
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate
    known = {id(logger) for logger in loggers}
    for logger in logging.root.manager.loggerDict.values():  # loggers the test made keep no handler of its
        if isinstance(logger, logging.Logger) and id(logger) not in known:
            logger.handlers[:] = [h for h in logger.handlers if isinstance(h, logging.NullHandler)]


GPU_MARKERS = {"cuda": 1, "multigpu": 2}  # marker -> CUDA GPUs it needs
GPU_COMMAND = 'python -m pytest -m "cuda or multigpu"'
# A skip reason that says the test needs a GPU (or two): such a test must carry a GPU marker.
_NEEDS_GPU = re.compile(r"\bneeds?\b.*\b(GPUs?|CUDA)\b", re.IGNORECASE)


def _gpu_markers(item) -> list[str]:
    return [name for name in GPU_MARKERS if item.get_closest_marker(name) is not None]


def _gpu_parameters(item) -> list[str]:
    """The parameters that put a test on the GPU: a "cuda" device or an "nccl" backend."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return [f"{key}={value}" for key, value in params.items()
            if (isinstance(value, str) and value in ("cuda", "nccl"))
            or (isinstance(value, torch.device) and value.type == "cuda")]


def pytest_collection_modifyitems(config, items):
    available = torch.cuda.device_count()
    for item in items:
        markers = _gpu_markers(item)
        if not markers and _gpu_parameters(item):
            item.unmarked_gpu_parameters = _gpu_parameters(item)
        for name in markers:
            if available < GPU_MARKERS[name]:
                needs = "a CUDA GPU" if GPU_MARKERS[name] == 1 else f"{GPU_MARKERS[name]} CUDA GPUs"
                item.add_marker(pytest.mark.skip(reason=f"needs {needs} (marker {name}; {available} visible)"))


def pytest_runtest_setup(item):
    if getattr(item, "unmarked_gpu_parameters", None):
        pytest.fail(f"{item.nodeid} runs on the GPU ({', '.join(item.unmarked_gpu_parameters)}) but carries no GPU "
                    f"marker: give that parameter marks=pytest.mark.cuda (or multigpu) so that `{GPU_COMMAND}` "
                    "selects it", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.gpu_markers = _gpu_markers(item)
    if report.skipped and not report.gpu_markers and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
        if _NEEDS_GPU.search(reason):
            report.outcome = "failed"
            report.longrepr = (f"{item.nodeid} skips for want of a GPU ({reason}) but carries no GPU marker: mark it "
                               f"@pytest.mark.cuda or @pytest.mark.multigpu so that `{GPU_COMMAND}` runs it")


def pytest_terminal_summary(terminalreporter):
    counts: dict[str, Counter] = {name: Counter() for name in GPU_MARKERS}
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            if getattr(report, "when", "call") == "teardown" and outcome == "passed":
                continue
            for name in getattr(report, "gpu_markers", []):
                counts[name][outcome] += 1
    if not any(counts.values()):
        return
    terminalreporter.section("GPU tests by marker")
    for name, count in counts.items():
        shown = ", ".join(f"{n} {outcome}" for outcome, n in count.items() if n) or "none selected"
        terminalreporter.write_line(f"{name}: {shown}")
    if any(count["skipped"] for count in counts.values()):
        terminalreporter.write_line(f"run them on a GPU machine with: {GPU_COMMAND} (docs/testing.md)")

# Tiny model and run settings that keep any image recipe to a second or two on a CPU.
TINY_RUN = [
    "model.dim=16",
    "model.depth=2",
    "model.num_heads=2",
    "model.num_experts=4",
    "model.expert_hidden_size=32",
    "trainer.max_steps=3",
    "trainer.eval_every=2",
    "trainer.eval_batches=1",
    "trainer.checkpoint_every=0",
    "trainer.progress_bar=false",
    "logger.log_every=1",
    "data.batch_size=8",
    "data.eval_batch_size=8",
    "data.num_workers=0",
]
TINY_SYNTHETIC = ["data.train_size=64", "data.eval_size=16"]


def _cifar_batch(rng: np.random.Generator, size: int) -> dict:
    return {
        "batch_label": "fabricated",
        "labels": rng.integers(0, 10, size).tolist(),
        "data": rng.integers(0, 256, (size, 3 * 32 * 32), dtype=np.uint8),  # channel-major rows, as CIFAR
        "filenames": [f"image_{i}.png" for i in range(size)],
    }


@pytest.fixture(scope="session")
def cifar10_root(tmp_path_factory) -> Path:
    """root/cifar-10-batches-py with 5 training batches of 16 images and a test batch of 16."""
    root = tmp_path_factory.mktemp("cifar10")
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(10)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / name, "wb") as f:
            pickle.dump(_cifar_batch(rng, 16), f)
    with open(folder / "batches.meta", "wb") as f:
        names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
        pickle.dump({"label_names": names, "num_cases_per_batch": 16, "num_vis": 3072}, f)
    return root


def _idx(array: np.ndarray) -> bytes:
    """The idx format: magic (0, 0, type 0x08 = uint8, number of dims), big-endian sizes, data."""
    return struct.pack(">I", 0x0800 + array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory) -> Path:
    """root/MNIST/raw with 64 training and 16 test digits, as idx files and their .gz archives."""
    root = tmp_path_factory.mktemp("mnist")
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(28)
    for prefix, size in (("train", 64), ("t10k", 16)):
        files = {
            f"{prefix}-images-idx3-ubyte": _idx(rng.integers(0, 256, (size, 28, 28), dtype=np.uint8)),
            f"{prefix}-labels-idx1-ubyte": _idx(rng.integers(0, 10, size, dtype=np.uint8)),
        }
        for name, content in files.items():
            (raw / name).write_bytes(content)
            (raw / f"{name}.gz").write_bytes(gzip.compress(content))
    return root


@pytest.fixture
def compose():
    """compose(overrides) -> the composed DictConfig, as `moetrain` would build it (no run dir)."""
    import hydra

    from moetrain import cli, command_errors

    cli.register_configs()

    def _compose(overrides: list[str]):
        with hydra.initialize_config_module(config_module=command_errors.CONFIG_MODULE, version_base="1.3"):
            return hydra.compose(config_name=command_errors.CONFIG_NAME, overrides=overrides)

    return _compose


# A small multilingual text corpus (accents, CJK, symbols) for runs on the byte-level tokenizer.
DOCUMENTS = ["Le café était chaud et la crème fraîche. ", "naïve façade, déjà vu; 日本語のテキスト. ",
             "plain ascii text about mixtures of experts and routers. ", "ünïcödé: ½ ¾ € £ ¥. "] * 3


def write_corpus(folder) -> None:
    """DOCUMENTS as one .txt file each in a new `folder` (what data=text data.path=FOLDER reads)."""
    folder.mkdir()
    for index, text in enumerate(DOCUMENTS):
        (folder / f"{index:02d}.txt").write_text(text, encoding="utf-8")


def assert_no_host_sync(step) -> None:
    """Calls step() once to warm up (kernels loaded and cached), then again with torch's CUDA sync
    debug mode set to "error": any wait for the GPU inside the step raises."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
