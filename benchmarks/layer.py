"""Benchmark of one MoE layer, forward + backward: `python -m moetrain.bench` (or `python benchmarks/layer.py`).

On a GPU (the default when one is visible) it prints, for each shape and from one run, the useful
expert TFLOP/s and the peak memory of one step. FFN shapes (Tutel's benchmark: two-matrix ReLU
experts with biases) have the columns
  moetrain           MoELayer, capacity factor 1.0 (padded layout, batched GEMMs, CUDA kernels)
  moetrain dropless  MoELayer, capacity factor 0 (packed layout, grouped GEMMs)
  naive              a loop over experts: gather, two matmuls, weighted index_add
  grouped_mm         torch's recipe: sort by expert, torch._grouped_mm twice, scatter back
  gemms alone        only the layer's six expert GEMMs (two forward, four backward) as batched
                     matmuls on its capacity blocks: a bound no MoE layer of that shape passes
  dense              one 8192^3 GEMM in the same dtype: the ceiling
  compiled           (with --compile MODE) torch.compile(MoELayer): the same layer as one traced
                     graph, the host's per-op cost gone (MODE reduce-overhead also replays it as a
                     CUDA graph); compile time is not counted
with each figure's fraction of the ceiling and moetrain's ratio to the grouped_mm baseline.
LM shapes (what Qwen3-MoE, DeepSeek-V3, Kimi-K2 and Mixtral train: softmax top-k with the k weights
renormalised, dropless, bias-free SwiGLU experts) have the columns
  moetrain           MoELayer(expert="swiglu", capacity_factor=0): fused gate/up grouped GEMM,
                     fused SwiGLU, the routing kernels
  grouped_mm         torch's recipe for them: sort, torch._grouped_mm three times, scatter back
  gemms alone        the three expert GEMMs, forward and backward, on equal blocks (the bound)
  fp8                the moetrain layer with precision="fp8" (on sm90+): the expert GEMMs of the
                     forward and the input gradient in FP8 with row-wise scales, the weight
                     gradient's in bf16 (moetrain.precision.fp8_matmul), against bf16; with
                     --fp8-wgrad fp8 the weight gradient's in FP8 too
  fp8_block          the same with precision="fp8_block": DeepSeek-V3's 1x128 / 128x128 block
                     scales, against bf16
The ceiling is a short burst; a layer's GEMMs run for seconds, and a large one (mixtral) draws
enough power for the card to lower its clocks, so "gemms alone" is the bound that shape can reach.
Useful expert FLOPs = tokens * D * H * k * matmuls (2 FFN, 3 SwiGLU) * 2 flop/mac * 3 (forward +
backward), the same count for every column. Peak memory: what one step allocates beyond its inputs
and weights (torch.cuda.max_memory_allocated). Step time: median of CUDA-event timings after warm-up.

`--device cpu` runs scaled-down shapes and compares the C++ kernel path with the pure-torch path
(impl="torch") and the naive loop as time ratios (absolute CPU times mean little on a shared
machine; `--threads 1` is the steadiest there). `--json PATH` writes every number; `--shapes` and
`--dtype` select what runs; `--profile` prints where a moetrain step spends its time and which
lines make the host wait for the GPU.

Shape letters: T tokens, D model dim, H expert hidden size, E experts, K choices per token.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from moetrain import MoELayer
from moetrain.ops import grouped, triton_grouped
from moetrain.precision.fp8_matmul import fp8_supported
from moetrain.precision.recipes import FP8_WGRADS
from moetrain.timing import host_ms, median_ms, profile_table


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int
    model_dim: int
    hidden_size: int
    num_experts: int
    top_k: int
    expert: str = "ffn"  # "ffn": ReLU FFN with biases, capacity-based; "swiglu": bias-free SwiGLU, dropless

    def useful_flops(self) -> float:
        matmuls = 3 if self.expert == "swiglu" else 2
        return self.tokens * self.model_dim * self.hidden_size * self.top_k * matmuls * 2 * 3


GPU_SHAPES = {
    shape.name: shape
    for shape in (
        Shape("gshard_2k", 16384, 2048, 2048, 8, 2),
        Shape("mixtral", 8192, 4096, 14336, 8, 2),
        Shape("deepseek_fg", 8192, 2048, 1408, 64, 6),
        Shape("switch_top1", 16384, 1024, 4096, 16, 1),
        Shape("moe_1b5", 32768, 2048, 2048, 8, 2, "swiglu"),
        Shape("qwen3_30b", 16384, 2048, 768, 128, 8, "swiglu"),
        Shape("mixtral_lm", 8192, 4096, 14336, 8, 2, "swiglu"),
        Shape("dsv3", 8192, 7168, 2048, 256, 8, "swiglu"),
    )
}
# Targets (docs/performance.md): (fraction of the dense ceiling, ratio to the grouped_mm baseline).
TARGETS = {"gshard_2k": (0.60, 1.2), "mixtral": (0.88, 1.0), "deepseek_fg": (0.50, 1.3), "switch_top1": (0.50, 1.25),
           "moe_1b5": (0.60, 1.3), "qwen3_30b": (0.55, 1.3), "mixtral_lm": (0.60, 1.3), "dsv3": (0.55, 1.3)}
DROPLESS_TARGET = 1.25  # FFN shapes: the dropless column against the grouped_mm baseline
FP8_TARGET = 1.4  # LM shapes: precision="fp8" against the same layer in bf16
FP8_BLOCK_TARGET = 1.25  # LM shapes: precision="fp8_block" against the same layer in bf16
# For a few-core CPU: the four GPU shapes with tokens and widths divided by 8 (experts and k kept),
# and two configurations of a 2-core machine (experts x top-k: 8 x 2 and 32 x 4).
CPU_SHAPES = {
    shape.name: shape
    for shape in (
        Shape("gshard_2k/8", 2048, 256, 256, 8, 2),
        Shape("mixtral/8", 1024, 512, 1792, 8, 2),
        Shape("deepseek_fg/8", 1024, 256, 176, 64, 6),
        Shape("switch_top1/8", 2048, 128, 512, 16, 1),
        Shape("cpu_e8_k2", 2048, 256, 512, 8, 2),
        Shape("cpu_e32_k4", 2048, 256, 128, 32, 4),
        Shape("moe_1b5/8", 4096, 256, 256, 8, 2, "swiglu"),
        Shape("qwen3_30b/8", 2048, 256, 96, 128, 8, "swiglu"),
    )
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


# ---- the two baselines, on the MoE layer's own parameters so that every column does the same arithmetic


def _route(x_TD: torch.Tensor, gate_ED: torch.Tensor, top_k: int, normalize: bool = False):
    """The layer's "top" gate: softmax over experts in fp32 (fp64 for fp64), the k largest
    probabilities (renormalised to sum to one when normalize, as Qwen3-MoE and Mixtral route)."""
    router_dtype = torch.promote_types(x_TD.dtype, torch.float32)
    probs_TE = torch.softmax(x_TD.to(router_dtype) @ gate_ED.to(router_dtype).t(), dim=-1)
    weight_TK, idx_TK = torch.topk(probs_TE, top_k, dim=-1)
    if normalize:
        weight_TK = weight_TK / weight_TK.sum(dim=-1, keepdim=True)
    return weight_TK, idx_TK


def _swiglu_weights(experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w_gate, w_up, w_down) of SwiGLU experts as [E, in, out] tensors."""
    return experts.w_gate, experts.w_up, experts.w_down


def naive_moe(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """Loop over experts: each gathers its tokens, runs its FFN (or SwiGLU) and adds the weighted output back."""
    experts = layer.experts
    swiglu = layer_kind(layer) == "swiglu"
    weight_TK, idx_TK = _route(x_TD, layer.gate.weight_ED, layer.top_k, normalize=swiglu)
    y_TD = torch.zeros_like(x_TD)
    for e in range(layer.num_experts):
        token_N, choice_N = torch.nonzero(idx_TK == e, as_tuple=True)
        if swiglu:
            w_gate, w_up, w_down = _swiglu_weights(experts)
            x_ND = x_TD[token_N]
            out_ND = (F.silu(x_ND @ w_gate[e]) * (x_ND @ w_up[e])) @ w_down[e]
        else:
            h_NH = F.relu(x_TD[token_N] @ experts.w1[e] + experts.b1[e])
            out_ND = h_NH @ experts.w2[e] + experts.b2[e]
        y_TD = y_TD.index_add(0, token_N, (out_ND * weight_TK[token_N, choice_N, None]).to(x_TD.dtype))
    return y_TD


def _group_offsets(expert_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 end of each expert's rows once the choices are sorted by expert, without a host sync
    (torch.bincount waits for the GPU to size its output)."""
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=expert_N.device)
    counts_E.scatter_add_(0, expert_N, torch.ones_like(expert_N))
    return torch.cumsum(counts_E, 0, dtype=torch.int32)


class GroupedMMBaseline:
    """torch's recipe as torchtitan writes it: sort the choices by expert, two torch._grouped_mm,
    weighted index_add back. Its weights are the layer's values stored [E, out, in] (both GEMM
    operands K-major, torchtitan's layout), its expert counts need no host sync, and each row's
    bias is one_hot @ b so that the bias gradient is a GEMM (a gather's gradient is an index_put
    that would dominate the step): the baseline is the best this recipe does."""

    def __init__(self, layer: MoELayer):
        experts = layer.experts
        self.layer = layer
        self.w1_EHD = experts.w1.detach().transpose(1, 2).contiguous().requires_grad_()
        self.w2_EDH = experts.w2.detach().transpose(1, 2).contiguous().requires_grad_()

    def parameters(self) -> list[torch.Tensor]:
        experts = self.layer.experts
        return [self.layer.gate.weight_ED, self.w1_EHD, experts.b1, self.w2_EDH, experts.b2]

    def __call__(self, x_TD: torch.Tensor) -> torch.Tensor:
        layer, experts = self.layer, self.layer.experts
        weight_TK, idx_TK = _route(x_TD, layer.gate.weight_ED, layer.top_k)
        expert_N = idx_TK.reshape(-1)
        order_N = torch.argsort(expert_N, stable=True)
        token_N = order_N // layer.top_k
        sorted_expert_N = expert_N[order_N]
        offsets_E = _group_offsets(expert_N, layer.num_experts)
        h_NH = torch._grouped_mm(x_TD[token_N], self.w1_EHD.transpose(1, 2), offs=offsets_E)
        one_hot_NE = F.one_hot(sorted_expert_N, layer.num_experts).to(x_TD.dtype)
        h_NH = F.relu(h_NH + one_hot_NE @ experts.b1)
        out_ND = torch._grouped_mm(h_NH, self.w2_EDH.transpose(1, 2), offs=offsets_E) + one_hot_NE @ experts.b2
        out_ND = out_ND * weight_TK.reshape(-1)[order_N, None].to(out_ND.dtype)
        return torch.zeros_like(x_TD).index_add(0, token_N, out_ND)


class GroupedMMSwiGLUBaseline:
    """torch's recipe for dropless SwiGLU experts (torchtitan's): softmax top-k renormalised, sort the
    choices by expert, torch._grouped_mm for gate, up and down on [E, out, in] weights (K-major),
    silu(gate) * up, weighted index_add back; no host sync."""

    def __init__(self, layer: MoELayer):
        self.layer = layer
        self.weights = [w.detach().transpose(1, 2).contiguous().requires_grad_() for w in _swiglu_weights(layer.experts)]

    def parameters(self) -> list[torch.Tensor]:
        return [self.layer.gate.weight_ED] + self.weights

    def __call__(self, x_TD: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        w_gate_EHD, w_up_EHD, w_down_EDH = self.weights
        weight_TK, idx_TK = _route(x_TD, layer.gate.weight_ED, layer.top_k, normalize=True)
        expert_N = idx_TK.reshape(-1)
        order_N = torch.argsort(expert_N, stable=True)
        token_N = order_N // layer.top_k
        offsets_E = _group_offsets(expert_N, layer.num_experts)
        x_ND = x_TD[token_N]
        gate_NH = torch._grouped_mm(x_ND, w_gate_EHD.transpose(1, 2), offs=offsets_E)
        up_NH = torch._grouped_mm(x_ND, w_up_EHD.transpose(1, 2), offs=offsets_E)
        out_ND = torch._grouped_mm(F.silu(gate_NH) * up_NH, w_down_EDH.transpose(1, 2), offs=offsets_E)
        out_ND = out_ND * weight_TK.reshape(-1)[order_N, None].to(out_ND.dtype)
        return torch.zeros_like(x_TD).index_add(0, token_N, out_ND)


def in_precision(layer: MoELayer, precision: str, fp8_wgrad: str = "bf16") -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer called with its expert GEMMs in another precision (same weights, same routing)."""
    def call(x_TD: torch.Tensor) -> torch.Tensor:
        saved = layer.precision, layer.fp8_wgrad
        layer.precision, layer.fp8_wgrad = precision, fp8_wgrad
        try:
            return layer(x_TD)
        finally:
            layer.precision, layer.fp8_wgrad = saved
    return call


def with_backend(call: Callable[[torch.Tensor], torch.Tensor], backend: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """call with the packed layout's expert GEMMs on another backend (moetrain.ops.grouped)."""
    def run(x_TD: torch.Tensor) -> torch.Tensor:
        saved = grouped.default_backend()
        grouped.set_default_backend(backend)
        try:
            return call(x_TD)
        finally:
            grouped.set_default_backend(saved)
    return run


def layer_kind(layer: MoELayer) -> str:
    return "swiglu" if hasattr(layer.experts, "w_gate_up") else "ffn"


# ---- timing


def _forward_backward(fn: Callable[[torch.Tensor], torch.Tensor], x_TD: torch.Tensor, params: list[torch.Tensor]):
    def step():
        y_TD = fn(x_TD)
        # Gradients are returned, not accumulated into .grad, so no step pays for an accumulation.
        torch.autograd.grad(y_TD.float().sum(), [x_TD] + params)

    return step


def gemms_alone(layer: MoELayer, shape: Shape, x_TD: torch.Tensor) -> Callable[[], None]:
    """One step of only the expert GEMMs, forward and backward, on [E, C, D] blocks (C = T*K/E)
    of the input's values, with the layer's weights: no routing, bias, activation or copies. (The
    first GEMM's own output gradient stands in for the activation's, so each GEMM runs once.)"""
    experts = layer.experts
    capacity = shape.tokens * shape.top_k // shape.num_experts
    x_ECD = x_TD.detach().repeat(shape.top_k, 1)[: capacity * shape.num_experts].view(shape.num_experts, capacity, -1)
    x_ECD.requires_grad_()
    if shape.expert == "swiglu":  # [E, C, D] x [E, D, 2H], then the first H columns x [E, H, D]
        w1, w2, hidden = experts.w_gate_up, experts.w_down, shape.hidden_size
    else:
        w1, w2, hidden = experts.w1, experts.w2, None

    def step():
        h_ECH = torch.bmm(x_ECD, w1)
        y_ECD = torch.bmm(h_ECH[..., :hidden] if hidden else h_ECH, w2)
        torch.autograd.grad([h_ECH, y_ECD], [x_ECD, w1, w2], [h_ECH.detach(), y_ECD.detach()])

    return step


def peak_step_gib(step: Callable[[], None], device: torch.device) -> float:
    """GiB one step allocates at its peak beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def _measure(step: Callable[[], None], shape: Shape, device: torch.device, warmup: int, steps: int) -> dict:
    ms = median_ms(step, device, warmup, steps)
    return {"ms": ms, "tflops": shape.useful_flops() / (ms * 1e-3) / 1e12, "peak_gib": peak_step_gib(step, device),
            "host_ms": host_ms(step, device)}


def dense_ceiling(device: torch.device, dtype: torch.dtype, size: int = 8192, warmup: int = 3, steps: int = 20) -> float:
    """TFLOP/s of one size^3 GEMM on random data."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    ms = median_ms(lambda: torch.mm(a, b), device, warmup, steps)
    return 2 * size**3 / (ms * 1e-3) / 1e12


def build_layer(shape: Shape, device: torch.device, dtype: torch.dtype, capacity_factor: float, impl: str) -> MoELayer:
    torch.manual_seed(0)
    swiglu = shape.expert == "swiglu"
    layer = MoELayer(model_dim=shape.model_dim, num_experts=shape.num_experts, hidden_size=shape.hidden_size,
                     top_k=shape.top_k, gate="top", capacity_factor=0.0 if swiglu else capacity_factor,
                     activation="silu" if swiglu else "relu", expert=shape.expert, impl=impl,
                     gate_kwargs={"normalize": True} if swiglu else None)
    layer = layer.to(device=device, dtype=dtype)
    layer.gate.to(torch.promote_types(dtype, torch.float32))  # the router computes in fp32 (or fp64)
    if not swiglu:
        with torch.no_grad():  # biases start at zero; give them values so their arithmetic is real
            layer.experts.b1.normal_(0, 0.02)
            layer.experts.b2.normal_(0, 0.02)
    return layer


def bench_shape(shape: Shape, device: torch.device, dtype: torch.dtype, capacity_factor: float, warmup: int,
                steps: int, profile: bool = False, compile_mode: str | None = None, fp8_wgrad: str = "bf16") -> dict:
    """Median step time and TFLOP/s of every implementation on one shape, same inputs for all."""
    torch.manual_seed(1)
    x_TD = torch.randn(shape.tokens, shape.model_dim, device=device, dtype=dtype, requires_grad=True)
    layer = build_layer(shape, device, dtype, capacity_factor, impl="kernel")
    params = list(layer.parameters())
    swiglu = shape.expert == "swiglu"
    columns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"moetrain": layer}
    if device.type == "cuda":
        if not swiglu:
            columns["moetrain_dropless"] = lambda x: layer(x, capacity_factor=0)
        if grouped.grouped_mm_supported(x_TD, layer.experts.w_down if swiglu else layer.experts.w1)[0]:
            columns["grouped_mm"] = GroupedMMSwiGLUBaseline(layer) if swiglu else GroupedMMBaseline(layer)
        if triton_grouped.triton is not None:
            # the dropless layer with moetrain's own Triton grouped GEMMs instead of torch's
            columns["moetrain_triton"] = with_backend(layer if swiglu else (lambda x: layer(x, capacity_factor=0)),
                                                      "triton")
        for precision in ("fp8", "fp8_block"):
            if swiglu and fp8_supported(device, precision)[0]:
                columns[f"moetrain_{precision}"] = in_precision(layer, precision, fp8_wgrad)
    else:
        torch_layer = build_layer(shape, device, dtype, capacity_factor, impl="torch")
        torch_layer.load_state_dict(layer.state_dict())
        columns["moetrain_torch"] = torch_layer
    if device.type == "cpu" or not swiglu:  # on the GPU the LM shapes' loop costs minutes and adds nothing
        columns["naive"] = lambda x: naive_moe(layer, x)
    if compile_mode is not None:
        torch._dynamo.reset()  # each shape traces afresh
        columns["compiled"] = torch.compile(layer, mode=None if compile_mode == "default" else compile_mode)
    result = {"shape": asdict(shape), "capacity_factor": 0.0 if swiglu else capacity_factor, "fp8_wgrad": fp8_wgrad}
    for name, fn in columns.items():
        fn_params = list(fn.parameters()) if name in ("moetrain_torch", "grouped_mm") else params
        step = _forward_backward(fn, x_TD, fn_params)
        if name == "compiled":
            begin = time.perf_counter()
            try:
                step()  # traces and compiles: not timed
            except Exception as error:  # noqa: BLE001 - torch.compile's failure is a result of this column
                result["compiled_error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
                continue
            result["compile_s"] = time.perf_counter() - begin
        result[name] = _measure(step, shape, device, warmup, steps)
    if device.type == "cuda":
        result["gemms_alone"] = _measure(gemms_alone(layer, shape, x_TD), shape, device, warmup, steps)
    with torch.no_grad():
        layer(x_TD)  # the last call decides layer.stats: make it the moetrain column's
    result["dropped_fraction"] = layer.stats.dropped_fraction
    if profile:
        print(f"--- {shape.name}: moetrain, 3 steps\n" + profile_table(_forward_backward(layer, x_TD, params), device))
    return result


# ---- reports


def _tflops(result: dict, column: str) -> float:
    return result[column]["tflops"] if column in result else float("nan")


def _peak(result: dict, column: str) -> str:
    return f"{result[column]['peak_gib']:.1f}" if column in result else "-"


def _against_bounds(result: dict, ceiling: float) -> str:
    """The columns both tables share: grouped, gemms, moetrain's fraction of the ceiling and its
    target, the gemms' fraction, moetrain against grouped and its target."""
    moetrain, grouped_tflops, gemms = (_tflops(result, c) for c in ("moetrain", "grouped_mm", "gemms_alone"))
    target_fraction, target_ratio = TARGETS.get(result["shape"]["name"], (float("nan"), float("nan")))
    return (f"{grouped_tflops:8.0f} {gemms:6.0f}   {moetrain / ceiling:10.0%} {target_fraction:6.0%} "
            f"{gemms / ceiling:6.0%}   {moetrain / grouped_tflops:9.2f}x {target_ratio:5.2f}x")


def gpu_table(results: list[dict], ceiling: float) -> str:
    lines = []
    ffn = [r for r in results if r["shape"].get("expert", "ffn") == "ffn"]
    lm = [r for r in results if r["shape"].get("expert", "ffn") == "swiglu"]
    if ffn:
        head = (f"{'FFN shape':<12} {'moetrain':>9} {'dropless':>9} {'naive':>7} {'grouped':>8} {'gemms':>6}   "
                f"{'of ceiling':>10} {'target':>6} {'gemms':>6}   {'vs grouped':>10} {'target':>6}   "
                f"{'dropless':>8} {'target':>6}   {'peak GiB':>8}   {'triton':>6} {'vs dropless':>11}")
        lines += [head, "-" * len(head)]
        for r in ffn:
            dropless = _tflops(r, "moetrain_dropless")
            lines.append(
                f"{r['shape']['name']:<12} {_tflops(r, 'moetrain'):9.0f} {dropless:9.0f} {_tflops(r, 'naive'):7.0f} "
                f"{_against_bounds(r, ceiling)}   {dropless / _tflops(r, 'grouped_mm'):7.2f}x {DROPLESS_TARGET:5.2f}x   "
                f"{_peak(r, 'moetrain'):>8}   {_tflops(r, 'moetrain_triton'):6.0f} "
                f"{_tflops(r, 'moetrain_triton') / dropless:10.2f}x"
            )
        lines.append("FFN: ReLU experts with biases, capacity factor 1.0 (moetrain) or dropless; the dropless "
                     "ratio is against grouped")
    if lm:
        head = (f"{'LM shape':<12} {'moetrain':>9} {'grouped':>8} {'gemms':>6}   {'of ceiling':>10} {'target':>6} "
                f"{'gemms':>6}   {'vs grouped':>10} {'target':>6}   {'peak GiB moetrain/grouped':>25}   "
                f"{'fp8':>6} {'vs bf16':>8} {'target':>6} {'peak GiB':>8}   "
                f"{'fp8_block':>9} {'vs bf16':>8} {'target':>6} {'peak GiB':>8}   {'triton':>6} {'vs bf16':>8}")
        lines += ([""] if lines else []) + [head, "-" * len(head)]
        for r in lm:
            fp8, fp8_block, bf16 = (_tflops(r, c) for c in ("moetrain_fp8", "moetrain_fp8_block", "moetrain"))
            lines.append(f"{r['shape']['name']:<12} {bf16:9.0f} {_against_bounds(r, ceiling)}   "
                         f"{_peak(r, 'moetrain') + ' / ' + _peak(r, 'grouped_mm'):>25}   "
                         f"{fp8:6.0f} {fp8 / bf16:7.2f}x {FP8_TARGET:5.2f}x {_peak(r, 'moetrain_fp8'):>8}   "
                         f"{fp8_block:9.0f} {fp8_block / bf16:7.2f}x {FP8_BLOCK_TARGET:5.2f}x "
                         f"{_peak(r, 'moetrain_fp8_block'):>8}   {_tflops(r, 'moetrain_triton'):6.0f} "
                         f"{_tflops(r, 'moetrain_triton') / bf16:7.2f}x")
        lines.append("LM: dropless bias-free SwiGLU experts, softmax top-k renormalised; fp8 / fp8_block: the same "
                     "layer with precision='fp8' / 'fp8_block' (forward and input-gradient expert GEMMs in FP8, "
                     "row-wise / 1x128 and 128x128 block scales; the weight gradient's in "
                     f"{lm[0].get('fp8_wgrad', 'bf16')}), TFLOP/s counted as bf16's; triton: the same "
                     "bf16 layer with moetrain.ops.triton_grouped's GEMMs instead of torch._grouped_mm")
    lines.append(f"useful expert TFLOP/s, forward + backward; dense GEMM ceiling {ceiling:.0f} TFLOP/s; "
                 "gemms = the expert GEMMs alone (the bound)")
    lines.append("host ms to issue a step / ms of the step (host near the step: the host bounds it): " + "; ".join(
        f"{r['shape']['name']} " + ", ".join(
            f"{label} {r[column]['host_ms']:.2f} / {r[column]['ms']:.2f}"
            for column, label in (("moetrain", "bf16" if r["shape"].get("expert") == "swiglu" else "moetrain"),
                                  ("moetrain_fp8", "fp8"), ("moetrain_fp8_block", "fp8_block"))
            if r.get(column, {}).get("host_ms") is not None)
        for r in results))
    compiled = [r for r in results if "compiled" in r]
    if compiled:
        lines.append("torch.compile(layer): " + "; ".join(
            f"{r['shape']['name']} {r['compiled']['tflops']:.0f} TFLOP/s ({r['compiled']['tflops'] / ceiling:.0%}, "
            f"{r['compiled']['tflops'] / _tflops(r, 'grouped_mm'):.2f}x grouped, "
            f"compiled in {r['compile_s']:.0f} s)" for r in compiled))
    lines += [f"torch.compile(layer) failed on {r['shape']['name']}: {r['compiled_error']}"
              for r in results if "compiled_error" in r]
    return "\n".join(lines)


def cpu_table(results: list[dict]) -> str:
    head = f"{'shape':<12} {'kernel ms':>10} {'torch ms':>9} {'naive ms':>9}   {'torch/kernel':>12} {'naive/kernel':>12}"
    lines = [head, "-" * len(head)]
    for r in results:
        kernel, torch_path, naive = r["moetrain"]["ms"], r["moetrain_torch"]["ms"], r["naive"]["ms"]
        lines.append(f"{r['shape']['name']:<12} {kernel:10.1f} {torch_path:9.1f} {naive:9.1f}   "
                     f"{torch_path / kernel:11.2f}x {naive / kernel:11.2f}x")
    lines.append("median step time, forward + backward; ratios > 1 mean the kernel path is faster")
    compiled = [r for r in results if "compiled" in r]
    if compiled:
        lines.append("torch.compile(layer): " + "; ".join(
            f"{r['shape']['name']} {r['compiled']['ms']:.1f} ms ({r['moetrain']['ms'] / r['compiled']['ms']:.2f}x eager)"
            for r in compiled))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m moetrain.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default=None,
                        help=f"comma-separated; GPU: {','.join(GPU_SHAPES)}; CPU: {','.join(CPU_SHAPES)} (default: all)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on GPU, fp32 on CPU")
    parser.add_argument("--capacity-factor", type=float, default=1.0, help="for the moetrain column (0: dropless)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20 on GPU, 10 on CPU)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--profile", action="store_true", help="print the kernels of the moetrain column's step")
    parser.add_argument("--compile", default=None, metavar="MODE", choices=COMPILE_MODES,
                        help=f"add a column for torch.compile(layer) in this mode ({', '.join(COMPILE_MODES)})")
    parser.add_argument("--fp8-wgrad", choices=FP8_WGRADS, default="bf16",
                        help="the fp8 and fp8_block columns' weight-gradient GEMM (MoELayer.fp8_wgrad)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch and the C++ kernels (default: torch's); 1 is steadiest on a busy machine")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA GPU is visible; use --device cpu")
    known = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    names = list(known) if args.shapes is None else [name.strip() for name in args.shapes.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"--shapes: unknown {unknown} for --device {device.type}; choose from {', '.join(known)}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    steps = args.steps or (20 if device.type == "cuda" else 10)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # shows the expert GEMM backend choice

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).replace("torch.", ""),
        "steps": steps,
        "threads": torch.get_num_threads(),
        "results": [],
    }
    if device.type == "cuda":
        report["dense_tflops"] = dense_ceiling(device, dtype)
    for name in names:
        result = bench_shape(known[name], device, dtype, args.capacity_factor, args.warmup, steps, args.profile,
                             args.compile, args.fp8_wgrad)
        report["results"].append(result)
        print(f"{name}: " + ", ".join(f"{k} {v['ms']:.2f} ms" for k, v in result.items() if isinstance(v, dict)
                                      and "ms" in v), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    threads = f", {report['threads']} threads" if device.type == "cpu" else ""
    print(f"\n{report['device']}, torch {report['torch']}, {report['dtype']}{threads}, {report['date']}")
    print(gpu_table(report["results"], report["dense_tflops"]) if device.type == "cuda" else cpu_table(report["results"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
