"""Why switch_top1's step is slower after other shapes ran in the same process (GPU only):
python notes/order.py

Times switch_top1's moetrain step (CUDA events, as moetrain.bench) and its host issue time
(GPU idle before, no sync inside) first in a fresh process, then after gshard_2k and mixtral ran,
then after gc.collect() + empty_cache(), then with the garbage collector off.
"""

from __future__ import annotations

import gc
import time

import torch

from anatomy import layer_step, median_ms  # notes/, this script's folder
from hostcost import host_ms  # notes/, this script's folder
from moetrain import bench


def measure(label):
    step = layer_step(bench.GPU_SHAPES["switch_top1"])[-1]
    ms = median_ms(step)
    print(f"{label:<40} step {ms:.3f} ms, host issue {host_ms(step):.3f} ms, gc objects {len(gc.get_objects())}, "
          f"reserved {torch.cuda.memory_reserved() / 2**30:.1f} GiB, allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB",
          flush=True)


def main():
    print(torch.cuda.get_device_name(), torch.__version__)
    measure("fresh process")
    measure("again")
    for name in ("gshard_2k", "mixtral"):
        bench.bench_shape(bench.GPU_SHAPES[name], torch.device("cuda"), torch.bfloat16, 1.0, 5, 20)
        measure(f"after {name}")
    gc.collect()
    torch.cuda.empty_cache()
    measure("after gc.collect + empty_cache")
    gc.disable()
    measure("garbage collector off")
    gc.enable()
    torch.cuda.synchronize()
    time.sleep(5)
    measure("after 5 s idle")


if __name__ == "__main__":
    main()
