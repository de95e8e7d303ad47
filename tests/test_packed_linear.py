"""Converted layers' products straight from packed codes: numpy reference, dispatch, fallback, compile."""

import copy
import os
import platform
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixle.core.spec import QuantSpec
from mixle.torch_backend.kernels import fused_cpu
from mixle.torch_backend.kernels import packed_linear
from mixle.torch_backend.layers.quantized import QuantizedLinear

EPS32 = float(np.finfo(np.float32).eps)
# (out, in, group of the "group" granularity). in=7: int4 rows start mid-byte; group 7 or 16: blocks
# that are not whole vector steps (the buffer path); in=130: tails after the last whole step.
# (6, 1088, 64): panels of 512 inputs and a short one (partial sums carried between them).
SHAPES = [(5, 7, 7), (13, 64, 16), (9, 96, 32), (3, 130, 65), (33, 256, 64), (6, 1088, 64)]
# 9: eight rows at once plus one; 17: 4 x 4 blocks plus a row; 70: panels of 64 (AVX2: 32) rows of x
# and a short one.
BATCHES = [1, 3, 9, 17, 70]


def make_storage(bits, granularity, out_features, in_features, group, seed=0):
    """Random codes over the whole qwix grid, packed by hand, and scales of very different sizes."""
    rng = np.random.default_rng(seed)
    low, high = (-8, 7) if bits == 4 else (-128, 127)
    codes = rng.integers(low, high + 1, (out_features, in_features)).astype(np.int8)
    blocks = {"tensor": 1, "channel": out_features, "group": out_features * in_features // group}[granularity]
    scale = (rng.uniform(0.5, 2.0, blocks) * 10.0 ** rng.integers(-3, 1, blocks)).astype(np.float32)
    if bits == 4:
        nibbles = (codes.reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
        nibbles = np.concatenate([nibbles, np.zeros(nibbles.size % 2, np.uint8)])
        stored = torch.from_numpy(nibbles[0::2] | (nibbles[1::2] << 4))
    else:
        stored = torch.from_numpy(codes)
    spec = QuantSpec(bits=bits, grid="qwix", granularity=granularity,
                     group_size=group if granularity == "group" else None)
    return codes, scale, spec, stored, torch.from_numpy(scale.reshape(1, -1, 1))


def reference(x, codes, scale, bias):
    """float64 products of float32 weights code * scale (numpy), and the bound on a float32 sum of them."""
    w = (codes.astype(np.float32).reshape(scale.size, -1) * scale[:, None]).reshape(codes.shape)
    products = x.astype(np.float64)[:, None, :] * w.astype(np.float64)[None]
    magnitude = np.abs(products).sum(-1)
    y = products.sum(-1)
    if bias is not None:
        y, magnitude = y + bias, magnitude + np.abs(bias)
    # Any order of K float32 products and sums (fused or not), plus the bias and the final
    # rounding, is within (K + 2) * eps of the sum of their magnitudes.
    return y, (codes.shape[1] + 2) * EPS32 * magnitude


def _build_variant(extra_flags):
    try:
        return packed_linear._load(os.environ.get("CXX", "c++"), fused_cpu.FLAGS + extra_flags)
    except (RuntimeError, OSError) as error:
        pytest.skip(f"could not build the kernel with {extra_flags}: {error}")


@pytest.fixture(scope="module", params=["native", "avx2", "scalar"])
def library(request):
    """The kernel as built for this CPU, and its AVX2 and portable builds where this CPU can run them."""
    native = packed_linear._library()
    if native is None:
        pytest.skip("no C++ compiler: the packed kernel could not be built")
    if request.param == "native":
        return native
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX2 and scalar builds are x86 variants")
    if request.param == "avx2":
        if native.isa not in ("avx2", "avx512"):
            pytest.skip("this CPU has no AVX2")
        built = _build_variant(("-mno-avx512f",))
    else:
        built = _build_variant(("-mno-avx512f", "-mno-avx2", "-mno-fma"))
    assert built.isa == request.param
    return built


def use_panels(monkeypatch, panels):
    """Every batch through the decoded-panel GEMM, or none."""
    for name in ("PANEL_BATCH", "PANEL_BATCH_SHORT"):
        monkeypatch.setattr(packed_linear, name, 1 if panels else 10 ** 9)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("granularity", ["tensor", "channel", "group"])
@pytest.mark.parametrize("bits", [4, 8])
def test_products_match_a_float64_numpy_reference(library, bits, granularity, shape, monkeypatch):
    out_features, in_features, group = shape
    codes, scale, spec, stored, scale_t = make_storage(bits, granularity, out_features, in_features, group)
    rng = np.random.default_rng(1)
    bias = rng.standard_normal(out_features).astype(np.float32)
    monkeypatch.setattr(packed_linear, "PARALLEL_WEIGHTS", 0)  # threads even for these small weights
    # Two threads on the largest shape of the native build only (the threading code is the same in
    # every build): on a busy machine each parallel region costs milliseconds.
    thread_counts = (1, 2) if shape == SHAPES[-2] and library is packed_linear._library() else (1,)
    threads = torch.get_num_threads()
    try:
        for with_bias in (False, True):
            layer = QuantizedLinear(stored, scale_t, spec, (out_features, in_features),
                                    bias=torch.from_numpy(bias) if with_bias else None)
            group_arg, per_row = packed_linear.block_layout(layer)
            for batch in BATCHES:
                x = rng.standard_normal((batch, in_features)).astype(np.float32)
                expected, bound = reference(x, codes, scale, bias if with_bias else None)
                for n, panels in [(n, panels) for n in thread_counts for panels in (False, True)]:
                    torch.set_num_threads(n)
                    use_panels(monkeypatch, panels)
                    got = packed_linear._products(library, torch.from_numpy(x), layer.codes, layer.scale, layer.bias,
                                                  bits, out_features, group_arg, per_row).numpy()
                    error = np.abs(got.astype(np.float64) - expected)
                    assert (error <= bound).all(), (batch, n, panels, with_bias, float((error - bound).max()))
        # One-hot rows of x pick single weights: a sum of one product and zeros is exact, so the
        # kernel's weights must equal float32(code) * scale bit for bit.
        w = (codes.astype(np.float32).reshape(scale.size, -1) * scale[:, None]).reshape(codes.shape)
        for panels in (False, True):
            use_panels(monkeypatch, panels)
            picked = packed_linear._products(library, torch.eye(in_features), layer.codes, layer.scale, None,
                                             bits, out_features, group_arg, per_row)
            np.testing.assert_array_equal(picked.numpy(), w.T)
    finally:
        torch.set_num_threads(threads)


def quantized_mlp(bits=4, group_size=None, seed=0):
    torch.manual_seed(seed)
    from mixle.task.quantize import quantize_model

    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))
    return quantize_model(model, bits=bits, group_size=group_size).eval()


def exact(layer, x):
    return F.linear(x, layer.dequantized_weight(), layer.bias)


def test_float32_cpu_inputs_take_the_kernel_and_everything_else_the_exact_path(monkeypatch):
    if not packed_linear.available():
        pytest.skip("no C++ compiler: the packed kernel could not be built")
    layer = quantized_mlp(group_size=32)[0]
    x = torch.randn(2, 5, 64)  # leading dims are kept
    ran = []  # the kernel's calls, counted: whether its sums happen to match F.linear's proves nothing
    kernel = packed_linear._products
    monkeypatch.setattr(packed_linear, "_products", lambda *args: ran.append(args[1].shape) or kernel(*args))
    with torch.no_grad():
        assert packed_linear.applies(x, layer)
        got = layer(x)
        assert ran == [(2, 5, 64)]  # the layer ran the kernel, once
        assert got.shape == (2, 5, 96) and torch.equal(got, packed_linear.linear(x, layer))
        magnitude = x.abs() @ layer.dequantized_weight().abs().t() + layer.bias.abs()
        # any order of K = 64 float32 products and sums, plus the bias: within (K + 2) eps of the magnitudes
        assert ((got - exact(layer, x)).abs() <= 66 * EPS32 * magnitude).all()
        ran.clear()
        with packed_linear.switched_off():
            assert torch.equal(layer(x), exact(layer, x)) and ran == []
        layer64, x64 = copy.deepcopy(layer).double(), x.double()
        assert not packed_linear.applies(x64, layer64)
        assert torch.equal(layer64(x64), exact(layer64, x64))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not packed_linear.applies(x, layer)
            assert layer(x).dtype == torch.bfloat16
    needs_grad = x.clone().requires_grad_()
    assert not packed_linear.applies(needs_grad, layer)
    layer(needs_grad).sum().backward()  # the exact path carries the gradient
    torch.testing.assert_close(needs_grad.grad, layer.dequantized_weight().sum(0).expand(2, 5, 64))


def test_without_a_compiler_warns_once_and_runs_the_exact_path(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("MIXLE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(packed_linear, "_loaded", {})
    layer, x = quantized_mlp()[0], torch.randn(3, 64)
    with pytest.warns(RuntimeWarning, match="could not build its packed int4/int8 CPU kernel") as caught:
        with torch.no_grad():
            got = layer(x)
    assert len([w for w in caught if "packed" in str(w.message)]) == 1
    assert torch.equal(got, exact(layer, x)) and not packed_linear.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        layer(x)
    assert not list(tmp_path.glob("*.so"))


def test_switched_off_by_the_fused_kernels_environment_switch(monkeypatch):
    monkeypatch.setenv(fused_cpu.SWITCH, "0")
    monkeypatch.setattr(packed_linear, "_loaded", {})
    layer, x = quantized_mlp(bits=8)[0], torch.randn(3, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # off on purpose: no warning
        with torch.no_grad():
            assert torch.equal(layer(x), exact(layer, x))


def test_torch_compile_keeps_the_op_in_one_graph_and_matches_eager():
    if not packed_linear.available():
        pytest.skip("no C++ compiler: the packed kernel could not be built")
    torch._dynamo.reset()
    model, x = quantized_mlp(group_size=32), torch.randn(4, 64)
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    try:
        with torch.no_grad():
            eager = model(x)
            recorded = torch.compile(model, backend=recording_backend, fullgraph=True)(x)
            torch._dynamo.reset()
            # aot_eager also runs the op's fake implementation (AOT tracing) without inductor's
            # code generation (slow to start): the same kernel calls, so the same numbers.
            aot = torch.compile(model, backend="aot_eager", fullgraph=True)(torch.randn(2, 3, 64))
            assert aot.shape == (2, 3, 32)
            aot = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert sum(target.startswith("mixle.packed_linear") for target in targets) == 2, targets
    assert torch.equal(recorded, eager) and torch.equal(aot, eager)


# ------------------------------------------------------------------------- embedding lookups

EMBEDDING_CASES = [  # (bits, granularity, grid, vocab, dim, group)
    (4, "channel", "qwix", 11, 33, None),  # odd dim: rows start mid-byte
    (4, "channel", "qwix", 12, 64, None),
    (4, "group", "qwix", 9, 96, 32),
    (4, "tensor", "qwix", 7, 21, None),
    (8, "channel", "qwix", 10, 33, None),
    (8, "group", "qwix", 6, 64, 16),
    (4, "group", "q4_0", 9, 64, 32),
    (8, "group", "q8_0", 9, 64, 32),
]


def embedding_storage(bits, granularity, grid, vocab, dim, group):
    """(numpy codes, numpy scales, QuantizedEmbedding): random qwix storage, or llama.cpp grids' own."""
    from mixle.core.layer_weights import quantize_embedding_weight
    from mixle.torch_backend.layers.quantized import QuantizedEmbedding, to_storage

    if grid == "qwix":
        codes, scale, spec, stored, scale_t = make_storage(bits, granularity, vocab, dim, group or dim, seed=vocab)
        return codes, scale, QuantizedEmbedding(stored, scale_t, spec, (vocab, dim))
    spec = QuantSpec(bits=bits, grid=grid)
    stored, scale_t, _ = to_storage(quantize_embedding_weight(torch.randn(vocab, dim, generator=torch.Generator().manual_seed(3)), spec))
    if bits == 4:  # unpacked by hand: low nibble first, two's complement
        raw = stored.numpy()
        nibbles = np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(-1)[:vocab * dim]
        codes = ((nibbles.astype(np.int16) ^ 8) - 8).astype(np.int8).reshape(vocab, dim)
    else:
        codes = stored.numpy()
    scale = scale_t.numpy().reshape(-1)
    assert grid == "q8_0" or (scale < 0).any()  # q4_0's signed-max scales: the sign must survive the lookup
    return codes, scale, QuantizedEmbedding(stored, scale_t, spec, (vocab, dim))


@pytest.mark.parametrize("case", EMBEDDING_CASES, ids=lambda c: f"int{c[0]}-{c[1]}-{c[2]}-{c[3]}x{c[4]}")
def test_embedding_lookups_dequantize_only_their_rows_bit_for_bit(case, monkeypatch):
    codes, scale, table = embedding_storage(*case)
    vocab, dim = codes.shape
    table_np = (codes.astype(np.float32).reshape(scale.size, -1) * scale[:, None]).reshape(vocab, dim)
    # A lookup must not rebuild the whole table.
    monkeypatch.setattr(type(table), "dequantized_weight", lambda self: pytest.fail("whole table dequantized"))
    rng = np.random.default_rng(0)
    for indices in (rng.integers(0, vocab, (3, 5)), np.array([vocab - 1, 0, vocab - 1]), np.zeros((2, 0), np.int64)):
        for dtype in (torch.int64, torch.int32):
            got = table(torch.from_numpy(indices).to(dtype)).numpy()
            assert got.shape == (*indices.shape, dim)
            # Bit for bit: one float32 product code * scale per value, -0.0 included.
            np.testing.assert_array_equal(got.view(np.int32), table_np[indices].view(np.int32))
    for bad, span in ((-1, r"\[-1, 0\]"), (vocab, rf"\[0, {vocab}\]")):
        with pytest.raises(IndexError, match=rf"indices span {span}, outside the table's \[0, {vocab - 1}\]"):
            table(torch.tensor([0, bad]))


def test_embedding_max_norm_and_torch_compile_match_the_whole_table_lookup():
    from mixle.torch_backend.layers.quantized import QuantizedEmbedding

    codes, scale, table = embedding_storage(4, "group", "qwix", 9, 96, 32)
    x = torch.tensor([[3, 1, 3], [8, 0, 1]])
    whole = table.dequantized_weight()
    renormed = QuantizedEmbedding(table.codes, table.scale, table.spec, (9, 96), max_norm=1.0)
    assert torch.equal(renormed(x), F.embedding(x, whole.clone(), max_norm=1.0))
    assert torch.equal(table.dequantized_weight(), whole)  # the stored table is left alone
    torch._dynamo.reset()
    try:
        for case in (EMBEDDING_CASES[0], EMBEDDING_CASES[2]):  # an odd and an even int4 row width
            table = embedding_storage(*case)[2]
            compiled = torch.compile(table, backend="aot_eager", fullgraph=True)
            assert torch.equal(compiled(x), table.dequantized_weight()[x])
    finally:
        torch._dynamo.reset()
