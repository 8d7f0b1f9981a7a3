// Argument checks shared by the CPU (moe_cpu.cpp) and CUDA (cuda/*.cu) implementations of an op,
// so both reject the same inputs with the same message. Schemas and shape letters: bindings.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <optional>

namespace moetrain {

// A routing plan: int64 dest[tokens, k].
inline void check_plan(const at::Tensor& dest, int64_t tokens, const char* what) {
  TORCH_CHECK(dest.scalar_type() == at::kLong, what, ": dest must be int64, got ", dest.scalar_type());
  TORCH_CHECK(dest.dim() == 2 && dest.size(0) == tokens, what, ": dest must be [tokens, k] with tokens=", tokens,
              ", got ", dest.sizes());
}

inline void check_route(const at::Tensor& expert_idx, int64_t num_experts, int64_t capacity, bool packed) {
  TORCH_CHECK(expert_idx.scalar_type() == at::kLong && expert_idx.dim() == 1,
              "route: expert_idx must be a 1-D int64 tensor");
  TORCH_CHECK(num_experts > 0, "route: num_experts must be positive");
  TORCH_CHECK(packed || capacity >= 0, "route: the padded layout needs a capacity >= 0");
}

// bias_act_: y contiguous [..., O] with experts * rows_per_expert rows, bias [experts, O] of y's
// dtype on y's device. Returns the number of rows.
inline int64_t check_bias_act(const at::Tensor& y, const at::Tensor& bias, int64_t rows_per_expert) {
  TORCH_CHECK(y.dim() >= 1 && y.is_contiguous(), "bias_act_: y must be contiguous, got strides ", y.strides());
  const int64_t dim = y.size(-1);
  TORCH_CHECK(bias.dim() == 2 && bias.size(1) == dim, "bias_act_: bias must be [experts, ", dim, "], got ",
              bias.sizes());
  const int64_t rows = dim == 0 ? 0 : y.numel() / dim;
  TORCH_CHECK(rows_per_expert > 0 && rows == bias.size(0) * rows_per_expert, "bias_act_: y has ", rows,
              " rows; expected experts * rows_per_expert = ", bias.size(0), " * ", rows_per_expert);
  TORCH_CHECK(bias.scalar_type() == y.scalar_type(), "bias_act_: bias must have y's dtype ", y.scalar_type(),
              ", got ", bias.scalar_type());
  TORCH_CHECK(bias.device() == y.device(), "bias_act_: bias must be on ", y.device(), ", got ", bias.device());
  return rows;
}

// bias_act_backward: grad [..., O] with experts * rows_per_expert rows, of a floating dtype; out, when
// given, the forward's output of grad's shape, dtype and device. Returns the number of experts.
inline int64_t check_bias_act_backward(const at::Tensor& grad, const std::optional<at::Tensor>& out,
                                       int64_t rows_per_expert) {
  const auto dtype = grad.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16,
              "bias_act_backward: grad must be float32, float64, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(grad.dim() >= 1, "bias_act_backward: grad must be [..., O], got a 0-d tensor");
  TORCH_CHECK(rows_per_expert > 0, "bias_act_backward: rows_per_expert must be positive, got ", rows_per_expert);
  // Rows from the leading sizes, not numel / O: an empty last dimension still has its rows.
  const int64_t rows = c10::multiply_integers(grad.sizes().begin(), grad.sizes().end() - 1);
  TORCH_CHECK(rows % rows_per_expert == 0, "bias_act_backward: grad has ", rows,
              " rows, not a multiple of rows_per_expert=", rows_per_expert);
  if (out.has_value()) {
    TORCH_CHECK(out->sizes() == grad.sizes(), "bias_act_backward: out must have grad's shape ", grad.sizes(), ", got ",
                out->sizes());
    TORCH_CHECK(out->scalar_type() == dtype, "bias_act_backward: out must have grad's dtype ", dtype, ", got ",
                out->scalar_type());
    TORCH_CHECK(out->device() == grad.device(), "bias_act_backward: out must be on ", grad.device(), ", got ",
                out->device());
  }
  return rows / rows_per_expert;
}

}  // namespace moetrain
