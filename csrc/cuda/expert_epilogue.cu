// CUDA kernel for the expert epilogue of the padded layout (schema in ../bindings.cpp; the CPU
// version is in ../moe_cpu.cpp, the pure-torch one in moetrain/ops/reference.py).
//
// After the first expert GEMM, y [E * C, O] gets each row's expert bias and the activation. As two
// torch ops this is a broadcasting add (ATen's non-vectorised path for broadcasts: ~4x slower than
// the memory bound on an H200) and a ReLU pass. Here it is one pass, in place, 16-byte vectors:
// one read and one write of y.
//
// Its backward, bias_act_backward, is as two torch ops a threshold_backward pass and a sum over each
// expert's rows that reads the result again (ATen's reduction runs at under half the H200's
// bandwidth). Here one kernel writes grad_in and adds up the values it has just computed: each thread
// owns one 16-byte column vector and walks a chunk of one expert's rows; the chunks' fp32 sums meet in
// a second, small kernel. No atomics, so the bias gradient is the same from run to run.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/threshold_backward.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <tuple>

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

void bias_act_cuda(at::Tensor& y, const at::Tensor& bias, int64_t rows_per_expert, bool relu) {
  check_bias_act(y, bias, rows_per_expert);
  if (y.numel() == 0) return;
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
    with_flag(relu, [&](auto with_relu) {
      with_vector_width<scalar_t>(width, [&](auto vec) { launch(vec, with_relu); });
    });
  });
}

// ---------------------------------------------------------------------------------------------
// Backward. A block of kBlockThreads is up to 32 column vectors (threadIdx.x) times row lanes
// (threadIdx.y) and owns one column tile of one chunk of one expert's rows (plan_backward below).

constexpr int kBlockThreads = 256;
// Loads a thread issues before it uses any of them: 4 x 16 bytes, so that 4 resident blocks per SM
// keep enough bytes in flight for the memory bandwidth. For ReLU that is 2 rows of grad and out (4
// rows would take 128 registers and halve the resident blocks: no more bytes in flight per SM).
template <bool RELU>
constexpr int kRowsInFlight = RELU ? 2 : 4;

// x <= 0 as torch compares (false for NaN), read from the sign and magnitude bits: the build's
// --use_fast_math flushes subnormals in float comparisons, which would zero the gradient where the
// output is a tiny positive number.
template <typename T>
__device__ __forceinline__ bool at_most_zero(T x) {
  using Bits = std::conditional_t<sizeof(T) == 2, uint16_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>;
  Bits bits;
  memcpy(&bits, &x, sizeof(T));
  constexpr Bits kSign = Bits(1) << (8 * sizeof(T) - 1);
  const auto value = static_cast<at::opmath_type<T>>(x);
  const bool is_nan = value != value;
  return !is_nan && ((bits & kSign) != 0 || bits == 0);
}

template <typename scalar_t, int VEC, bool RELU>
__global__ void __launch_bounds__(kBlockThreads)
    bias_act_backward_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ out,
                             scalar_t* __restrict__ grad_in, at::opmath_type<scalar_t>* __restrict__ partial,
                             scalar_t* __restrict__ grad_bias, int64_t vectors_per_row, int64_t rows_per_expert,
                             int64_t rows_per_chunk, int64_t chunks, int64_t tiles) {
  using V = Vec<scalar_t, VEC>;
  using acc_t = at::opmath_type<scalar_t>;
  using AccV = Vec<acc_t, VEC>;
  // Tile fastest: neighbouring blocks read neighbouring columns of the same rows.
  const int64_t block = blockIdx.x;
  const int64_t tile = block % tiles;
  const int64_t chunk = block / tiles % chunks;
  const int64_t expert = block / tiles / chunks;
  const int64_t column = tile * blockDim.x + threadIdx.x;
  const bool active = column < vectors_per_row;
  const int64_t first = expert * rows_per_expert + chunk * rows_per_chunk;
  const int64_t expert_end = (expert + 1) * rows_per_expert;
  const int64_t end = first + rows_per_chunk < expert_end ? first + rows_per_chunk : expert_end;
  const int64_t lanes = blockDim.y;

  const V* grad_v = reinterpret_cast<const V*>(grad);
  const V* out_v = reinterpret_cast<const V*>(out);
  V* grad_in_v = reinterpret_cast<V*>(grad_in);
  acc_t sum[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) sum[j] = acc_t(0);
  if (active) {
    for (int64_t row = first + threadIdx.y; row < end; row += lanes * kRowsInFlight<RELU>) {
      V g[kRowsInFlight<RELU>];
      [[maybe_unused]] V o[kRowsInFlight<RELU>];
#pragma unroll
      for (int u = 0; u < kRowsInFlight<RELU>; ++u) {
        const int64_t r = row + u * lanes;
        if (r < end) {
          g[u] = grad_v[r * vectors_per_row + column];
          if constexpr (RELU) o[u] = out_v[r * vectors_per_row + column];
        }
      }
#pragma unroll
      for (int u = 0; u < kRowsInFlight<RELU>; ++u) {
        const int64_t r = row + u * lanes;
        if (r < end) {
          if constexpr (RELU) {
            // threshold_backward(grad, out, 0): zero where out <= 0; a NaN out lets grad through.
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
              if (at_most_zero(o[u].v[j])) g[u].v[j] = scalar_t(0);
            }
            grad_in_v[r * vectors_per_row + column] = g[u];
          }
#pragma unroll
          for (int j = 0; j < VEC; ++j) sum[j] += static_cast<acc_t>(g[u].v[j]);
        }
      }
    }
  }
  // The row lanes meet in shared memory ([j][lane][column]: consecutive threads, consecutive banks);
  // lane 0 adds them up in a fixed order.
  __shared__ acc_t shared[VEC][kBlockThreads];
  const int slot = threadIdx.y * blockDim.x + threadIdx.x;
#pragma unroll
  for (int j = 0; j < VEC; ++j) shared[j][slot] = sum[j];
  __syncthreads();
  if (threadIdx.y != 0 || !active) return;
  for (int lane = 1; lane < lanes; ++lane) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) sum[j] += shared[j][lane * blockDim.x + threadIdx.x];
  }
  if (chunks == 1) {  // the whole expert: round once, straight into the bias gradient
    V result;
#pragma unroll
    for (int j = 0; j < VEC; ++j) result.v[j] = static_cast<scalar_t>(sum[j]);
    reinterpret_cast<V*>(grad_bias)[expert * vectors_per_row + column] = result;
  } else {
    AccV result;
#pragma unroll
    for (int j = 0; j < VEC; ++j) result.v[j] = sum[j];
    reinterpret_cast<AccV*>(partial)[(expert * chunks + chunk) * vectors_per_row + column] = result;
  }
}

// grad_bias[e, c] = sum over chunks of partial[e, chunk, c], rounded once. A block is 32 columns
// times 8 chunk lanes, so that the chunks of a column are read in parallel.
constexpr int kFinishColumns = 32;
constexpr int kFinishLanes = 8;

template <typename scalar_t>
__global__ void __launch_bounds__(kFinishColumns * kFinishLanes)
    bias_grad_finish_kernel(const at::opmath_type<scalar_t>* __restrict__ partial, scalar_t* __restrict__ grad_bias,
                            int64_t dim, int64_t chunks, int64_t column_tiles) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t expert = blockIdx.x / column_tiles;
  const int64_t column = blockIdx.x % column_tiles * kFinishColumns + threadIdx.x;
  acc_t sum = acc_t(0);
  if (column < dim) {
    for (int64_t chunk = threadIdx.y; chunk < chunks; chunk += kFinishLanes) {
      sum += partial[(expert * chunks + chunk) * dim + column];
    }
  }
  __shared__ acc_t shared[kFinishLanes][kFinishColumns];
  shared[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || column >= dim) return;
  for (int lane = 1; lane < kFinishLanes; ++lane) sum += shared[lane][threadIdx.x];
  grad_bias[expert * dim + column] = static_cast<scalar_t>(sum);
}

struct BackwardPlan {
  int64_t tiles;
  int64_t chunks;
  int64_t rows_per_chunk;
  dim3 block;
};

// Column threads per block: a warp's worth of 16-byte vectors (512 contiguous bytes of a row), or, for
// short rows, the whole row, with the rest of the block on further rows (a warp then reads whole
// consecutive rows, still contiguous).
//
// Chunks per expert: the kernel runs in waves of `resident` blocks that together stream at the
// memory bandwidth, so its time is about (waves) x (rows one thread walks); more chunks mean shorter
// walks but more partial sums to write and read back and, past one chunk, a second launch. The
// count minimising that estimate (in bytes moved) gives large inputs whole waves (one, or several
// when the experts' column tiles alone overfill one) and takes one chunk when the walks are short.
BackwardPlan plan_backward(int64_t experts, int64_t rows_per_expert, int64_t vectors_per_row, int64_t resident,
                           int64_t row_vector_bytes, int64_t partial_vector_bytes) {
  int64_t columns = 1;
  while (columns < std::min<int64_t>(vectors_per_row, 32)) columns *= 2;
  const int64_t lanes = kBlockThreads / columns;
  const int64_t tiles = (vectors_per_row + columns - 1) / columns;
  const int64_t pairs = experts * tiles;
  // A second launch costs about a microsecond: ~4 MB at the H200's bandwidth.
  constexpr int64_t kFinishLaunchBytes = int64_t(4) << 20;
  const int64_t block_row_bytes = kBlockThreads * row_vector_bytes;  // one step of every thread
  const int64_t most_chunks = std::min((rows_per_expert + lanes - 1) / lanes, (8 * resident + pairs - 1) / pairs);
  int64_t best_chunks = 1;
  int64_t best_rows = rows_per_expert;
  int64_t best_cost = std::numeric_limits<int64_t>::max();
  for (int64_t chunks = 1; chunks <= std::max<int64_t>(1, most_chunks); ++chunks) {
    const int64_t rows = (rows_per_expert + chunks - 1) / chunks;
    if ((rows_per_expert + rows - 1) / rows != chunks) continue;  // same split as fewer chunks
    const int64_t blocks = pairs * chunks;
    const int64_t waves = (blocks + resident - 1) / resident;
    const int64_t steps = (rows + lanes - 1) / lanes;
    int64_t cost = waves * resident * steps * block_row_bytes;
    if (chunks > 1) cost += blocks * columns * partial_vector_bytes * 2 + kFinishLaunchBytes;
    if (cost < best_cost) {
      best_cost = cost;
      best_chunks = chunks;
      best_rows = rows;
    }
  }
  return {tiles, best_chunks, best_rows, dim3(static_cast<unsigned>(columns), static_cast<unsigned>(lanes))};
}

std::tuple<at::Tensor, at::Tensor> bias_act_backward_cuda(const at::Tensor& grad, const std::optional<at::Tensor>& out,
                                                          int64_t rows_per_expert, bool bias_grad) {
  const int64_t experts = check_bias_act_backward(grad, out, rows_per_expert);
  const bool relu = out.has_value();
  // Without the bias gradient, the ReLU backward is one elementwise pass, which ATen runs at the
  // memory bandwidth already.
  if (!bias_grad) return {relu ? at::threshold_backward(grad, *out, 0) : grad, at::empty({0}, grad.options())};
  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t dim = grad.size(-1);
  auto grad_bias = at::empty({experts, dim}, grad.options());
  const auto g = grad.contiguous();
  const auto o = relu ? out->contiguous() : at::Tensor();
  auto grad_in = relu ? at::empty_like(g) : grad;
  if (grad_bias.numel() == 0) return {grad_in, grad_bias};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "moetrain_bias_act_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int width = vector_width(dim, sizeof(scalar_t),
                                   {g.data_ptr(), relu ? o.data_ptr() : nullptr, relu ? grad_in.data_ptr() : nullptr});
    auto launch = [&](auto vec, auto with_relu) {
      constexpr int VEC = decltype(vec)::value;
      constexpr bool RELU = decltype(with_relu)::value;
      auto* kernel = &bias_act_backward_kernel<scalar_t, VEC, RELU>;
      int device = 0;
      int sms = 0;
      int blocks_per_sm = 0;
      C10_CUDA_CHECK(cudaGetDevice(&device));
      C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kBlockThreads, 0));
      const int64_t per_row = dim / VEC;
      // Per thread and row: grad read, and for ReLU out read and grad_in written.
      const int64_t row_vector_bytes = (RELU ? 3 : 1) * VEC * static_cast<int64_t>(sizeof(scalar_t));
      const BackwardPlan plan = plan_backward(experts, rows_per_expert, per_row,
                                              std::max<int64_t>(1, int64_t(sms) * blocks_per_sm), row_vector_bytes,
                                              VEC * static_cast<int64_t>(sizeof(acc_t)));
      at::Tensor partial;
      if (plan.chunks > 1) {
        partial = at::empty({experts, plan.chunks, dim}, g.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
      }
      const auto stream = c10::cuda::getCurrentCUDAStream();
      const int64_t blocks = experts * plan.chunks * plan.tiles;
      check_launch_blocks(blocks, "bias_act_backward");
      kernel<<<static_cast<unsigned>(blocks), plan.block, 0, stream>>>(
          g.data_ptr<scalar_t>(), RELU ? o.data_ptr<scalar_t>() : nullptr,
          RELU ? grad_in.data_ptr<scalar_t>() : nullptr, plan.chunks > 1 ? partial.data_ptr<acc_t>() : nullptr,
          grad_bias.data_ptr<scalar_t>(), per_row, rows_per_expert, plan.rows_per_chunk, plan.chunks, plan.tiles);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (plan.chunks > 1) {
        const int64_t column_tiles = (dim + kFinishColumns - 1) / kFinishColumns;
        bias_grad_finish_kernel<scalar_t><<<static_cast<unsigned>(experts * column_tiles),
                                            dim3(kFinishColumns, kFinishLanes), 0, stream>>>(
            partial.data_ptr<acc_t>(), grad_bias.data_ptr<scalar_t>(), dim, plan.chunks, column_tiles);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    };
    with_flag(relu, [&](auto with_relu) {
      with_vector_width<scalar_t>(width, [&](auto vec) { launch(vec, with_relu); });
    });
  });
  return {grad_in, grad_bias};
}

}  // namespace
}  // namespace moetrain

TORCH_LIBRARY_IMPL(moetrain, CUDA, m) {
  m.impl("bias_act_", &moetrain::bias_act_cuda);
  m.impl("bias_act_backward", &moetrain::bias_act_backward_cuda);
}
