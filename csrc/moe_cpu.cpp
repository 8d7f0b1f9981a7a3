// CPU (OpenMP through at::parallel_for) kernels for MoE routing, dispatch and combine.
// Schemas and shape letters: bindings.cpp.
//
// Every kernel is organised so that each output row is written by exactly one thread: dispatch and
// the buffer gradient run over buffer rows (through the inverse map row -> entry), combine and the
// weight gradient run over tokens. No atomics, no zero-fill pass followed by a scatter.
#include <torch/extension.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "checks.h"

namespace {

// Rows per parallel chunk: about at::internal::GRAIN_SIZE elements, as ATen's own loops use, so a
// small call runs on one thread instead of paying for a parallel region (costly on a busy machine).
int64_t grain_rows(int64_t elements_per_row) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, elements_per_row));
}

// Inverse of the plan: for each buffer row, the flat entry t*K+k that fills it, or -1.
std::vector<int64_t> row_sources(const at::Tensor& dest, int64_t num_rows) {
  std::vector<int64_t> source(num_rows, -1);
  const int64_t* d = dest.data_ptr<int64_t>();
  const int64_t n = dest.numel();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = d[i];
    if (row < 0) continue;
    TORCH_CHECK(row < num_rows, "dest row ", moetrain::text(row), " out of range for a buffer of ", moetrain::text(num_rows), " rows");
    TORCH_CHECK(source[row] < 0, "dest row ", moetrain::text(row), " is the target of two routing entries");
    source[row] = i;
  }
  return source;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> route_cpu(const at::Tensor& expert_idx, int64_t num_experts,
                                                         int64_t capacity, bool packed) {
  moetrain::check_route(expert_idx, num_experts, capacity, packed);
  auto idx = expert_idx.contiguous();
  const int64_t n = idx.numel();
  auto dest = at::empty({n}, idx.options());
  auto load = at::zeros({num_experts}, idx.options());
  auto kept = at::empty({num_experts}, idx.options());
  const int64_t* e = idx.data_ptr<int64_t>();
  int64_t* out = dest.data_ptr<int64_t>();
  int64_t* l = load.data_ptr<int64_t>();
  int64_t* kp = kept.data_ptr<int64_t>();
  const int64_t cap = capacity < 0 ? n : capacity;
  // First pass: the slot of each entry inside its expert is the number of earlier entries
  // (in priority order) that chose the same expert.
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(e[i] >= 0 && e[i] < num_experts, "route: expert index ", moetrain::text(e[i]), " out of range [0, ",
                moetrain::text(num_experts), ")");
    out[i] = l[e[i]]++;
  }
  std::vector<int64_t> base(num_experts);
  int64_t offset = 0;
  for (int64_t x = 0; x < num_experts; ++x) {
    kp[x] = std::min(l[x], cap);
    base[x] = packed ? offset : x * cap;
    offset += kp[x];
  }
  for (int64_t i = 0; i < n; ++i) {
    out[i] = out[i] < cap ? base[e[i]] + out[i] : -1;
  }
  return {dest, load, kept};
}

at::Tensor dispatch_cpu(const at::Tensor& x_in, const at::Tensor& dest_in, int64_t num_rows) {
  moetrain::check_dispatch(x_in, dest_in, num_rows);
  auto x = x_in.contiguous();
  auto dest = dest_in.contiguous();
  const int64_t k = dest.size(1), dim = x.size(1);
  auto buf = at::empty({num_rows, dim}, x.options());
  const auto source = row_sources(dest, num_rows);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "moetrain_dispatch", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    scalar_t* dst = buf.data_ptr<scalar_t>();
    at::parallel_for(0, num_rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = dst + r * dim;
        if (source[r] < 0) {
          std::fill(row, row + dim, scalar_t(0));
        } else {
          std::copy(src + (source[r] / k) * dim, src + (source[r] / k + 1) * dim, row);
        }
      }
    });
  });
  return buf;
}

at::Tensor combine_cpu(const at::Tensor& buf_in, const at::Tensor& dest_in, const c10::optional<at::Tensor>& weight_in) {
  moetrain::check_combine(buf_in, dest_in, weight_in, at::toOpMathType(buf_in.scalar_type()));
  auto buf = buf_in.contiguous();
  auto dest = dest_in.contiguous();
  const int64_t tokens = dest.size(0), k = dest.size(1), dim = buf.size(1), rows = buf.size(0);
  auto y = at::empty({tokens, dim}, buf.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, buf.scalar_type(), "moetrain_combine", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor weight;
    const acc_t* w = nullptr;
    if (weight_in.has_value()) {
      weight = weight_in->contiguous();
      w = weight.data_ptr<acc_t>();
    }
    const scalar_t* b = buf.data_ptr<scalar_t>();
    const int64_t* d = dest.data_ptr<int64_t>();
    scalar_t* out = y.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, grain_rows(dim * k), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(dim);
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t j = 0; j < k; ++j) {
          const int64_t row = d[t * k + j];
          if (row < 0) continue;
          TORCH_CHECK(row < rows, "combine: dest row ", moetrain::text(row), " out of range for ", moetrain::text(rows), " rows");
          const acc_t scale = w ? w[t * k + j] : acc_t(1);
          const scalar_t* src = b + row * dim;
          for (int64_t c = 0; c < dim; ++c) acc[c] += scale * static_cast<acc_t>(src[c]);
        }
        scalar_t* dst = out + t * dim;
        for (int64_t c = 0; c < dim; ++c) dst[c] = static_cast<scalar_t>(acc[c]);
      }
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> combine_backward_cpu(const at::Tensor& grad_y_in, const at::Tensor& buf_in,
                                                        const at::Tensor& dest_in, const at::Tensor& weight_in,
                                                        int64_t num_rows, bool weight_grad) {
  moetrain::check_combine_backward(grad_y_in, buf_in, dest_in, weight_in, num_rows, weight_grad,
                                   at::toOpMathType(grad_y_in.scalar_type()));
  auto grad_y = grad_y_in.contiguous();
  auto dest = dest_in.contiguous();
  auto weight = weight_in.contiguous();
  const int64_t tokens = dest.size(0), k = dest.size(1), dim = grad_y.size(1);
  auto grad_buf = at::empty({num_rows, dim}, grad_y.options());
  auto grad_weight = at::zeros(dest.sizes(), weight.options());
  const auto source = row_sources(dest, num_rows);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_y.scalar_type(), "moetrain_combine_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* g = grad_y.data_ptr<scalar_t>();
    const acc_t* w = weight.data_ptr<acc_t>();
    scalar_t* gb = grad_buf.data_ptr<scalar_t>();
    at::parallel_for(0, num_rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = gb + r * dim;
        const int64_t entry = source[r];
        if (entry < 0) {
          std::fill(row, row + dim, scalar_t(0));
          continue;
        }
        const acc_t scale = w[entry];
        const scalar_t* src = g + (entry / k) * dim;
        for (int64_t c = 0; c < dim; ++c) row[c] = static_cast<scalar_t>(scale * static_cast<acc_t>(src[c]));
      }
    });
    if (weight_grad) {
      auto buf = buf_in.contiguous();
      const scalar_t* b = buf.data_ptr<scalar_t>();
      const int64_t* d = dest.data_ptr<int64_t>();
      acc_t* gw = grad_weight.data_ptr<acc_t>();
      at::parallel_for(0, tokens, grain_rows(dim * k), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const scalar_t* gy = g + t * dim;
          for (int64_t j = 0; j < k; ++j) {
            const int64_t row = d[t * k + j];
            if (row < 0) continue;
            const scalar_t* src = b + row * dim;
            acc_t dot = 0;
            for (int64_t c = 0; c < dim; ++c) dot += static_cast<acc_t>(gy[c]) * static_cast<acc_t>(src[c]);
            gw[t * k + j] = dot;
          }
        }
      });
    }
  });
  return {grad_buf, grad_weight};
}

// ---------------------------------------------------------------------------------------------
// bias_act_: y[r] = act(y[r] + bias[r / rows_per_expert]) in place (the padded layout's expert
// epilogue), one pass over y instead of a broadcasting add and an activation pass.

void bias_act_cpu(at::Tensor& y, const at::Tensor& bias, int64_t rows_per_expert, bool relu) {
  const int64_t rows = moetrain::check_bias_act(y, bias, rows_per_expert);
  const int64_t dim = y.size(-1);
  const auto b = bias.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "moetrain_bias_act_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    scalar_t* out = y.data_ptr<scalar_t>();
    const scalar_t* add = b.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = out + r * dim;
        const scalar_t* bias_row = add + (r / rows_per_expert) * dim;
        for (int64_t j = 0; j < dim; ++j) {
          // Rounded once, as torch's add rounds; ReLU keeps NaN, as torch.relu does.
          const scalar_t sum = static_cast<scalar_t>(static_cast<acc_t>(row[j]) + static_cast<acc_t>(bias_row[j]));
          row[j] = relu && static_cast<acc_t>(sum) <= acc_t(0) ? scalar_t(0) : sum;
        }
      }
    });
  });
}

// bias_act_backward: grad_in = threshold_backward(grad, out, 0) (or grad itself without out) and the
// bias gradient, each expert's column sums of grad_in, in the same pass. A task is one expert times
// one block of columns, so each bias-gradient value is summed by one thread, in row order.

// Columns per task: a block of rows this wide streams through the cache while its sums stay in L1.
constexpr int64_t kBiasGradColumns = 256;

// One task's rows. The inner loop has a select instead of a branch and restrict pointers, so that
// the compiler can vectorise it (it does for fp32, fp64 and bf16 at -O3; fp16's conversion is a
// software routine without F16C).
template <typename scalar_t, bool RELU>
void bias_act_backward_block(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ out,
                             scalar_t* __restrict__ grad_in, scalar_t* __restrict__ grad_bias, int64_t rows,
                             int64_t dim, int64_t width) {
  using acc_t = at::opmath_type<scalar_t>;
  acc_t sum[kBiasGradColumns] = {};
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * dim;
    for (int64_t j = 0; j < width; ++j) {
      scalar_t value = grad[base + j];
      if constexpr (RELU) {
        // threshold_backward(grad, out, 0): zero where out <= 0; a NaN out lets grad through. The
        // select is on scalar_t, not on a float to convert back (bf16: 2x faster here).
        value = static_cast<acc_t>(out[base + j]) <= acc_t(0) ? scalar_t(0) : value;
        grad_in[base + j] = value;
      }
      sum[j] += static_cast<acc_t>(value);
    }
  }
  for (int64_t j = 0; j < width; ++j) grad_bias[j] = static_cast<scalar_t>(sum[j]);
}

std::tuple<at::Tensor, at::Tensor> bias_act_backward_cpu(const at::Tensor& grad, const std::optional<at::Tensor>& out,
                                                         int64_t rows_per_expert, bool bias_grad) {
  const int64_t experts = moetrain::check_bias_act_backward(grad, out, rows_per_expert);
  const bool relu = out.has_value();
  if (!bias_grad) return {relu ? at::threshold_backward(grad, *out, 0) : grad, at::empty({0}, grad.options())};
  const int64_t dim = grad.size(-1);
  auto grad_bias = at::empty({experts, dim}, grad.options());
  const auto g = grad.contiguous();
  const auto o = relu ? out->contiguous() : at::Tensor();
  auto grad_in = relu ? at::empty_like(g) : grad;
  const int64_t column_blocks = (dim + kBiasGradColumns - 1) / kBiasGradColumns;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "moetrain_bias_act_backward_cpu", [&] {
    const scalar_t* grad_p = g.data_ptr<scalar_t>();
    const scalar_t* out_p = relu ? o.data_ptr<scalar_t>() : nullptr;
    scalar_t* grad_in_p = relu ? grad_in.data_ptr<scalar_t>() : nullptr;
    scalar_t* grad_bias_p = grad_bias.data_ptr<scalar_t>();
    const int64_t grain = grain_rows(rows_per_expert * kBiasGradColumns);
    at::parallel_for(0, experts * column_blocks, grain, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t expert = task / column_blocks;
        const int64_t column = task % column_blocks * kBiasGradColumns;
        const int64_t width = std::min(kBiasGradColumns, dim - column);
        const int64_t offset = expert * rows_per_expert * dim + column;
        if (relu) {
          bias_act_backward_block<scalar_t, true>(grad_p + offset, out_p + offset, grad_in_p + offset,
                                                  grad_bias_p + expert * dim + column, rows_per_expert, dim, width);
        } else {
          bias_act_backward_block<scalar_t, false>(grad_p + offset, nullptr, nullptr,
                                                   grad_bias_p + expert * dim + column, rows_per_expert, dim, width);
        }
      }
    });
  });
  return {grad_in, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(moetrain, CPU, m) {
  m.impl("bias_act_", &bias_act_cpu);
  m.impl("bias_act_backward", &bias_act_backward_cpu);
  m.impl("route", &route_cpu);
  m.impl("dispatch", &dispatch_cpu);
  m.impl("combine", &combine_cpu);
  m.impl("combine_backward", &combine_backward_cpu);
}
