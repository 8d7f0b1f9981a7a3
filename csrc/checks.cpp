// Definitions of the argument checks declared in checks.h, in one place for the CPU and CUDA files.
#include "checks.h"

#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <limits>
#include <string>

namespace moetrain {

// Numbers become text through std::to_string, never by streaming them into the message: on the H200
// machine (extension built there by torch.utils.cpp_extension) every error whose message streamed an
// integer segfaulted the process instead of raising, while messages made only of strings raised.
std::string text(int64_t value) { return std::to_string(value); }

std::string text(at::IntArrayRef values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

void check_plan(const at::Tensor& dest, int64_t tokens, const char* what) {
  TORCH_CHECK(dest.scalar_type() == at::kLong, what, ": dest must be int64, got ", dest.scalar_type());
  TORCH_CHECK(dest.dim() == 2 && dest.size(0) == tokens, what, ": dest must be [tokens, k] with tokens=", text(tokens),
              ", got ", text(dest.sizes()));
}

void check_route(const at::Tensor& expert_idx, int64_t num_experts, int64_t capacity, bool packed) {
  TORCH_CHECK(expert_idx.scalar_type() == at::kLong && expert_idx.dim() == 1,
              "route: expert_idx must be a 1-D int64 tensor");
  TORCH_CHECK(num_experts > 0, "route: num_experts must be positive");
  TORCH_CHECK(packed || capacity >= 0, "route: the padded layout needs a capacity >= 0");
}

int64_t check_bias_act(const at::Tensor& y, const at::Tensor& bias, int64_t rows_per_expert) {
  TORCH_CHECK(y.dim() >= 1 && y.is_contiguous(), "bias_act_: y must be contiguous, got strides ", text(y.strides()));
  const int64_t dim = y.size(-1);
  TORCH_CHECK(bias.dim() == 2 && bias.size(1) == dim, "bias_act_: bias must be [experts, ", text(dim), "], got ",
              text(bias.sizes()));
  const int64_t rows = dim == 0 ? 0 : y.numel() / dim;
  TORCH_CHECK(rows_per_expert > 0 && rows == bias.size(0) * rows_per_expert, "bias_act_: y has ", text(rows),
              " rows; expected experts * rows_per_expert = ", text(bias.size(0)), " * ", text(rows_per_expert));
  TORCH_CHECK(bias.scalar_type() == y.scalar_type(), "bias_act_: bias must have y's dtype ", y.scalar_type(),
              ", got ", bias.scalar_type());
  TORCH_CHECK(bias.device() == y.device(), "bias_act_: bias must be on ", y.device(), ", got ", bias.device());
  return rows;
}

int64_t check_bias_act_backward(const at::Tensor& grad, const std::optional<at::Tensor>& out, int64_t rows_per_expert) {
  const auto dtype = grad.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16,
              "bias_act_backward: grad must be float32, float64, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(grad.dim() >= 1, "bias_act_backward: grad must be [..., O], got a 0-d tensor");
  TORCH_CHECK(rows_per_expert > 0, "bias_act_backward: rows_per_expert must be positive, got ", text(rows_per_expert));
  // Rows from the leading sizes, not numel / O: an empty last dimension still has its rows.
  const int64_t rows = c10::multiply_integers(grad.sizes().begin(), grad.sizes().end() - 1);
  TORCH_CHECK(rows % rows_per_expert == 0, "bias_act_backward: grad has ", text(rows),
              " rows, not a multiple of rows_per_expert=", text(rows_per_expert));
  if (out.has_value()) {
    TORCH_CHECK(out->sizes() == grad.sizes(), "bias_act_backward: out must have grad's shape ", text(grad.sizes()), ", got ",
                text(out->sizes()));
    TORCH_CHECK(out->scalar_type() == dtype, "bias_act_backward: out must have grad's dtype ", dtype, ", got ",
                out->scalar_type());
    TORCH_CHECK(out->device() == grad.device(), "bias_act_backward: out must be on ", grad.device(), ", got ",
                out->device());
  }
  return rows / rows_per_expert;
}

void check_same_device(const at::Tensor& tensor, const at::Tensor& reference, const char* what, const char* name) {
  TORCH_CHECK(tensor.device() == reference.device(), what, ": ", name, " must be on ", reference.device(), ", got ",
              tensor.device());
}

void check_dispatch(const at::Tensor& x, const at::Tensor& dest, int64_t num_rows) {
  TORCH_CHECK(x.dim() == 2, "dispatch: x must be [tokens, dim], got ", text(x.sizes()));
  check_plan(dest, x.size(0), "dispatch");
  check_same_device(dest, x, "dispatch", "dest");
  TORCH_CHECK(num_rows >= 0, "dispatch: num_rows must be >= 0, got ", text(num_rows));
}

void check_combine(const at::Tensor& buf, const at::Tensor& dest, const std::optional<at::Tensor>& weight,
                   at::ScalarType weight_dtype) {
  TORCH_CHECK(buf.dim() == 2, "combine: buf must be [rows, dim], got ", text(buf.sizes()));
  TORCH_CHECK(dest.dim() == 2, "combine: dest must be [tokens, k], got ", text(dest.sizes()));
  TORCH_CHECK(dest.scalar_type() == at::kLong, "combine: dest must be int64, got ", dest.scalar_type());
  check_same_device(dest, buf, "combine", "dest");
  if (weight.has_value()) {
    TORCH_CHECK(weight->scalar_type() == weight_dtype, "combine: weight must be ", weight_dtype, " for ",
                buf.scalar_type(), " buffers, got ", weight->scalar_type());
    TORCH_CHECK(weight->sizes() == dest.sizes(), "combine: weight must have dest's shape ", text(dest.sizes()), ", got ",
                text(weight->sizes()));
    check_same_device(*weight, buf, "combine", "weight");
  }
}

void check_combine_backward(const at::Tensor& grad_y, const at::Tensor& buf, const at::Tensor& dest,
                            const at::Tensor& weight, int64_t num_rows, bool weight_grad, at::ScalarType weight_dtype) {
  TORCH_CHECK(grad_y.dim() == 2, "combine_backward: grad_y must be [tokens, dim], got ", text(grad_y.sizes()));
  check_plan(dest, grad_y.size(0), "combine_backward");
  check_same_device(dest, grad_y, "combine_backward", "dest");
  check_same_device(weight, grad_y, "combine_backward", "weight");
  TORCH_CHECK(num_rows >= 0, "combine_backward: num_rows must be >= 0, got ", text(num_rows));
  TORCH_CHECK(weight.sizes() == dest.sizes(), "combine_backward: weight must have dest's shape ", text(dest.sizes()),
              ", got ", text(weight.sizes()));
  TORCH_CHECK(weight.scalar_type() == weight_dtype, "combine_backward: weight must be ", weight_dtype, " for ",
              grad_y.scalar_type(), " gradients, got ", weight.scalar_type());
  if (weight_grad) {
    check_same_device(buf, grad_y, "combine_backward", "buf");
    TORCH_CHECK(buf.scalar_type() == grad_y.scalar_type() && buf.dim() == 2 && buf.size(0) == num_rows &&
                    buf.size(1) == grad_y.size(1),
                "combine_backward: buf must be [num_rows, dim] with grad_y's dtype, got ", text(buf.sizes()), " ",
                buf.scalar_type());
  }
}

void check_route_limits(int64_t entries, int64_t num_experts, int64_t max_experts) {
  TORCH_CHECK(entries < std::numeric_limits<int32_t>::max(), "route: at most 2^31 - 1 routing entries, got ", text(entries));
  TORCH_CHECK(num_experts <= max_experts, "route: the CUDA kernel supports at most ", text(max_experts), " experts, got ",
              text(num_experts));
}

void check_router(const at::Tensor& x, const at::Tensor& w, const char* what) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), what, ": x must be [T, D] and w [E, D], got ",
              text(x.sizes()), " and ", text(w.sizes()));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, what,
              ": x must be bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == at::kFloat, what, ": w must be float32, got ", w.scalar_type());
  TORCH_CHECK(w.size(0) >= 1 && w.size(0) <= 64, what, ": at most 64 experts, got ", text(w.size(0)));
  TORCH_CHECK(x.size(1) % 8 == 0, what, ": D must be a multiple of 8, got ", text(x.size(1)));
  TORCH_CHECK(x.device() == w.device(), what, ": x and w must be on one device, got ", x.device(), " and ", w.device());
}

void check_router_grad(const at::Tensor& grad, int64_t tokens, int64_t experts) {
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == tokens && grad.size(1) == experts,
              "router_logits_backward: grad must be [", text(tokens), ", ", text(experts), "], got ", text(grad.sizes()));
}

void check_launch_blocks(int64_t blocks, const char* what) {
  TORCH_CHECK(blocks <= std::numeric_limits<int>::max(), what, ": the input is too large for one launch (", text(blocks),
              " blocks)");
}

}  // namespace moetrain
