# What every notes/gpu_*.sh run starts with; sourced by them (bash notes/gpu_X.sh OUTDIR, from the
# repository root).
#   gpu_start OUTDIR      makes OUTDIR, puts this checkout on PYTHONPATH, writes OUTDIR/env.txt
#                         (GPU and clocks, Python/torch/CUDA/Triton/NCCL versions, nvcc, commit,
#                         date, plus what the caller's extra commands print) and shows it
#   gpu_build OUTDIR [S]  JIT-builds the kernels for this machine's torch (OUTDIR/build.log, S seconds)
#   test_summary LOG      the counts, failed tests by name, and the first failure's traceback, short

gpu_start() {
  local out=$1
  shift
  mkdir -p "$out"
  export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  {
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
    python3 - <<'PY'
import sys, torch
line = f"python {sys.version.split()[0]} torch {torch.__version__} cuda {torch.version.cuda}"
try:
    import triton
    line += f" triton {triton.__version__}"
except ImportError:
    pass
if torch.cuda.is_available() and torch.distributed.is_nccl_available():
    line += f" nccl {torch.cuda.nccl.version()}"
print(line)
PY
    nvcc --version | tail -1
    git log -1 --format='commit %h %s' 2>/dev/null
    date -u
    "$@"
  } > "$out/env.txt" 2>&1
  cat "$out/env.txt"
}

gpu_build() {
  local out=$1 limit=${2:-300} start=$SECONDS
  # pip install maps csrc/ to the package moetrain.csrc; a bare checkout gets the same through a
  # link, so the kernels are JIT-built for this machine's torch exactly as for an installed package.
  python3 -c "import moetrain.csrc" 2>/dev/null || ln -sfn ../csrc moetrain/csrc
  echo "== build (JIT)"
  timeout "$limit" python3 -c "from moetrain import ops; ops.load(); print('CUDA kernels:', ops.has_cuda_kernels())" \
    > "$out/build.log" 2>&1
  echo "build rc=$? in $((SECONDS - start)) s"; tail -3 "$out/build.log"
}

test_summary() {
  grep -E "^(FAILED|ERROR)|passed|failed" "$1" | tail -25
  sed -n '/= FAILURES =/,$p' "$1" | sed -n '2,/^___/p' | tail -40
}
