// Operator schemas of moetrain._C. The CPU implementations live in moe_cpu.cpp, the CUDA ones in
// moe_cuda.cu; both register under the same names, so Python calls torch.ops.moetrain.<name> and
// PyTorch's dispatcher picks the device.
//
// Shape letters: T tokens, K choices per token (top-k), N = T*K routing entries, E experts,
// R rows of the expert-major buffer, D model dim.
//
// A routing plan is one int64 tensor dest[T, K]: the row of the expert-major buffer that receives
// token t's k-th choice, or -1 when that choice was dropped (capacity exceeded).
#include <torch/extension.h>

TORCH_LIBRARY(moetrain, m) {
  // Flat routing entries in priority order -> (dest[N], load[E], kept[E]).
  // capacity < 0 means unlimited. packed=false lays experts out at e * capacity (padded);
  // packed=true lays them back to back (offset = sum of kept rows of earlier experts).
  m.def("route(Tensor expert_idx, int num_experts, int capacity, bool packed) -> (Tensor, Tensor, Tensor)");
  // buf[r] = x[t] for dest[t, k] == r; rows nobody writes are zero.
  m.def("dispatch(Tensor x, Tensor dest, int num_rows) -> Tensor");
  // y[t] = sum_k weight[t, k] * buf[dest[t, k]] (weight omitted: plain sum), skipping dest == -1.
  m.def("combine(Tensor buf, Tensor dest, Tensor? weight) -> Tensor");
  // Backward of combine: grad_buf[dest[t, k]] = weight[t, k] * grad_y[t] (zero elsewhere) and,
  // when weight_grad, grad_weight[t, k] = <grad_y[t], buf[dest[t, k]]>.
  m.def("combine_backward(Tensor grad_y, Tensor buf, Tensor dest, Tensor weight, int num_rows, bool weight_grad) -> (Tensor, Tensor)");
  // Router logits in fp32 from 16-bit activations without an fp32 copy of them (CUDA only):
  // float(x [T, D]) @ w [E, D]^T -> [T, E] float32, E <= 64, D % 8 == 0; and its backward
  // (grad_x in x's dtype, grad_w float32; each computed only when asked for).
  m.def("router_logits(Tensor x, Tensor w) -> Tensor");
  m.def("router_logits_backward(Tensor grad, Tensor x, Tensor w, bool x_grad, bool w_grad) -> (Tensor, Tensor)");
  // Expert epilogue of the padded layout, in place: y[r] = act(y[r] + bias[r / rows_per_expert]),
  // act = relu or identity; y contiguous [..., O] with E * rows_per_expert rows, bias [E, O] of y's dtype.
  // Returns nothing: an output aliasing y would keep torch.compile from functionalising the op.
  m.def("bias_act_(Tensor(a!) y, Tensor bias, int rows_per_expert, bool relu) -> ()");
  // Its backward in one pass: grad_in = grad where out > 0 else 0 (threshold_backward(grad, out, 0));
  // out=None means identity and grad_in is grad itself. When bias_grad, grad_bias [E, O] in grad's
  // dtype = sum of grad_in over each expert's rows, accumulated in fp32 (fp64 for fp64); else empty.
  m.def("bias_act_backward(Tensor grad, Tensor? out, int rows_per_expert, bool bias_grad) -> (Tensor, Tensor)");
}

// Importing moetrain._C registers the operators above; the module itself has no functions.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "moetrain dispatch/combine kernels (use through moetrain.ops)";
  module.attr("has_cuda") =
#ifdef MOETRAIN_WITH_CUDA
      true;
#else
      false;
#endif
}
