"""The benchmark harness: its baselines compute the MoE layer's function, its FLOP count is the
PERFORMANCE.md formula, and the CLI runs end to end on the CPU and writes its JSON."""

import json

import pytest
import torch

from benchmarks import layer as bench  # the layer benchmark: `python -m moetrain.bench`


def test_useful_flops_is_the_documented_formula():
    shape = bench.GPU_SHAPES["deepseek_fg"]
    assert shape.useful_flops() == 8192 * 2048 * 1408 * 6 * 2 * 2 * 3


@pytest.mark.parametrize("baseline", ["naive", "grouped_mm"])
def test_baselines_compute_the_dropless_layer(baseline):
    """Same parameters, same routing: the baselines must match MoELayer (dropless) in value and gradient."""
    if baseline == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    shape = bench.Shape("tiny", tokens=67, model_dim=16, hidden_size=24, num_experts=5, top_k=2)
    layer = bench.build_layer(shape, torch.device("cpu"), torch.float64 if baseline == "naive" else torch.float32,
                              capacity_factor=0.0, impl="torch")
    x = torch.randn(shape.tokens, shape.model_dim, dtype=layer.experts.w1.dtype, requires_grad=True)
    if baseline == "naive":
        y, w1 = bench.naive_moe(layer, x), layer.experts.w1
    else:
        grouped_baseline = bench.GroupedMMBaseline(layer)
        y, w1 = grouped_baseline(x), grouped_baseline.w1_EHD  # its own copy, stored transposed
    want = layer(x)
    tol = 1e-10 if baseline == "naive" else 1e-5
    assert torch.allclose(y, want, rtol=tol, atol=tol)
    grads = torch.autograd.grad(y.square().sum(), [x, w1, layer.experts.b2, layer.gate.weight_ED])
    want_grads = torch.autograd.grad(want.square().sum(), [x, layer.experts.w1, layer.experts.b2,
                                                           layer.gate.weight_ED])
    if baseline == "grouped_mm":
        grads = (grads[0], grads[1].transpose(1, 2)) + grads[2:]
    for got, expected in zip(grads, want_grads):
        assert torch.allclose(got, expected, rtol=tol * 10, atol=tol * 10)


def test_swiglu_baseline_computes_the_dropless_swiglu_layer():
    """torch's recipe for the LM shapes: same value and gradients as MoELayer(expert="swiglu"),
    dropless and renormalised, on fresh random inputs."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    shape = bench.Shape("tiny", tokens=53, model_dim=16, hidden_size=24, num_experts=6, top_k=3, expert="swiglu")
    layer = bench.build_layer(shape, torch.device("cpu"), torch.float32, capacity_factor=0.0, impl="torch")
    baseline = bench.GroupedMMSwiGLUBaseline(layer)
    x = torch.randn(shape.tokens, shape.model_dim, requires_grad=True)
    y, want = baseline(x), layer(x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    # The baseline's own copies of the gate, up and down projections, stored [E, out, in].
    grads = torch.autograd.grad(y.square().sum(), [x, layer.gate.weight_ED, *baseline.weights])
    want_x, want_router, want_gate_up, want_down = torch.autograd.grad(
        want.square().sum(), [x, layer.gate.weight_ED, layer.experts.w_gate_up, layer.experts.w_down])
    want_gate, want_up = want_gate_up[..., 0::2], want_gate_up[..., 1::2]  # columns alternate gate, up
    want_grads = (want_x, want_router, want_gate.transpose(1, 2), want_up.transpose(1, 2), want_down.transpose(1, 2))
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_cli_runs_on_cpu_and_writes_json(tmp_path, monkeypatch, capsys):
    tiny = bench.Shape("tiny", tokens=64, model_dim=16, hidden_size=32, num_experts=4, top_k=2)
    monkeypatch.setitem(bench.CPU_SHAPES, "tiny", tiny)
    out = tmp_path / "bench.json"
    bench.main(["--device", "cpu", "--shapes", "tiny", "--steps", "2", "--warmup", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["shape"]["name"] == "tiny"
    for column in ("moetrain", "moetrain_torch", "naive"):
        assert result[column]["ms"] > 0
        assert result[column]["tflops"] == pytest.approx(tiny.useful_flops() / (result[column]["ms"] * 1e-3) / 1e12)
    assert "torch/kernel" in capsys.readouterr().out


def test_compile_column_times_the_compiled_layer(tmp_path, monkeypatch, capsys):
    tiny = bench.Shape("tiny", tokens=64, model_dim=16, hidden_size=32, num_experts=4, top_k=2)
    monkeypatch.setitem(bench.CPU_SHAPES, "tiny", tiny)
    out = tmp_path / "bench.json"
    bench.main(["--device", "cpu", "--shapes", "tiny", "--steps", "2", "--warmup", "1", "--compile", "default",
                "--json", str(out)])
    (result,) = json.loads(out.read_text())["results"]
    assert "compiled_error" not in result, result.get("compiled_error")
    assert result["compiled"]["ms"] > 0 and result["compile_s"] > 0
    assert "torch.compile(layer): tiny" in capsys.readouterr().out


def test_cli_rejects_unknown_shape():
    with pytest.raises(SystemExit) as error:
        bench.main(["--device", "cpu", "--shapes", "mixtral"])
    assert error.value.code == 2


def test_lm_table_has_fp8_and_fp8_block_against_bf16():
    """The GPU table's LM rows: each FP8 precision's TFLOP/s, its ratio to the bf16 layer and its
    target, and the bf16 layer on the Triton GEMMs against torch's; a column that did not run (no
    sm90 GPU, no kernel) prints as nan and -."""
    def timed(tflops):
        return {"ms": 1.0, "tflops": tflops, "peak_gib": 2.0}

    result = {"shape": {"name": "moe_1b5", "expert": "swiglu"}, "moetrain": timed(400.0), "grouped_mm": timed(300.0),
              "gemms_alone": timed(600.0), "moetrain_fp8": timed(480.0), "moetrain_fp8_block": timed(520.0)}
    row = next(line for line in bench.gpu_table([result], 800.0).splitlines() if line.startswith("moe_1b5"))
    assert f"480    1.20x  {bench.FP8_TARGET:4.2f}x" in row
    assert f"520    1.30x  {bench.FP8_BLOCK_TARGET:4.2f}x" in row
    assert row.rstrip().endswith("nan     nanx")  # the triton column did not run
    del result["moetrain_fp8_block"]
    result["moetrain_triton"] = timed(440.0)
    row = next(line for line in bench.gpu_table([result], 800.0).splitlines() if line.startswith("moe_1b5"))
    assert row.rstrip().endswith("nan     nanx  1.25x        -      440    1.10x")


def test_gpu_table_says_how_long_the_host_takes_to_issue_each_step():
    """The line under the GPU table: each moetrain column's host milliseconds against its step's,
    per shape; columns without a host figure (a CPU, a column that did not run) are left out."""
    import random

    rng = random.Random()
    figures = {column: (rng.uniform(1, 20), rng.uniform(1, 20)) for column in ("moetrain", "moetrain_fp8")}
    result = {"shape": {"name": "moe_1b5", "expert": "swiglu"}, "grouped_mm": {"ms": 1.0, "tflops": 1.0, "peak_gib": 1.0},
              **{column: {"ms": ms, "tflops": 1.0, "peak_gib": 1.0, "host_ms": host}
                 for column, (host, ms) in figures.items()}}
    line = next(line for line in bench.gpu_table([result], 800.0).splitlines() if line.startswith("host ms"))
    (host, ms), (host8, ms8) = figures["moetrain"], figures["moetrain_fp8"]
    assert line.endswith(f"moe_1b5 bf16 {host:.2f} / {ms:.2f}, fp8 {host8:.2f} / {ms8:.2f}")
