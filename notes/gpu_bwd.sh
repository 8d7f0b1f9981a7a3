#!/usr/bin/env bash
# Check and time the fused backward of the padded expert epilogue (bias_act_backward) on one GPU,
# from a source checkout:
#   bash notes/gpu_bwd.sh OUTDIR
# Writes OUTDIR/env.txt, build.log, tests.log, memcheck.log, bench.log and prints a summary.
# Builds the extension through the package's JIT path (cached after the first build). Order: the
# tests, then the benchmark, then memcheck (the slowest), each under its own timeout.
set -u
out=${1:?usage: bash notes/gpu_bwd.sh OUTDIR}
source notes/gpu_lib.sh
gpu_start "$out"
gpu_build "$out" 400

echo "== tests (tests/test_bias_act.py)"
start=$SECONDS
timeout 150 python3 -m pytest -q -p no:cacheprovider --maxfail=30 --tb=short tests/test_bias_act.py > "$out/tests.log" 2>&1
echo "tests rc=$? in $((SECONDS - start)) s"
test_summary "$out/tests.log"

echo "== bench (notes/bias_act_bwd_bench.py)"
start=$SECONDS
timeout 120 python3 notes/bias_act_bwd_bench.py > "$out/bench.log" 2>&1
echo "bench rc=$? in $((SECONDS - start)) s"
cat "$out/bench.log"

echo "== memcheck (CUDA bias_act tests but fp16, which takes the bf16 paths; of the large ones bf16 with ReLU only)"
start=$SECONDS
# No caching allocator: each tensor is its own allocation, so an access past its end is caught.
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -m pytest -q -p no:cacheprovider tests/test_bias_act.py -k "cuda and not fp16 and (not large or (bf16 and relu))" \
  > "$out/memcheck.log" 2>&1
echo "memcheck rc=$? in $((SECONDS - start)) s"
grep -E "ERROR SUMMARY|passed|failed" "$out/memcheck.log" | tail -3
grep -m 5 -A 6 "Invalid" "$out/memcheck.log"
