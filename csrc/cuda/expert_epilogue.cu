// CUDA kernel for the expert epilogue of the padded layout (schema in ../bindings.cpp; the CPU
// version is in ../moe_cpu.cpp, the pure-torch one in moetrain/ops/reference.py).
//
// After the first expert GEMM, y [E * C, O] gets each row's expert bias and the activation. As two
// torch ops this is a broadcasting add (ATen's non-vectorised path for broadcasts: ~4x slower than
// the memory bound on an H200) and a ReLU pass. Here it is one pass, in place, 16-byte vectors:
// one read and one write of y.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "../checks.h"
#include "rows.cuh"

namespace moetrain {
namespace {

template <typename scalar_t, int VEC, bool RELU>
__global__ void bias_act_kernel(scalar_t* __restrict__ y, const scalar_t* __restrict__ bias, int64_t vectors,
                                int64_t vectors_per_row, int64_t vectors_per_expert) {
  using V = Vec<scalar_t, VEC>;
  V* out = reinterpret_cast<V*>(y);
  const V* b = reinterpret_cast<const V*>(bias);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors; i += stride) {
    const int64_t expert = i / vectors_per_expert;
    const int64_t column = i % vectors_per_row;
    V value = out[i];
    const V add = b[expert * vectors_per_row + column];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      // Rounded once, as torch's add rounds its float result; the ReLU of a rounded value is exact.
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t sum = static_cast<scalar_t>(static_cast<acc_t>(value.v[j]) + static_cast<acc_t>(add.v[j]));
      const acc_t rounded = static_cast<acc_t>(sum);
      // ReLU keeps NaN, as torch.relu does.
      value.v[j] = RELU && rounded <= acc_t(0) ? scalar_t(0) : sum;
    }
    out[i] = value;
  }
}

at::Tensor& bias_act_cuda(at::Tensor& y, const at::Tensor& bias, int64_t rows_per_expert, bool relu) {
  check_bias_act(y, bias, rows_per_expert);
  if (y.numel() == 0) return y;
  const c10::cuda::CUDAGuard guard(y.device());
  const auto b = bias.contiguous();
  const int64_t dim = y.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "moetrain_bias_act_cuda", [&] {
    const int width = vector_width(dim, sizeof(scalar_t), {y.data_ptr(), b.data_ptr()});
    auto launch = [&](auto vec, auto with_relu) {
      constexpr int VEC = decltype(vec)::value;
      constexpr bool RELU = decltype(with_relu)::value;
      const int64_t per_row = dim / VEC;
      const int64_t vectors = y.numel() / VEC;
      constexpr int kThreads = 256;
      // A grid-stride loop: enough blocks to fill the GPU several times, never more than needed.
      const int64_t blocks = std::min<int64_t>((vectors + kThreads - 1) / kThreads, int64_t(1) << 20);
      bias_act_kernel<scalar_t, VEC, RELU><<<static_cast<unsigned>(blocks), kThreads, 0,
                                             c10::cuda::getCurrentCUDAStream()>>>(
          y.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), vectors, per_row, per_row * rows_per_expert);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    auto with_width = [&](auto with_relu) {
      if (width == 16 / static_cast<int>(sizeof(scalar_t))) {
        launch(std::integral_constant<int, 16 / sizeof(scalar_t)>{}, with_relu);
      } else {
        launch(std::integral_constant<int, 1>{}, with_relu);
      }
    };
    if (relu) {
      with_width(std::true_type{});
    } else {
      with_width(std::false_type{});
    }
  });
  return y;
}

}  // namespace
}  // namespace moetrain

TORCH_LIBRARY_IMPL(moetrain, CUDA, m) { m.impl("bias_act_", &moetrain::bias_act_cuda); }
