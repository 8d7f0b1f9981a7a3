"""Number formats and the arithmetic built on them, under the MoE layer and over ops/.

  recipes.py       the precisions an expert GEMM can run in (bf16, fp8, fp8_block) and the FP8 weight
                   gradient's settings: names and checks, read by the layer and by every command.
  formats.py       the element codecs (E4M3, E2M1, E8M0) and the weight formats built from them,
                   bit-exact, in pure torch.
  kernels.py       Triton kernels for those formats: FP8 activation quantization, the grouped GEMM of
                   every weight format, FP4 decoding.
  fp8_quantize.py  FP8 training's quantizers: rows, per-expert columns, tiles and weight blocks to
                   E4M3 values and fp32 scales.
  fp8_matmul.py    FP8 training's expert GEMMs: the scaled grouped GEMMs and their autograd
                   (MoELayer(precision="fp8" | "fp8_block")).
  fp8_linear.py    FP8 training's dense linears: row-wise scaled GEMMs on torch._scaled_mm and their
                   autograd (trainer.fp8_linears).

Quantized inference (moetrain.quant) and the MoE layer (moetrain.moe) import from here; nothing
here imports them.
"""
