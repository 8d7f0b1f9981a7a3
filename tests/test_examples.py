"""Every script in examples/ runs in a fresh interpreter with small sizes, and what its main()
returns is checked against the behaviour the example claims to show, so the examples cannot rot.

All examples run in ONE subprocess (interpreter and torch start-up would otherwise dominate);
each example's failure is recorded there with its traceback and reported by its own test.
"""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# Small sizes for each example's main(); the checks below rely on these.
SMALL = {
    "01_hello_moe.py": {"batch": 2, "seq": 64, "model_dim": 32, "num_experts": 4, "hidden_size": 48},
    "02_per_call_settings.py": {"tokens": 256},
    "03_custom_gate.py": {"tokens": 24},
    "04_custom_expert.py": {"tokens": 24},
    "05_train_own_module.py": {"steps": 40},
    "06_sigmoid_bias_balance.py": {"steps": 100},
    "07_shared_experts.py": {"tokens": 24},
    "08_distributed_training.py": {"steps": 15, "tokens": 32},
    "09_quantized_inference.py": {"tokens": 128, "model_dim": 64, "hidden_size": 64},
    "10_tiny_language_model.py": {"steps": 40, "batch": 16},
    "11_benchmark.py": {"tokens": 256, "model_dim": 32, "hidden_size": 64, "warmup": 1, "steps": 2},
    "12_cli_checkpoint_inference.py": {"steps": 20},
}

RUNNER = textwrap.dedent(
    """
    import importlib, json, sys, traceback
    folder, examples, out_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    # Imported as modules of the examples folder, so that worker functions of the multi-process
    # examples can be pickled by name for the spawned processes.
    sys.path.insert(0, folder)
    results = {}
    for name, kwargs in examples.items():
        try:
            results[name] = {"result": importlib.import_module(name[: -len(".py")]).main(**kwargs)}
        except BaseException:
            results[name] = {"error": traceback.format_exc()}
        with open(out_path, "w") as out:  # after each example, so a hang still leaves the others
            json.dump(results, out)
    """
)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out_path = tmp_path_factory.mktemp("examples") / "results.json"
    # One thread per process: the examples are tiny, and on a busy 2-core machine more threads
    # only contend (the multi-process examples start several interpreters at once).
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run([sys.executable, "-c", RUNNER, str(EXAMPLES), json.dumps(SMALL), str(out_path)],
                              cwd=EXAMPLES.parent, env=env, capture_output=True, text=True, timeout=600)
        why_missing = f"the examples' process exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    except subprocess.TimeoutExpired:
        why_missing = "the examples' process ran past 600 s and was stopped"
    return (json.loads(out_path.read_text()) if out_path.exists() else {}), why_missing


def result_of(outcomes, name):
    results, why_missing = outcomes
    if name not in results:
        pytest.fail(f"{name} did not run: {why_missing}")
    if "error" in results[name]:
        pytest.fail(f"{name} failed:\n{results[name]['error']}")
    return results[name]["result"]


def test_every_example_is_checked():
    on_disk = sorted(path.name for path in EXAMPLES.glob("*.py"))
    assert on_disk == sorted(SMALL), "add the new example to SMALL and give it a check"


def test_hello_moe(outcomes):
    r = result_of(outcomes, "01_hello_moe.py")
    assert r["output_shape"] == r["input_shape"]
    assert r["routed_choices"] == r["tokens"] * 2  # top_k=2: two choices per token
    assert 0 <= r["dropped_fraction"] < 1
    assert r["max_diff_vs_torch_path"] < 1e-5
    assert r["grads_finite"]


def test_per_call_settings(outcomes):
    r = result_of(outcomes, "02_per_call_settings.py")
    rows = {(row["top_k"], row["capacity_factor"]): row for row in r["rows"]}
    assert len(rows) == 15
    for (top_k, cf), row in rows.items():
        assert row["routed_choices"] == r["tokens"] * top_k
        if cf > 0:  # padded: the capacity is the limit, and no expert keeps more
            assert row["capacity"] == row["expected_limit"] == top_k * int(cf * math.ceil(r["tokens"] / 8))
        if cf == 0:
            assert row["dropped_fraction"] == 0
            assert row["capacity"] == row["max_load"]
    for top_k in (1, 2, 4):
        dropped = [rows[(top_k, cf)]["dropped_fraction"] for cf in (0.5, 1.0, 2.0)]
        assert dropped[0] > 0 and dropped == sorted(dropped, reverse=True)
        # A negative factor caps at the same limit as the positive one, so it drops the same choices.
        assert rows[(top_k, -1.0)]["dropped_fraction"] == pytest.approx(rows[(top_k, 1.0)]["dropped_fraction"])
    assert r["default_capacity"] == r["default_expected_capacity"]


def test_custom_gate(outcomes):
    r = result_of(outcomes, "03_custom_gate.py")
    for label, temperature in (("class", 2.0), ("instance", 0.5), ("name", 1.0)):
        assert r[label]["gate_type"] == "TemperatureGate"
        assert r[label]["temperature"] == temperature
        assert r[label]["max_diff"] < 1e-5
    assert r["router_grad_abs_sum"] > 0


def test_custom_expert(outcomes):
    r = result_of(outcomes, "04_custom_expert.py")
    for layout in ("padded", "packed"):
        assert r[layout]["dropped_fraction"] == 0
        assert r[layout]["max_diff"] < 1e-5
    assert r["expert_params_tagged"] and r["gate_params_untagged"]
    assert r["scale_grad_nonzero"]


def test_train_own_module_loss_falls(outcomes):
    r = result_of(outcomes, "05_train_own_module.py")
    assert r["last_eval_loss"] < 0.25 * r["first_eval_loss"]
    assert r["last_train_loss"] < 0.25 * r["first_train_loss"]


def test_sigmoid_bias_balances_load(outcomes):
    r = result_of(outcomes, "06_sigmoid_bias_balance.py")
    without, with_bias = r["rate_0.0"], r["rate_0.01"]
    assert without["bias_abs_max"] == 0
    assert with_bias["first_imbalance"] == pytest.approx(without["first_imbalance"])  # same start
    assert with_bias["first_imbalance"] > 2
    assert with_bias["last_imbalance"] < 0.6 * without["last_imbalance"]
    assert r["bias_in_state_dict"] and not r["bias_is_parameter"]


def test_shared_experts(outcomes):
    r = result_of(outcomes, "07_shared_experts.py")
    assert r["max_diff"] < 1e-5
    assert r["groups_per_token"] <= 2
    assert r["shared_width"] == r["expected_shared_width"]
    assert r["shared_params_untagged"]


def test_distributed_training_matches_single_process(outcomes):
    r = result_of(outcomes, "08_distributed_training.py")
    assert len(r["ranks"]) == 2
    for report in r["ranks"]:
        assert report["local_experts"] == 2  # 4 experts over 2 processes
        assert len(report["forward"]) == 4
        for label, diff in report["forward"].items():
            assert diff < 1e-5, label
        assert report["max_param_diff"] < 1e-4
    losses = r["ranks"][0]["losses"]
    assert losses[-1] < 0.8 * losses[0]


def test_quantized_inference(outcomes):
    r = result_of(outcomes, "09_quantized_inference.py")
    fp8, fp4, mixed = r["fp8"], r["mxfp4"], r["mxfp4 + fp8 hot"]
    assert 0 < fp8["relative_error"] < 0.1 and 0 < fp4["relative_error"] < 0.3
    assert fp8["relative_error"] < mixed["relative_error"] < fp4["relative_error"]
    # FP8: one byte per weight + an fp32 scale per output channel; MXFP4: 4 bits + one byte of
    # E8M0 scale per 32 weights.
    assert 0.5 < fp8["bytes_vs_bf16"] < 0.55
    assert fp4["bytes_vs_bf16"] == pytest.approx(4.25 / 16, abs=0.01)
    assert fp4["bytes_vs_bf16"] < mixed["bytes_vs_bf16"] < fp8["bytes_vs_bf16"]
    assert mixed["plan"][0].count("fp8") == 2  # a quarter of 8 experts
    assert sorted(r["hot_experts"]) == sorted(r["busiest_experts"])
    assert r["reload_max_diff"] == 0


def test_tiny_language_model_learns_to_count(outcomes):
    r = result_of(outcomes, "10_tiny_language_model.py")
    assert r["last_loss"] < 0.3 * r["first_loss"]
    assert r["generated_correct"] >= 0.75
    assert 0 < r["active_params"] < r["total_params"]


def test_benchmark_from_python(outcomes):
    r = result_of(outcomes, "11_benchmark.py")
    assert r["max_diff_vs_naive"] < 1e-4
    assert r["useful_flops"] == 256 * 32 * 64 * 2 * 2 * 2 * 3
    for cf in (0.0, 1.0):
        assert {"moetrain@cf=%s" % cf, "naive@cf=%s" % cf} <= set(r["columns"])
    for figures in r["columns"].values():  # every column reports a time and the figure derived from it
        assert figures["ms"] > 0
        assert figures["tflops"] == pytest.approx(r["useful_flops"] / (figures["ms"] * 1e-3) / 1e12)


def test_cli_checkpoint_inference(outcomes):
    r = result_of(outcomes, "12_cli_checkpoint_inference.py")
    assert r["step"] == 20
    # Plain-Python inference reproduces the command's own final evaluation, well above chance.
    assert r["accuracy"] == pytest.approx(r["reported_accuracy"], abs=1e-9)
    assert r["accuracy"] > 3 / r["num_classes"]
