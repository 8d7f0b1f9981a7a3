"""`python benchmarks/expert_parallel.py` on CPU processes (Gloo): the expert-parallel benchmark's code
path for dropless SwiGLU experts and padded FFN experts, its FLOP count, and its refusals. The
figures themselves come from GPUs (docs/distributed.md); here only that every row runs."""

from __future__ import annotations

import json

import pytest

from benchmarks import expert_parallel

SMALL = ["--device", "cpu", "--gpus", "2", "--layers", "1", "--dim", "32", "--hidden", "48", "--experts", "4",
         "--tokens", "64", "--steps", "1", "--warmup", "0"]


def _report(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("expert,capacity_factor,matmuls,overlaps", [("swiglu", "0", 3, [1]),
                                                                     ("ffn", "1.0", 2, [1, 2])])
def test_every_row_runs_and_counts_the_expert_flops(capsys, expert, capacity_factor, matmuls, overlaps):
    extra = ["--overlap", "1,2"] if capacity_factor != "0" else []
    assert expert_parallel.main(SMALL + ["--expert", expert, "--capacity-factor", capacity_factor] + extra) == 0
    report = _report(capsys)
    runs = report["runs"]
    assert [run["setup"] for run in runs] == ["1 rank"] + ["2 ranks EP a2a"] * len(overlaps)
    assert [run["overlap"] for run in runs[1:]] == overlaps
    for run in runs:
        assert "error" not in run, run
        # tokens per rank x layers x k x D x H x matmuls x 2 (multiply-add) x 3 (forward + backward)
        want = 64 * 1 * 2 * 32 * 48 * matmuls * 2 * 3 / run["step_s"] / 1e12
        assert run["expert_tflops_per_gpu"] == pytest.approx(want)
        assert run["tokens_per_s"] == pytest.approx(64 * run["gpus"] / run["step_s"])
    assert "all_to_all_ms" in report["exchange"] and not any(key.startswith("peer") for key in report["exchange"])


def test_fp8_rows_travel_in_the_dropless_benchmark(capsys):
    """--precision fp8 with dropless SwiGLU experts: every row runs (FP8 emulated on CPU ranks)."""
    assert expert_parallel.main(SMALL + ["--expert", "swiglu", "--capacity-factor", "0", "--precision", "fp8"]) == 0
    report = _report(capsys)
    assert report["config"]["precision"] == "fp8"
    assert [run["setup"] for run in report["runs"]] == ["1 rank", "2 ranks EP a2a"]
    assert all("error" not in run for run in report["runs"]), report["runs"]
    # the exchange alone, as FP8 rows: 4 experts x capacity 64 * 2 / 4 rows of 32 values + one fp32 scale
    assert report["exchange"]["fp8_mbytes"] == 4 * 32 * (32 + 4) / 1e6 and report["exchange"]["fp8_all_to_all_ms"] > 0
    # the padded layout exchanges the bf16 rows (quantized after the exchange): no FP8 exchange to time
    assert expert_parallel.main(SMALL + ["--precision", "fp8"]) == 0
    assert "fp8_all_to_all_ms" not in _report(capsys)["exchange"]


@pytest.mark.parametrize("argv,message", [
    (["--capacity-factor", "0", "--overlap", "1,2"], "dropless) is exchanged unchunked by all_to_all"),
    (["--capacity-factor", "-1"], "--capacity-factor must be >= 0"),
    (["--exchange", "peer_memory"], "--device cpu runs over Gloo"),
    (["--profile"], "--device cpu runs over Gloo"),
])
def test_refusals_are_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        expert_parallel.main(SMALL + argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
