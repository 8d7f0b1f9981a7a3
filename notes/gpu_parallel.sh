#!/usr/bin/env bash
# Expert parallelism on 2 GPUs in one run, from a source checkout (issue 5):
#   bash notes/gpu_parallel.sh OUTDIR
# 1. JIT-builds the kernels (build.log), 2. NCCL equivalence self-check (check.log),
# 3. the NCCL half of tests/test_parallel_overlap.py (tests.log), 4. the 2-GPU benchmark with one
# profiled step per setup, NCCL all-to-all at overlap 1 and 2 and peer memory unchunked, and one
# exchange timed alone (parallel_benchmark.log), 5. the same
# benchmark unprofiled, without overlap, with NCCL allowed more channels for point-to-point
# traffic (benchmark_nccl_channels.log: NCCL settings are the user's, not the library's; this
# shows whether they matter on this machine); optional 6. the benchmark with high-priority NCCL
# streams (benchmark_high_priority.log). Prints a compact summary; about 4 minutes on 2 H200.
# STEPS picks a subset (default "check tests bench channels"; add "priority" for 6), e.g. STEPS="bench".
set -u
out=${1:?usage: bash notes/gpu_parallel.sh OUTDIR}
steps=" ${STEPS:-check tests bench channels} "
want() { [[ "$steps" == *" $1 "* ]]; }
source notes/gpu_lib.sh
gpu_start "$out" nvidia-smi topo -m
gpu_build "$out"

if want check; then
  echo "== NCCL equivalence (python -m moetrain.parallel.check --nproc 2)"
  start=$SECONDS
  timeout 240 python3 -m moetrain.parallel.check --nproc 2 > "$out/check.log" 2>&1
  echo "check rc=$? in $((SECONDS - start)) s"
  grep -E "FAIL|ranks, backend|Error" "$out/check.log" | tail -12
fi

if want tests; then
  echo "== tests (NCCL)"
  start=$SECONDS
  timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_parallel_overlap.py -k nccl > "$out/tests.log" 2>&1
  echo "tests rc=$? in $((SECONDS - start)) s"; grep -E "passed|failed|FAILED|Error|assert" "$out/tests.log" | tail -12
fi

if want bench; then
  echo "== benchmark (python -m moetrain.parallel.benchmark --gpus 2 --overlap 1,2 --profile; exchanges all_to_all, peer_memory)"
  start=$SECONDS
  # NCCL's INIT lines (in the log) say how many channels it gives point-to-point traffic.
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT timeout 240 python3 -m moetrain.parallel.benchmark --gpus 2 --overlap 1,2 \
    --profile 2>&1 | tee "$out/parallel_benchmark.log" | grep -v -E '^\{|^moetrain: |NCCL INFO'
  echo "benchmark rc=${PIPESTATUS[0]} in $((SECONDS - start)) s"
  grep -m 2 -E "p2p channels|P2P Chunksize" "$out/parallel_benchmark.log"
fi

if want channels; then
  echo "== benchmark, NCCL_MIN_P2P_NCHANNELS=32 NCCL_MIN_CTAS=32, no overlap, no profile"
  start=$SECONDS
  NCCL_MIN_P2P_NCHANNELS=32 NCCL_MIN_CTAS=32 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT timeout 150 \
    python3 -m moetrain.parallel.benchmark --gpus 2 --overlap 1 --exchange all_to_all > "$out/benchmark_nccl_channels.log" 2>&1
  echo "benchmark rc=$? in $((SECONDS - start)) s"
  grep -v -E '^\{|^moetrain: |NCCL INFO' "$out/benchmark_nccl_channels.log" | tail -6
  grep -m 1 "p2p channels" "$out/benchmark_nccl_channels.log"
fi

if want priority; then
  echo "== benchmark, high-priority NCCL streams (TORCH_NCCL_HIGH_PRIORITY=1), no profile"
  start=$SECONDS
  TORCH_NCCL_HIGH_PRIORITY=1 timeout 200 python3 -m moetrain.parallel.benchmark --gpus 2 --overlap 1,2 \
    > "$out/benchmark_high_priority.log" 2>&1
  echo "benchmark rc=$? in $((SECONDS - start)) s"
  grep -v -E '^\{|^moetrain: ' "$out/benchmark_high_priority.log" | tail -8
fi
