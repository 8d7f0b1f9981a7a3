// CUDA kernels for MoE routing, dispatch and combine. Schemas and shape letters: ../bindings.cpp;
// the CPU versions (../moe_cpu.cpp) and moetrain/ops/reference.py define the same functions.
//
// As on the CPU, every output row is written by exactly one group of threads: dispatch and the
// buffer gradient run over buffer rows through the inverse map row -> entry, combine runs over
// tokens. No atomics (so results are deterministic) and no zero-fill pass before a scatter.
// Rows move as 16-byte vectors whenever the row length and the pointers allow it.
// Only the headers used: ATen/cuda/CUDAContext.h would pull in cuSPARSE's headers, which a CUDA
// toolkit may lack, and torch/extension.h or ATen/ATen.h multiply the compile time.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cub/block/block_scan.cuh>
#include <torch/library.h>

#include <limits>
#include <type_traits>

#include "../checks.h"
#include "rows.cuh"

namespace moetrain {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFullWarp = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// route: the slot of each entry inside its expert is the number of earlier entries (in priority
// order) that chose the same expert, i.e. a stable counting sort. Three launches:
//   1. each block ranks a chunk of entries: lanes of a warp that chose the same expert find each
//      other with __match_any_sync, warps are ranked by a scan over per-warp counts in shared
//      memory; the chunk's per-expert counts go to chunk_count[chunk, E];
//   2. one block turns chunk_count into exclusive prefixes over chunks, the totals into load and
//      kept, and scans kept over experts for each expert's first row;
//   3. every entry adds its chunk's prefix to its rank and becomes a row, or -1 past capacity.

__global__ void route_rank_kernel(const int64_t* __restrict__ expert_idx, int64_t n, int num_experts,
                                  int64_t* __restrict__ rank_N, int32_t* __restrict__ chunk_count) {
  extern __shared__ int32_t warp_count[];  // [warps, E]: counts, then exclusive prefixes over warps
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = threadIdx.x; j < warps * num_experts; j += blockDim.x) warp_count[j] = 0;
  __syncthreads();

  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t expert = i < n ? expert_idx[i] : -1;
  CUDA_KERNEL_ASSERT(i >= n || (expert >= 0 && expert < num_experts));
  if (expert >= num_experts) expert = -1;  // out of range: already reported by the assert above
  const unsigned peers = __match_any_sync(kFullWarp, expert);
  const int rank_in_warp = __popc(peers & ((1u << lane) - 1u));
  if (expert >= 0 && rank_in_warp == 0) warp_count[warp * num_experts + expert] = __popc(peers);
  __syncthreads();

  for (int x = threadIdx.x; x < num_experts; x += blockDim.x) {
    int32_t running = 0;
    for (int w = 0; w < warps; ++w) {
      const int32_t count = warp_count[w * num_experts + x];
      warp_count[w * num_experts + x] = running;
      running += count;
    }
    chunk_count[static_cast<int64_t>(blockIdx.x) * num_experts + x] = running;
  }
  __syncthreads();
  if (expert >= 0) rank_N[i] = warp_count[warp * num_experts + expert] + rank_in_warp;
}

__global__ void route_scan_kernel(int32_t* __restrict__ chunk_count, int64_t chunks, int num_experts, int64_t capacity,
                                  bool packed, int64_t* __restrict__ load, int64_t* __restrict__ kept,
                                  int64_t* __restrict__ base) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int64_t carry;  // kept rows of the experts in earlier tiles
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int first = 0; first < num_experts; first += kThreads) {
    const int x = first + threadIdx.x;
    int64_t kept_x = 0;
    if (x < num_experts) {
      int32_t running = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        const int32_t count = chunk_count[c * num_experts + x];
        chunk_count[c * num_experts + x] = running;
        running += count;
      }
      load[x] = running;
      kept_x = running < capacity ? running : capacity;
      kept[x] = kept_x;
    }
    int64_t offset;
    Scan(scan_storage).ExclusiveSum(kept_x, offset);
    if (x < num_experts) base[x] = packed ? carry + offset : static_cast<int64_t>(x) * capacity;
    __syncthreads();
    if (threadIdx.x == kThreads - 1) carry += offset + kept_x;
    __syncthreads();
  }
}

__global__ void route_place_kernel(const int64_t* __restrict__ expert_idx, int64_t n, int num_experts, int chunk,
                                   const int32_t* __restrict__ chunk_prefix, const int64_t* __restrict__ base,
                                   int64_t capacity, int64_t* __restrict__ dest) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t expert = expert_idx[i];
  if (expert < 0 || expert >= num_experts) return;  // reported by route_rank_kernel's assert
  const int64_t slot = chunk_prefix[(i / chunk) * num_experts + expert] + dest[i];
  dest[i] = slot < capacity ? base[expert] + slot : -1;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> route_cuda(const at::Tensor& expert_idx, int64_t num_experts,
                                                          int64_t capacity, bool packed) {
  check_route(expert_idx, num_experts, capacity, packed);
  const c10::cuda::CUDAGuard guard(expert_idx.device());
  auto idx = expert_idx.contiguous();
  const int64_t n = idx.numel();
  // Each warp of a ranking block keeps E counters in 48 KB of shared memory.
  constexpr int64_t kCounters = 48 * 1024 / sizeof(int32_t);
  check_route_limits(n, num_experts, kCounters);
  const int warps = static_cast<int>(std::min<int64_t>(32, kCounters / num_experts));
  const int chunk = warps * 32;
  const int64_t chunks = std::max<int64_t>(1, (n + chunk - 1) / chunk);
  const int64_t cap = capacity < 0 ? n : capacity;

  auto dest = at::empty({n}, idx.options());
  auto load = at::empty({num_experts}, idx.options());
  auto kept = at::empty({num_experts}, idx.options());
  auto base = at::empty({num_experts}, idx.options());
  auto chunk_count = at::empty({chunks, num_experts}, idx.options().dtype(at::kInt));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int experts = static_cast<int>(num_experts);

  route_rank_kernel<<<chunks, chunk, warps * num_experts * sizeof(int32_t), stream>>>(
      idx.data_ptr<int64_t>(), n, experts, dest.data_ptr<int64_t>(), chunk_count.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  route_scan_kernel<<<1, kThreads, 0, stream>>>(chunk_count.data_ptr<int32_t>(), chunks, experts, cap, packed,
                                                load.data_ptr<int64_t>(), kept.data_ptr<int64_t>(),
                                                base.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (n > 0) {
    route_place_kernel<<<(n + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
        idx.data_ptr<int64_t>(), n, experts, chunk, chunk_count.data_ptr<int32_t>(), base.data_ptr<int64_t>(), cap,
        dest.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {dest, load, kept};
}

// ---------------------------------------------------------------------------------------------
// The inverse of a plan: source[r] = the flat entry t*K+k that fills buffer row r, or -1.

__global__ void invert_plan_kernel(const int64_t* __restrict__ dest, int64_t n, int64_t rows,
                                   int64_t* __restrict__ source) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t row = dest[i];
  CUDA_KERNEL_ASSERT(row < rows);
  if (row >= 0 && row < rows) source[row] = i;
}

at::Tensor row_sources(const at::Tensor& dest, int64_t num_rows) {
  auto source = at::full({num_rows}, -1, dest.options());
  const int64_t n = dest.numel();
  if (n > 0 && num_rows > 0) {
    invert_plan_kernel<<<(n + kThreads - 1) / kThreads, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        dest.data_ptr<int64_t>(), n, num_rows, source.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return source;
}

// ---------------------------------------------------------------------------------------------
// dispatch: buf[r] = x[source[r] / K], or zeros.

template <typename scalar_t, int VEC>
__global__ void dispatch_kernel(const scalar_t* __restrict__ x, const int64_t* __restrict__ source, int64_t rows,
                                int k, int64_t vectors, scalar_t* __restrict__ buf) {
  using V = Vec<scalar_t, VEC>;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) return;
  const int64_t entry = source[row];
  V* out = reinterpret_cast<V*>(buf) + row * vectors;
  if (entry < 0) {
    zero_row(out, vectors);
    return;
  }
  const V* in = reinterpret_cast<const V*>(x) + (entry / k) * vectors;
  for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) out[c] = in[c];
}

at::Tensor dispatch_cuda(const at::Tensor& x_in, const at::Tensor& dest_in, int64_t num_rows) {
  check_dispatch(x_in, dest_in, num_rows);
  const c10::cuda::CUDAGuard guard(x_in.device());
  auto x = x_in.contiguous();
  auto dest = dest_in.contiguous();
  const int64_t k = dest.size(1), dim = x.size(1);
  auto buf = at::empty({num_rows, dim}, x.options());
  if (num_rows == 0 || dim == 0) return buf;
  const auto source = row_sources(dest, num_rows);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "moetrain_dispatch_cuda", [&] {
    const int width = vector_width(dim, sizeof(scalar_t), {x.data_ptr(), buf.data_ptr()});
    with_vector_width<scalar_t>(width, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      const auto launch = row_launch(num_rows, dim / VEC);
      dispatch_kernel<scalar_t, VEC><<<launch.grid, launch.block, 0, c10::cuda::getCurrentCUDAStream()>>>(
          x.data_ptr<scalar_t>(), source.data_ptr<int64_t>(), num_rows, static_cast<int>(k), dim / VEC,
          buf.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return buf;
}

// ---------------------------------------------------------------------------------------------
// combine: y[t] = sum_k weight[t, k] * buf[dest[t, k]] in the op-math type, dropped entries skipped.
// With K, the choices per token, known at compile time (K > 0: the common top-k), a token's row
// indices and weights are read once, before its row, and each thread requests the vectors of all K
// rows before it sums any: K loads in flight instead of one chain of dependent ones. The sum runs in
// choice order either way, so both versions give the same bits. K = 0: k read at run time.

template <typename scalar_t, typename acc_t, int VEC, int K>
__global__ void combine_kernel(const scalar_t* __restrict__ buf, const int64_t* __restrict__ dest,
                               const acc_t* __restrict__ weight, int64_t tokens, int k, int64_t rows,
                               int64_t vectors, scalar_t* __restrict__ y) {
  using V = Vec<scalar_t, VEC>;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (t >= tokens) return;
  const V* rows_in = reinterpret_cast<const V*>(buf);
  V* out = reinterpret_cast<V*>(y) + t * vectors;
  if constexpr (K > 0) {
    int64_t row_of[K];
    acc_t scale_of[K];
#pragma unroll
    for (int choice = 0; choice < K; ++choice) {
      const int64_t row = dest[t * K + choice];
      CUDA_KERNEL_ASSERT(row < rows);
      row_of[choice] = (row >= 0 && row < rows) ? row : -1;
      scale_of[choice] = weight != nullptr ? weight[t * K + choice] : acc_t(1);
    }
    for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
      V in[K];
#pragma unroll
      for (int choice = 0; choice < K; ++choice) {
        if (row_of[choice] >= 0) in[choice] = rows_in[row_of[choice] * vectors + c];
      }
      acc_t acc[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] = acc_t(0);
#pragma unroll
      for (int choice = 0; choice < K; ++choice) {
        if (row_of[choice] < 0) continue;
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] += scale_of[choice] * static_cast<acc_t>(in[choice].v[j]);
      }
      V result;
#pragma unroll
      for (int j = 0; j < VEC; ++j) result.v[j] = static_cast<scalar_t>(acc[j]);
      out[c] = result;
    }
  } else {
    for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
      acc_t acc[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] = acc_t(0);
#pragma unroll 4
      for (int choice = 0; choice < k; ++choice) {
        const int64_t row = dest[t * k + choice];
        CUDA_KERNEL_ASSERT(row < rows);
        if (row < 0 || row >= rows) continue;
        const acc_t scale = weight != nullptr ? weight[t * k + choice] : acc_t(1);
        const V in = rows_in[row * vectors + c];
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] += scale * static_cast<acc_t>(in.v[j]);
      }
      V result;
#pragma unroll
      for (int j = 0; j < VEC; ++j) result.v[j] = static_cast<scalar_t>(acc[j]);
      out[c] = result;
    }
  }
}

// fn(std::integral_constant<int, K>) for the choices per token combine_kernel unrolls (1, 2, 4, 6, 8:
// Switch, GShard and Mixtral, Qwen3-style, DeepSeek-V3), K = 0 (read at run time) for any other k.
template <typename Fn>
void with_choices(int64_t k, const Fn& fn) {
  switch (k) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 8: fn(std::integral_constant<int, 8>{}); break;
    default: fn(std::integral_constant<int, 0>{}); break;
  }
}

at::Tensor combine_cuda(const at::Tensor& buf_in, const at::Tensor& dest_in, const c10::optional<at::Tensor>& weight_in) {
  check_combine(buf_in, dest_in, weight_in, at::toOpMathType(buf_in.scalar_type()));
  const c10::cuda::CUDAGuard guard(buf_in.device());
  auto buf = buf_in.contiguous();
  auto dest = dest_in.contiguous();
  const int64_t tokens = dest.size(0), k = dest.size(1), dim = buf.size(1), rows = buf.size(0);
  auto y = at::empty({tokens, dim}, buf.options());
  if (tokens == 0 || dim == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, buf.scalar_type(), "moetrain_combine_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor weight;
    const acc_t* w = nullptr;
    if (weight_in.has_value()) {
      weight = weight_in->contiguous();
      w = weight.data_ptr<acc_t>();
    }
    const int width = vector_width(dim, sizeof(scalar_t), {buf.data_ptr(), y.data_ptr()});
    with_vector_width<scalar_t>(width, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      const auto launch = row_launch(tokens, dim / VEC);
      with_choices(k, [&](auto choices) {
        constexpr int K = decltype(choices)::value;
        combine_kernel<scalar_t, acc_t, VEC, K><<<launch.grid, launch.block, 0, c10::cuda::getCurrentCUDAStream()>>>(
            buf.data_ptr<scalar_t>(), dest.data_ptr<int64_t>(), w, tokens, static_cast<int>(k), rows, dim / VEC,
            y.data_ptr<scalar_t>());
      });
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// combine_backward, one pass over the buffer rows: grad_buf[r] = weight[i] * grad_y[i / K] for the
// entry i that fills row r (zeros for unused rows) and, in the same pass, while grad_y's row is in
// registers, grad_weight[i] = <grad_y[i / K], buf[r]>, reduced across the threads of the row.

template <typename scalar_t, typename acc_t, int VEC, bool WEIGHT_GRAD>
__global__ void combine_backward_kernel(const scalar_t* __restrict__ grad_y, const scalar_t* __restrict__ buf,
                                        const int64_t* __restrict__ source, const acc_t* __restrict__ weight,
                                        int64_t rows, int k, int64_t vectors, scalar_t* __restrict__ grad_buf,
                                        acc_t* __restrict__ grad_weight) {
  using V = Vec<scalar_t, VEC>;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t entry = row < rows ? source[row] : -1;
  acc_t dot = 0;
  if (row < rows) {
    V* out = reinterpret_cast<V*>(grad_buf) + row * vectors;
    if (entry < 0) {
      zero_row(out, vectors);
    } else {
      const acc_t scale = weight[entry];
      const V* g = reinterpret_cast<const V*>(grad_y) + (entry / k) * vectors;
      const V* b = reinterpret_cast<const V*>(buf) + row * vectors;
      for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
        const V gv = g[c];
        V result;
#pragma unroll
        for (int j = 0; j < VEC; ++j) result.v[j] = static_cast<scalar_t>(scale * static_cast<acc_t>(gv.v[j]));
        out[c] = result;
        if constexpr (WEIGHT_GRAD) {
          const V bv = b[c];
#pragma unroll
          for (int j = 0; j < VEC; ++j) dot += static_cast<acc_t>(gv.v[j]) * static_cast<acc_t>(bv.v[j]);
        }
      }
    }
  }
  if constexpr (WEIGHT_GRAD) {
    // Whole warps lie inside one row (blockDim.x is a multiple of 32): reduce each warp with
    // shuffles, then the warps of a row through shared memory.
    __shared__ acc_t partial[kThreads / 32];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_down_sync(kFullWarp, dot, offset);
    const int warps_per_row = blockDim.x / 32;
    const int lane = threadIdx.x % 32, warp_in_row = threadIdx.x / 32;
    if (lane == 0) partial[threadIdx.y * warps_per_row + warp_in_row] = dot;
    __syncthreads();
    if (threadIdx.x == 0 && entry >= 0) {
      acc_t total = 0;
      for (int w = 0; w < warps_per_row; ++w) total += partial[threadIdx.y * warps_per_row + w];
      grad_weight[entry] = total;
    }
  }
}

std::tuple<at::Tensor, at::Tensor> combine_backward_cuda(const at::Tensor& grad_y_in, const at::Tensor& buf_in,
                                                         const at::Tensor& dest_in, const at::Tensor& weight_in,
                                                         int64_t num_rows, bool weight_grad) {
  check_combine_backward(grad_y_in, buf_in, dest_in, weight_in, num_rows, weight_grad,
                         at::toOpMathType(grad_y_in.scalar_type()));
  const c10::cuda::CUDAGuard guard(grad_y_in.device());
  auto grad_y = grad_y_in.contiguous();
  auto dest = dest_in.contiguous();
  auto weight = weight_in.contiguous();
  const int64_t k = dest.size(1), dim = grad_y.size(1);
  auto grad_buf = at::empty({num_rows, dim}, grad_y.options());
  auto grad_weight = at::zeros(dest.sizes(), weight.options());
  if (num_rows == 0) return {grad_buf, grad_weight};
  at::Tensor buf;
  if (weight_grad) {
    buf = buf_in.contiguous();
  }
  const auto source = row_sources(dest, num_rows);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_y.scalar_type(), "moetrain_combine_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* buf_ptr = weight_grad ? buf.data_ptr<scalar_t>() : nullptr;
    const int width = vector_width(dim, sizeof(scalar_t), {grad_y.data_ptr(), grad_buf.data_ptr(), buf_ptr});
    with_vector_width<scalar_t>(width, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      const auto launch = row_launch(num_rows, std::max<int64_t>(1, dim / VEC));
      const auto stream = c10::cuda::getCurrentCUDAStream();
      with_flag(weight_grad, [&](auto with_weight_grad) {
        constexpr bool WEIGHT_GRAD = decltype(with_weight_grad)::value;
        combine_backward_kernel<scalar_t, acc_t, VEC, WEIGHT_GRAD><<<launch.grid, launch.block, 0, stream>>>(
            grad_y.data_ptr<scalar_t>(), buf_ptr, source.data_ptr<int64_t>(), weight.data_ptr<acc_t>(), num_rows,
            static_cast<int>(k), dim / VEC, grad_buf.data_ptr<scalar_t>(),
            WEIGHT_GRAD ? grad_weight.data_ptr<acc_t>() : nullptr);
      });
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {grad_buf, grad_weight};
}

}  // namespace
}  // namespace moetrain

TORCH_LIBRARY_IMPL(moetrain, CUDA, m) {
  m.impl("route", &moetrain::route_cuda);
  m.impl("dispatch", &moetrain::dispatch_cuda);
  m.impl("combine", &moetrain::combine_cuda);
  m.impl("combine_backward", &moetrain::combine_backward_cuda);
}
