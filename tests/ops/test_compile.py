"""torch.compile through the MoE layer: the compiled operators have shape-only (fake) versions, so
a layer traces as one graph and the compiled layer computes what the eager one does."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._subclasses.fake_tensor import FakeTensorMode

from moetrain import MoELayer, ops
from moetrain.ops import fake


def _layer(gate: str = "top", capacity_factor: float = 1.0, **kwargs) -> MoELayer:
    layer = MoELayer(model_dim=32, num_experts=4, hidden_size=48, top_k=2, gate=gate,
                     capacity_factor=capacity_factor, **kwargs)
    with torch.no_grad():  # non-zero biases, so the fused epilogue's arithmetic shows
        for name, param in layer.named_parameters():
            if name.endswith(("b1", "b2")):
                param.normal_()
    return layer


@pytest.mark.parametrize("gate,expert", [("top", "ffn"), ("sigmoid", "swiglu"), ("cosine", "ffn")])
def test_layer_traces_as_one_graph(gate, expert):
    torch._dynamo.reset()
    layer = _layer(gate, expert=expert, num_shared_experts=1 if expert == "swiglu" else 0)
    explained = torch._dynamo.explain(layer)(torch.randn(64, 32))
    reasons = [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    assert explained.graph_count == 1 and not reasons, reasons


@pytest.mark.parametrize("capacity_factor", [1.0, 0.0])
def test_compiled_layer_matches_eager(capacity_factor):
    """aot_eager runs the traced forward and backward graphs op by op: what differs from eager is
    only the tracing (fake kernels, autograd through the traced Functions), so results are equal."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = _layer(capacity_factor=capacity_factor, z_loss_weight=0.1)
    eager = copy.deepcopy(layer)
    compiled = torch.compile(layer, backend="aot_eager")
    for step in range(2):  # the second call replays the compiled graph
        x = torch.randn(64, 32, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        y = compiled(x)
        (y.square().sum() + layer.aux_loss).backward()
        y_ref = eager(x_ref)
        (y_ref.square().sum() + eager.aux_loss).backward()
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
        torch.testing.assert_close(layer.aux_loss, eager.aux_loss, rtol=0, atol=0)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
        assert torch.equal(layer.stats.kept_per_expert, eager.stats.kept_per_expert)
    for (name, p), p_ref in zip(layer.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=0, atol=0, msg=name)


def test_fake_kernels_give_the_real_shapes_and_dtypes():
    """Each fake returns what the C++ kernel returns, checked on the CPU kernels (the router
    kernels exist on CUDA only: their fakes are checked against the pure-torch reference)."""
    ops.load()
    torch.manual_seed(0)
    tokens, k, experts, dim, capacity = 10, 2, 4, 16, 6
    x = torch.randn(tokens, dim)
    idx = torch.randint(0, experts, (tokens * k,))
    dest, load, kept = torch.ops.moetrain.route(idx, experts, capacity, False)
    dest_TK = dest.view(tokens, k)
    weight = torch.rand(tokens, k)
    buf = torch.ops.moetrain.dispatch(x, dest_TK, experts * capacity)
    calls = {
        "route": (idx, experts, capacity, False),
        "dispatch": (x, dest_TK, experts * capacity),
        "combine": (buf, dest_TK, weight),
        "combine_backward": (x, buf, dest_TK, weight, experts * capacity, True),
    }
    real = {name: getattr(torch.ops.moetrain, name)(*args) for name, args in calls.items()}
    w = torch.randn(experts, dim)
    real["router_logits"] = ops.reference.router_logits(x.bfloat16(), w)
    calls["router_logits"] = (x.bfloat16(), w)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for name, args in calls.items():
            outputs = getattr(fake, f"_{name}")(*args)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            expected = real[name] if isinstance(real[name], tuple) else (real[name],)
            assert [(o.shape, o.dtype) for o in outputs] == [(e.shape, e.dtype) for e in expected], name


@pytest.mark.cuda
@pytest.mark.parametrize("capacity_factor,expert", [(1.0, "ffn"), (0.0, "swiglu")])
def test_compiled_layer_matches_eager_on_cuda(capacity_factor, expert):
    """The CUDA path traced: the fp32 router kernel on bf16 activations, the fused epilogue and its
    one-pass backward (padded), torch._grouped_mm (dropless)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = _layer(capacity_factor=capacity_factor, expert=expert, num_shared_experts=1).cuda().bfloat16()
    layer.gate.float()
    eager = copy.deepcopy(layer)
    compiled = torch.compile(layer, backend="aot_eager")
    x = torch.randn(256, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = compiled(x)
    (y.float().square().sum() + layer.aux_loss).backward()
    y_ref = eager(x_ref)
    (y_ref.float().square().sum() + eager.aux_loss).backward()
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for (name, p), p_ref in zip(layer.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)
