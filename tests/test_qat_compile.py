"""torch.compile(fullgraph=True) on QAT-wrapped models: one graph, same numbers as eager."""

import numpy as np
import pytest
import torch
from torch import nn

from mixle.models.qat import QuantSpec, apply_qat
from tests.test_numerics import reference_codes_scales
from tests.test_qat_torch import ids, make_lm


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def mlp(spec):
    torch.manual_seed(0)
    return apply_qat(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)), spec=spec)


def step(model, x):
    for p in model.parameters():
        p.grad = None
    out = model(x)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("spec", [
    QuantSpec(bits=4),
    QuantSpec(bits=4, group_size=32, clip_percentile=99.0, clip_gradient=True),
    QuantSpec(bits=8, granularity="tensor", grid="qwix"),
])
def test_fullgraph_forward_and_backward_equal_eager(spec):
    # aot_eager runs dynamo's single graph and AOT autograd's forward/backward split without
    # inductor's code generation, so the numbers must be those of eager exactly.
    model, x = mlp(spec), torch.randn(8, 64)
    eager_out, eager_grads = step(model, x)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out, grads = step(compiled, x)
    assert torch.equal(out, eager_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads))


def test_fullgraph_tied_embedding_model_equals_eager():
    model = apply_qat(make_lm(), bits=4, group_size=8)
    eager = model(ids())
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(ids()), eager)


def test_inductor_step_matches_eager_and_its_fake_quant_is_bit_exact():
    # One layer fed the identity: its output is the fake-quantized weight itself (transposed),
    # so the generated kernel must land on the shared grid bit for bit. One compile (slow).
    spec = QuantSpec(bits=4, group_size=32, clip_percentile=99.0)
    torch.manual_seed(0)
    layer, x = apply_qat(nn.Linear(64, 32, bias=False), spec=spec), torch.eye(64)
    eager_out, eager_grads = step(layer, x)
    out, grads = step(torch.compile(layer, fullgraph=True), x)
    expected = reference_codes_scales(layer.weight.detach().numpy(), 4, "group", 32, 99.0)[2]
    np.testing.assert_array_equal(out.T.numpy(), expected)
    np.testing.assert_array_equal(eager_out.T.numpy(), expected)
    torch.testing.assert_close(grads[0], eager_grads[0], rtol=1e-5, atol=1e-7)


def test_non_finite_weight_is_refused_inside_the_compiled_graph():
    model = mlp(QuantSpec(bits=4))
    with torch.no_grad():
        model[0].weight[1, 2] = float("nan")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match="NaN or infinity"):
        compiled(torch.randn(2, 64))


def test_the_compiled_graph_runs_the_fused_kernels_through_the_dispatcher(fake_quant_path):
    """With the kernels built, dynamo records mixle's custom ops in the graph (traced with their
    fake implementations), so compiled QAT runs the same one-pass kernels as eager."""
    seen = []

    def recording_backend(graph_module, example_inputs):
        for module in graph_module.modules():  # autograd.Function bodies are nested graphs
            if isinstance(module, torch.fx.GraphModule):
                seen.extend(str(node.target) for node in module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    model = mlp(QuantSpec(bits=4, group_size=32))
    x = torch.randn(8, 64)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True, backend=recording_backend)
    assert torch.equal(compiled(x), eager)
    uses_kernel = any("mixle.fused_fake_quant" in target for target in seen)
    assert uses_kernel == (fake_quant_path == "fused")


class TiedLM(nn.Module):
    """Every layer kind in one small model: a tied embedding and head, a Linear, transformers'
    Conv1D, a Conv1d and a MultiheadAttention."""

    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.emb, self.fc, self.proj = nn.Embedding(50, 64), nn.Linear(64, 64), Conv1D(64, 64)
        self.conv, self.attn = nn.Conv1d(64, 64, 1), nn.MultiheadAttention(64, 4, batch_first=True)
        self.head = nn.Linear(64, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = torch.relu(self.fc(self.emb(ids)))
        h = self.proj(h) + self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h + self.attn(h, h, h, need_weights=False)[0])


GRID_SPECS = {  # every grid with act_bits; learned scales and percentile clipping ride on the plain grids
    "symmetric": dict(bits=4, group_size=32, act_bits=8, scale="learned"),
    "qwix": dict(bits=8, group_size=32, grid="qwix", act_bits=8, act_symmetric=False, clip_percentile=99.0,
                 clip_gradient=True),
    "q4_0": dict(bits=4, grid="q4_0", act_bits=8),
    "q8_0": dict(bits=8, grid="q8_0", act_bits=8),
}


def qat_every_kind(model, **fields):
    """QAT with ``fields``; Conv1D and MHA (which fake-quantize their weights only) get the weight fields."""
    weight_fields = {k: v for k, v in fields.items() if k not in ("act_bits", "act_symmetric", "scale")}
    return apply_qat(model, patterns=[("proj|attn", QuantSpec(**weight_fields)), (".*", QuantSpec(**fields))])


@pytest.mark.parametrize("name", GRID_SPECS)
def test_every_grid_and_option_compiles_to_one_graph(name):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = qat_every_kind(TiedLM(), **GRID_SPECS[name])
    explained = torch._dynamo.explain(model)(torch.randint(0, 50, (2, 8)))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_q4_0_with_activations_compiles_forward_and_backward_to_eager_values():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, tokens = qat_every_kind(TiedLM(), grid="q4_0", act_bits=8), torch.randint(0, 50, (2, 8))
    eager_out, eager_grads = step(model, tokens)
    out, grads = step(torch.compile(model, fullgraph=True, backend="aot_eager"), tokens)
    assert torch.equal(out, eager_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads))
