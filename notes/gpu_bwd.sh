#!/usr/bin/env bash
# Check and time the fused backward of the padded expert epilogue (bias_act_backward) on one GPU,
# from a source checkout:
#   bash notes/gpu_bwd.sh OUTDIR
# Writes OUTDIR/env.txt, build.log, tests.log, memcheck.log, bench.log and prints a summary.
# Builds the extension through the package's JIT path (cached after the first build). Order: the
# tests, then the benchmark, then memcheck (the slowest), each under its own timeout.
set -u
out=${1:?usage: bash notes/gpu_bwd.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  git log -1 --format='commit %h %s' 2>/dev/null
  date -u
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

# pip install maps csrc/ to the package moetrain.csrc; a bare checkout gets the same through a link.
python3 -c "import moetrain.csrc" 2>/dev/null || ln -sfn ../csrc moetrain/csrc

echo "== build (JIT)"
start=$SECONDS
timeout 400 python3 -c "from moetrain import ops; ops.load(); print('CUDA kernels:', ops.has_cuda_kernels())" \
  > "$out/build.log" 2>&1
echo "build rc=$? in $((SECONDS - start)) s"; tail -3 "$out/build.log"

echo "== tests (tests/test_bias_act.py)"
start=$SECONDS
timeout 150 python3 -m pytest -q -p no:cacheprovider --maxfail=30 --tb=short tests/test_bias_act.py > "$out/tests.log" 2>&1
echo "tests rc=$? in $((SECONDS - start)) s"
grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -25
# The first failure's traceback, short, for a first look.
sed -n '/= FAILURES =/,$p' "$out/tests.log" | sed -n '2,/^___/p' | tail -40

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
