#!/usr/bin/env bash
# Everything a GPU session checks, in one run on the 2-GPU machine (one GPU suffices for 1-2):
#   bash notes/gpu_all.sh OUTDIR
# 1. layer kernels: build, CUDA tests, memcheck (notes/gpu_check.sh; add "bench" to LAYER_STEPS),
# 2. quantized experts (notes/gpu_quant.sh), 3. expert parallelism on 2 GPUs (notes/gpu_parallel.sh).
set -u
out=${1:?usage: bash notes/gpu_all.sh OUTDIR}
mkdir -p "$out"
STEPS="${LAYER_STEPS:-tests memcheck}" bash notes/gpu_check.sh "$out/layer" 2>&1 | grep -v "^moetrain: compiling"
bash notes/gpu_quant.sh "$out/quant" 2>&1 | grep -v "rows/expert\|tiles rows" | tail -40
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  STEPS="check tests bench" bash notes/gpu_parallel.sh "$out/parallel" 2>&1 | head -40
fi
