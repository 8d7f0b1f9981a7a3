#!/usr/bin/env bash
# Build, check and benchmark the CUDA kernels on one GPU in a single run, from a source checkout:
#   bash notes/gpu_check.sh OUTDIR [arguments for python -m moetrain.bench]
# Writes OUTDIR/env.txt, build.log, tests.log, bench.log, bench.json, memcheck.log, diagnose.log.
# STEPS (default: tests bench memcheck diagnose) picks a subset, e.g. STEPS="tests bench" bash notes/gpu_check.sh out;
# also: compile (bench with the torch.compile column), hostcost (notes/hostcost.py), sustained (notes/sustained.py).
# Order: what matters most first, so a run cut short still leaves the benchmark.
set -u
out=${1:?usage: bash notes/gpu_check.sh OUTDIR [bench arguments]}
shift
steps=" ${STEPS:-tests bench memcheck diagnose} "
want() { [[ "$steps" == *" $1 "* ]]; }
source notes/gpu_lib.sh
gpu_start "$out"
gpu_build "$out"

if want tests; then
  echo "== tests"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_ops.py tests/test_cuda_grouped.py \
    tests/test_bias_act.py tests/test_router_kernel.py tests/test_bench.py tests/test_compile.py > "$out/tests.log" 2>&1
  echo "tests rc=$?"; tail -4 "$out/tests.log"
fi

if want bench; then
  echo "== bench"
  timeout 240 python3 -m moetrain.bench --json "$out/bench.json" "$@" > "$out/bench.log" 2>&1
  echo "bench rc=$?"
fi

if want compile; then
  echo "== bench, torch.compile column"
  timeout 420 python3 -m moetrain.bench --compile default --shapes "${COMPILE_SHAPES:-switch_top1,gshard_2k}" \
    --json "$out/bench_compile.json" > "$out/bench_compile.log" 2>&1
  echo "bench --compile rc=$?"
fi

if want hostcost; then
  echo "== host issue time (notes/hostcost.py)"
  timeout 200 python3 notes/hostcost.py switch_top1 gshard_2k > "$out/hostcost.log" 2>&1
  echo "hostcost rc=$?"; grep -E "^[a-z_0-9]+: step|torch.compile:" "$out/hostcost.log"
fi

if want sustained; then
  echo "== sustained GEMM rate (notes/sustained.py)"
  timeout 120 python3 notes/sustained.py > "$out/sustained.log" 2>&1
  echo "sustained rc=$?"; cat "$out/sustained.log"
fi

if want memcheck; then
  echo "== memcheck"
  # No caching allocator: each tensor is its own allocation, so an access past its end is caught.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider tests/test_cuda_ops.py tests/test_bias_act.py tests/test_router_kernel.py \
    -k "one_hot or misaligned or empty or combine_backward_kernel or (forward_backward and (1000-bfloat16 or 7-float32)) or (route_matches_reference and 300) or bias_act or router" \
    > "$out/memcheck.log" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$out/memcheck.log" | tail -3
fi

if want diagnose; then
  echo "== diagnostics (notes/diagnose.py)"
  timeout 200 python3 notes/diagnose.py > "$out/diagnose.log" 2>&1
  echo "diagnose rc=$?"; grep -v "^moetrain: " "$out/diagnose.log"
fi

if want bench; then
  echo "== bench table"
  grep -v "^moetrain: " "$out/bench.log" | tail -9
fi

if want compile; then
  echo "== bench table with the torch.compile column"
  grep -v "^moetrain: " "$out/bench_compile.log" | tail -10 | cut -c1-400
fi
