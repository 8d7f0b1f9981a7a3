// Row-copy helpers shared by the CUDA kernels: 16-byte vectors and the launch shape for kernels that
// give each row of a [rows, dim] tensor to one group of threads.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace moetrain {

// VEC elements of T moved as one aligned access (16 bytes when VEC = 16 / sizeof(T)).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

// Zeros into one row of `vectors` vectors, the row's threads (threadIdx.x) striding along it.
template <typename T, int VEC>
__device__ inline void zero_row(Vec<T, VEC>* row, int64_t vectors) {
  Vec<T, VEC> zero;
#pragma unroll
  for (int j = 0; j < VEC; ++j) zero.v[j] = T(0);
  for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) row[c] = zero;
}

// The widest vector that divides the row and that every pointer is aligned to; 1 otherwise.
inline int vector_width(int64_t dim, int64_t element_size, std::initializer_list<const void*> pointers) {
  const int64_t width = 16 / element_size;
  if (dim % width != 0) return 1;
  for (const void* p : pointers) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  }
  return static_cast<int>(width);
}

// Instantiates fn for the wide vector of scalar_t (width as vector_width returned it) or for single
// elements: fn(std::integral_constant<int, VEC>).
template <typename scalar_t, typename Fn>
void with_vector_width(int width, const Fn& fn) {
  constexpr int kWide = 16 / sizeof(scalar_t);
  if (width == kWide) {
    fn(std::integral_constant<int, kWide>{});
  } else {
    fn(std::integral_constant<int, 1>{});
  }
}

// A runtime flag as a compile-time one: fn(std::true_type) or fn(std::false_type).
template <typename Fn>
void with_flag(bool flag, const Fn& fn) {
  if (flag) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

// Threads along a row (x, a multiple of the warp so that no warp spans two rows) times rows per
// block (y): 256 threads a block, each thread moving about one 16-byte vector of its row.
struct RowLaunch {
  dim3 grid;
  dim3 block;
};

inline RowLaunch row_launch(int64_t rows, int64_t vectors_per_row) {
  constexpr int64_t kThreads = 256;
  const int64_t along_row = std::min<int64_t>(kThreads, (vectors_per_row + 31) / 32 * 32);
  const int64_t rows_per_block = kThreads / along_row;
  const int64_t blocks = std::max<int64_t>(1, (rows + rows_per_block - 1) / rows_per_block);
  return {dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(along_row), static_cast<unsigned>(rows_per_block))};
}

}  // namespace moetrain
