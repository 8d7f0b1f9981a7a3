// The fp32 router of a 16-bit model, without an fp32 copy of its input (schemas in ../bindings.cpp,
// the pure-torch version is moetrain/ops/reference.py: router_logits).
//
// logits [T, E] = float(x [T, D]) @ w [E, D]^T with fp32 weights and fp32 arithmetic, as a router
// that casts x to fp32 computes it. Through torch that is a cast pass writing an fp32 copy of x,
// an fp32 GEMM with N = E (cuBLAS runs SIMT kernels at a few % of the card for such a thin N), and
// in the backward two more fp32 GEMMs and a cast of grad_x back. Here each kernel reads x (or
// writes grad_x) once in its own dtype, with 16-byte vectors:
//   forward   a warp owns TPW tokens (blocks of 8 warps, the loop over D not unrolled); each lane
//             multiplies its 8 columns of a 256-wide slice of D by the same columns of w (read
//             through the read-only cache: w is small and every warp of the grid reads it, so no
//             shared-memory tile and no block barrier), a warp shuffle reduces over lanes;
//   grad_x    the same layout: grad_x[t, d] = sum_e grad[t, e] * w[e, d], written in x's dtype;
//   grad_w    each thread owns 8 columns and 8 experts over a chunk of tokens (the token loop unrolled
//             8 times); chunk partial sums [chunks, E, D] are reduced by torch (a small tensor).
// At exactly 8 experts the kernels are compiled for E = 8 (template EX), so that the checks against E
// fold away and every w load of a step can be in flight at once; other E pass EX = 0 and check at run
// time. That, the block sizes and the unrolling are the fastest of a sweep at 8 experts, D 2048 and
// 32768 bf16 tokens on an H100 (docs/performance.md, "The router's kernels tuned"): the same
// arithmetic in the same order, bit for bit the kernels before.
// E <= 64 and D a multiple of 8 (the Python side falls back to torch otherwise).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "../checks.h"
#include "rows.cuh"

namespace moetrain {
namespace {

constexpr int kForwardWarps = 8;
// grad_x: blocks of 4 warps and the loop over D unrolled 4 times at 8 experts (the sweep's fastest),
// 8 warps and no unrolling at more (untimed there; unrolling would spill at 32 and 64)
__host__ __device__ constexpr int grad_x_warps(int padded_experts) { return padded_experts == 8 ? 4 : 8; }
constexpr int kChunk = 256;        // columns of D a warp covers per step: 32 lanes x 8
constexpr int kTokensPerChunk = 128;  // grad_w: tokens summed by one thread before writing a partial
constexpr unsigned kAllLanes = 0xffffffffu;

template <typename scalar_t>
__device__ inline void load8(const scalar_t* p, float (&v)[8]) {
  const Vec<scalar_t, 8> in = *reinterpret_cast<const Vec<scalar_t, 8>*>(p);
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = static_cast<float>(in.v[j]);
}

// w[e, d : d + 8] (zeros past E), through the read-only data cache.
__device__ inline void w_columns(const float* __restrict__ w, int e, int E, int64_t D, int64_t d, float (&wv)[8]) {
  if (e >= E) {
#pragma unroll
    for (int j = 0; j < 8; ++j) wv[j] = 0.f;
    return;
  }
  const float4 lo = __ldg(reinterpret_cast<const float4*>(w + e * D + d));
  const float4 hi = __ldg(reinterpret_cast<const float4*>(w + e * D + d + 4));
  wv[0] = lo.x, wv[1] = lo.y, wv[2] = lo.z, wv[3] = lo.w, wv[4] = hi.x, wv[5] = hi.y, wv[6] = hi.z, wv[7] = hi.w;
}

template <typename scalar_t, int EP, int TPW, int EX>
__global__ void __launch_bounds__(kForwardWarps * 32) router_forward_kernel(const scalar_t* __restrict__ x,
                                                                            const float* __restrict__ w, int64_t T,
                                                                            int E_arg, int64_t D,
                                                                            float* __restrict__ logits) {
  const int E = EX > 0 ? EX : E_arg;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t0 = (static_cast<int64_t>(blockIdx.x) * kForwardWarps + warp) * TPW;
  float acc[TPW][EP];
#pragma unroll
  for (int i = 0; i < TPW; ++i)
#pragma unroll
    for (int e = 0; e < EP; ++e) acc[i][e] = 0.f;
#pragma unroll 1
  for (int64_t d0 = 0; d0 < D; d0 += kChunk) {
    const int64_t d = d0 + lane * 8;
    if (d >= D) continue;
    float xv[TPW][8];
#pragma unroll
    for (int i = 0; i < TPW; ++i) {
      if (t0 + i < T) {
        load8(x + (t0 + i) * D + d, xv[i]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) xv[i][j] = 0.f;
      }
    }
#pragma unroll
    for (int e = 0; e < EP; ++e) {
      float wv[8];
      w_columns(w, e, E, D, d, wv);
#pragma unroll
      for (int i = 0; i < TPW; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][e] = fmaf(xv[i][j], wv[j], acc[i][e]);
    }
  }
#pragma unroll
  for (int i = 0; i < TPW; ++i) {
#pragma unroll
    for (int e = 0; e < EP; ++e) {
      float v = acc[i][e];
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(kAllLanes, v, offset);
      if (lane == e % 32 && e < E && t0 + i < T) logits[(t0 + i) * E + e] = v;
    }
  }
}

template <typename scalar_t, int EP, int TPW, int EX>
__global__ void __launch_bounds__(grad_x_warps(EP) * 32) router_grad_x_kernel(const float* __restrict__ grad,
                                                                         const float* __restrict__ w, int64_t T,
                                                                         int E_arg, int64_t D,
                                                                         scalar_t* __restrict__ grad_x) {
  const int E = EX > 0 ? EX : E_arg;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t0 = (static_cast<int64_t>(blockIdx.x) * grad_x_warps(EP) + warp) * TPW;
  float g[TPW][EP];
#pragma unroll
  for (int i = 0; i < TPW; ++i)
#pragma unroll
    for (int e = 0; e < EP; ++e) g[i][e] = (t0 + i < T && e < E) ? grad[(t0 + i) * E + e] : 0.f;
#pragma unroll(EP == 8 ? 4 : 1)
  for (int64_t d0 = 0; d0 < D; d0 += kChunk) {
    const int64_t d = d0 + lane * 8;
    if (d >= D) continue;
    float out[TPW][8];
#pragma unroll
    for (int i = 0; i < TPW; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) out[i][j] = 0.f;
#pragma unroll
    for (int e = 0; e < EP; ++e) {
      float wv[8];
      w_columns(w, e, E, D, d, wv);
#pragma unroll
      for (int i = 0; i < TPW; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) out[i][j] = fmaf(g[i][e], wv[j], out[i][j]);
    }
#pragma unroll
    for (int i = 0; i < TPW; ++i) {
      if (t0 + i >= T) continue;
      Vec<scalar_t, 8> v;
#pragma unroll
      for (int j = 0; j < 8; ++j) v.v[j] = static_cast<scalar_t>(out[i][j]);
      *reinterpret_cast<Vec<scalar_t, 8>*>(grad_x + (t0 + i) * D + d) = v;
    }
  }
}

// grid (column vectors / 128 threads, expert groups of 8, token chunks): partial[chunk, e, d].
template <typename scalar_t, int EX>
__global__ void router_grad_w_kernel(const float* __restrict__ grad, const scalar_t* __restrict__ x, int64_t T,
                                     int E_arg, int64_t D, float* __restrict__ partial) {
  const int E = EX > 0 ? EX : E_arg;
  const int64_t vec = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t d = vec * 8;
  if (d >= D) return;
  const int e0 = EX == 8 ? 0 : blockIdx.y * 8;
  const int64_t chunk = blockIdx.z;
  const int64_t t_end = (chunk + 1) * kTokensPerChunk < T ? (chunk + 1) * kTokensPerChunk : T;
  float acc[8][8];
#pragma unroll
  for (int e = 0; e < 8; ++e)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[e][j] = 0.f;
  for (int64_t t = chunk * kTokensPerChunk; t < t_end; ++t) {
    float xv[8];
    load8(x + t * D + d, xv);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float ge = e0 + e < E ? grad[t * E + e0 + e] : 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[e][j] = fmaf(ge, xv[j], acc[e][j]);
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    if (e0 + e >= E) break;
    float* out = partial + (chunk * E + e0 + e) * D + d;
    *reinterpret_cast<float4*>(out) = make_float4(acc[e][0], acc[e][1], acc[e][2], acc[e][3]);
    *reinterpret_cast<float4*>(out + 4) = make_float4(acc[e][4], acc[e][5], acc[e][6], acc[e][7]);
  }
}

// Blocks of `warps` warps, each warp owning tokens_per_warp tokens, to cover T tokens.
unsigned token_blocks(int64_t T, int warps, int tokens_per_warp) {
  return static_cast<unsigned>((T + warps * tokens_per_warp - 1) / (warps * tokens_per_warp));
}

// The kernels read and write x's rows, and read w's, as 16-byte vectors.
at::Tensor aligned_contiguous(const at::Tensor& x) {
  auto out = x.contiguous();
  return reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 ? out : out.clone();
}

// Calls fn(EX) with EX = 8 where E is exactly 8 (the kernels compiled for that count), 0 otherwise
// (E read at run time): the one place that decides it, for every router kernel.
template <typename Fn>
void with_exact_experts(int64_t E, const Fn& fn) {
  if (E == 8) {
    fn(std::integral_constant<int, 8>{});
  } else {
    fn(std::integral_constant<int, 0>{});
  }
}

// Calls fn(EP, TPW, EX) with EP = E rounded up to 8/16/32/64, TPW tokens per warp, the fastest of
// the counts timed on an H200 (8 experts: 2, 4 or 8 tokens, 4 ran at 1.4 TB/s and 8 at 1.0 TB/s;
// 16 experts: 2 or 4; 32 experts: 1 or 2), and EX as with_exact_experts picks it.
template <int EP, int TPW, typename Fn>
void with_padded_experts(int64_t E, const Fn& fn) {
  const auto ep = std::integral_constant<int, EP>{};
  const auto tpw = std::integral_constant<int, TPW>{};
  if constexpr (EP == 8) {
    with_exact_experts(E, [&](auto ex) { fn(ep, tpw, ex); });
  } else {
    fn(ep, tpw, std::integral_constant<int, 0>{});
  }
}

template <typename Fn>
void with_experts(int64_t E, const Fn& fn) {
  if (E <= 8) {
    with_padded_experts<8, 4>(E, fn);
  } else if (E <= 16) {
    with_padded_experts<16, 4>(E, fn);
  } else if (E <= 32) {
    with_padded_experts<32, 2>(E, fn);
  } else {
    with_padded_experts<64, 1>(E, fn);
  }
}

at::Tensor router_logits_cuda(const at::Tensor& x_in, const at::Tensor& w_in) {
  check_router(x_in, w_in, "router_logits");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = aligned_contiguous(x_in);
  const auto w = aligned_contiguous(w_in);
  const int64_t T = x.size(0), D = x.size(1), E = w.size(0);
  auto logits = at::empty({T, E}, x.options().dtype(at::kFloat));
  if (T == 0) return logits;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "moetrain_router_logits", [&] {
    with_experts(E, [&](auto ep, auto tpw, auto ex) {
      constexpr int EP = decltype(ep)::value, TPW = decltype(tpw)::value, EX = decltype(ex)::value;
      auto kernel = router_forward_kernel<scalar_t, EP, TPW, EX>;
      kernel<<<token_blocks(T, kForwardWarps, TPW), kForwardWarps * 32, 0, c10::cuda::getCurrentCUDAStream()>>>(
          x.data_ptr<scalar_t>(), w.data_ptr<float>(), T, static_cast<int>(E), D, logits.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return logits;
}

std::tuple<at::Tensor, at::Tensor> router_logits_backward_cuda(const at::Tensor& grad_in, const at::Tensor& x_in,
                                                               const at::Tensor& w_in, bool x_grad, bool w_grad) {
  check_router(x_in, w_in, "router_logits_backward");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = aligned_contiguous(x_in);
  const auto w = aligned_contiguous(w_in);
  const auto grad = grad_in.to(at::kFloat).contiguous();
  const int64_t T = x.size(0), D = x.size(1), E = w.size(0);
  check_router_grad(grad, T, E);
  // Gradients not asked for come back as empty tensors.
  at::Tensor grad_x = at::empty({0}, x.options()), grad_w = at::empty({0}, w.options());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "moetrain_router_logits_backward", [&] {
    if (x_grad) {
      grad_x = at::empty_like(x);
      if (T > 0) {
        with_experts(E, [&](auto ep, auto tpw, auto ex) {
          constexpr int EP = decltype(ep)::value, TPW = decltype(tpw)::value, EX = decltype(ex)::value;
          auto kernel = router_grad_x_kernel<scalar_t, EP, TPW, EX>;
          kernel<<<token_blocks(T, grad_x_warps(EP), TPW), grad_x_warps(EP) * 32, 0, stream>>>(
              grad.data_ptr<float>(), w.data_ptr<float>(), T, static_cast<int>(E), D, grad_x.data_ptr<scalar_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      }
    }
    if (w_grad) {
      const int64_t chunks = std::max<int64_t>(1, (T + kTokensPerChunk - 1) / kTokensPerChunk);
      // every element is written when there are tokens; zeros only for the one chunk of none
      auto partial = T > 0 ? at::empty({chunks, E, D}, w.options()) : at::zeros({chunks, E, D}, w.options());
      if (T > 0) {
        const int64_t vectors = D / 8;
        constexpr int kThreads = 128;
        const dim3 grid(static_cast<unsigned>((vectors + kThreads - 1) / kThreads), static_cast<unsigned>((E + 7) / 8),
                        static_cast<unsigned>(chunks));
        with_exact_experts(E, [&](auto ex) {
          auto kernel = router_grad_w_kernel<scalar_t, decltype(ex)::value>;
          kernel<<<grid, kThreads, 0, stream>>>(grad.data_ptr<float>(), x.data_ptr<scalar_t>(), T, static_cast<int>(E),
                                                D, partial.data_ptr<float>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      }
      grad_w = partial.sum(0);
    }
  });
  return {grad_x, grad_w};
}

}  // namespace
}  // namespace moetrain

TORCH_LIBRARY_IMPL(moetrain, CUDA, m) {
  m.impl("router_logits", &moetrain::router_logits_cuda);
  m.impl("router_logits_backward", &moetrain::router_logits_backward_cuda);
}
