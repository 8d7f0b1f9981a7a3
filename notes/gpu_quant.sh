#!/usr/bin/env bash
# Check and time the quantized experts on one GPU, from a source checkout:
#   bash notes/gpu_quant.sh OUTDIR
# Writes OUTDIR/env.txt, tests.log, quant_bench.log, quant_bench.json, kernels.log and prints a
# summary. Needs torch with CUDA and Triton; builds nothing (the Triton kernels compile on first use).
# Order: tests, then the benchmark table, then the kernel-only timings, each under its own timeout
# (about 4 minutes, at most 6.7), so a run cut short still leaves the first results.
set -u
out=${1:?usage: bash notes/gpu_quant.sh OUTDIR}
source notes/gpu_lib.sh
gpu_start "$out"

echo "== tests (tests/test_quant*.py)"
start=$SECONDS
timeout 150 python3 -m pytest -q -p no:cacheprovider --maxfail=20 --tb=short --durations=5 tests/test_quant_cuda.py \
  tests/test_quant_formats.py tests/test_quant_layer.py > "$out/tests.log" 2>&1
echo "tests rc=$? in $((SECONDS - start)) s"
test_summary "$out/tests.log"

echo "== bench (python -m moetrain.quant.bench)"
start=$SECONDS
timeout 150 python3 -m moetrain.quant.bench --json "$out/quant_bench.json" 2>&1 | tee "$out/quant_bench.log"
echo "bench rc=${PIPESTATUS[0]} in $((SECONDS - start)) s"

echo "== kernel-only timings (python -m moetrain.quant.bench --kernels)"
start=$SECONDS
timeout 100 python3 -m moetrain.quant.bench --kernels --iters 10 2>&1 | tee "$out/kernels.log"
echo "kernels rc=${PIPESTATUS[0]} in $((SECONDS - start)) s"
