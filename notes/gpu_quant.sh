#!/usr/bin/env bash
# Check and time the quantized experts on one GPU, from a source checkout:
#   bash notes/gpu_quant.sh OUTDIR
# Writes OUTDIR/env.txt, tests.log, quant_bench.log, quant_bench.json, kernels.log and prints a
# summary. Needs torch with CUDA and Triton; builds nothing (the Triton kernels compile on first use).
# Order: tests, then the benchmark table, then the kernel-only timings, each under its own timeout
# (about 4 minutes, at most 6.7), so a run cut short still leaves the first results.
set -u
out=${1:?usage: bash notes/gpu_quant.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='commit %h %s' 2>/dev/null
  date -u
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

echo "== tests (tests/test_quant*.py)"
start=$SECONDS
timeout 150 python3 -m pytest -q -p no:cacheprovider --maxfail=20 --tb=short --durations=5 tests/test_quant_cuda.py \
  tests/test_quant_formats.py tests/test_quant_layer.py > "$out/tests.log" 2>&1
echo "tests rc=$? in $((SECONDS - start)) s"
grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -25
# The first failure's traceback, short, for a first look.
sed -n '/= FAILURES =/,$p' "$out/tests.log" | sed -n '2,/^___/p' | tail -40

echo "== bench (python -m moetrain.quant.bench)"
start=$SECONDS
timeout 150 python3 -m moetrain.quant.bench --json "$out/quant_bench.json" 2>&1 | tee "$out/quant_bench.log"
echo "bench rc=${PIPESTATUS[0]} in $((SECONDS - start)) s"

echo "== kernel-only timings (python -m moetrain.quant.bench --kernels)"
start=$SECONDS
timeout 100 python3 -m moetrain.quant.bench --kernels --iters 10 2>&1 | tee "$out/kernels.log"
echo "kernels rc=${PIPESTATUS[0]} in $((SECONDS - start)) s"
