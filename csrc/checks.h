// Argument checks shared by the CPU (moe_cpu.cpp) and CUDA (cuda/*.cu) implementations of an op,
// so both reject the same inputs with the same message. Schemas and shape letters: bindings.cpp.
// Defined in checks.cpp. Messages put numbers in with text(), not by streaming them (see text()).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace moetrain {

// A number or a shape as text for an error message.
std::string text(int64_t value);
std::string text(at::IntArrayRef values);

// A routing plan: int64 dest[tokens, k].
void check_plan(const at::Tensor& dest, int64_t tokens, const char* what);

void check_route(const at::Tensor& expert_idx, int64_t num_experts, int64_t capacity, bool packed);

// bias_act_: y contiguous [..., O] with experts * rows_per_expert rows, bias [experts, O] of y's
// dtype on y's device. Returns the number of rows.
int64_t check_bias_act(const at::Tensor& y, const at::Tensor& bias, int64_t rows_per_expert);

// bias_act_backward: grad [..., O] with experts * rows_per_expert rows, of a floating dtype; out, when
// given, the forward's output of grad's shape, dtype and device. Returns the number of experts.
int64_t check_bias_act_backward(const at::Tensor& grad, const std::optional<at::Tensor>& out, int64_t rows_per_expert);

void check_same_device(const at::Tensor& tensor, const at::Tensor& reference, const char* what, const char* name);

// x [tokens, dim], a routing plan for those tokens on x's device, num_rows >= 0.
void check_dispatch(const at::Tensor& x, const at::Tensor& dest, int64_t num_rows);

// buf [rows, dim], dest int64 [tokens, k] on buf's device, weight (if given) of dest's shape in weight_dtype.
void check_combine(const at::Tensor& buf, const at::Tensor& dest, const std::optional<at::Tensor>& weight,
                   at::ScalarType weight_dtype);

// grad_y [tokens, dim], a plan for its tokens, weight of dest's shape in weight_dtype, num_rows >= 0;
// with weight_grad, buf [num_rows, dim] of grad_y's dtype. All on grad_y's device.
void check_combine_backward(const at::Tensor& grad_y, const at::Tensor& buf, const at::Tensor& dest,
                            const at::Tensor& weight, int64_t num_rows, bool weight_grad, at::ScalarType weight_dtype);

// The CUDA route kernel's limits: int32 entry indices and max_experts counters per warp.
void check_route_limits(int64_t entries, int64_t num_experts, int64_t max_experts);

// Router kernels: x [T, D] bf16/fp16 with D % 8 == 0, w [E, D] fp32 with 1 <= E <= 64, one device.
void check_router(const at::Tensor& x, const at::Tensor& w, const char* what);
void check_router_grad(const at::Tensor& grad, int64_t tokens, int64_t experts);

// A 1-D grid of blocks must fit an int.
void check_launch_blocks(int64_t blocks, const char* what);

}  // namespace moetrain
