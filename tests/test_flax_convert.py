"""Flax convert / save / load: stored codes equal numpy's, forward equals QAT, files shared with torch."""

import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("qwix")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from mixle.api import apply_qat, get_qat_report, model_nbytes, quantize_model  # noqa: E402
from mixle.api import convert as api_convert  # noqa: E402
from mixle.core.fileformat import read_manifest  # noqa: E402
from mixle.core.packing import unpack_int4  # noqa: E402
from mixle.core.spec import QuantSpec  # noqa: E402
from mixle.flax_backend.convert import QuantizedKernel, convert_linen  # noqa: E402
from mixle.flax_backend import group_view  # noqa: E402
from mixle.flax_backend.group_view import GROUP_VIEW_MAX_ROWS  # noqa: E402
from mixle.flax_backend.convert import model_nbytes as flax_model_nbytes  # noqa: E402
from mixle.api import load_quantized, save_quantized  # noqa: E402  (names= passes through to Flax)
from mixle.torch_backend import export as torch_export  # noqa: E402
from tests.test_numerics import reference_codes_scales  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

RNG = np.random.default_rng(7)
X = RNG.standard_normal((5, 48)).astype(np.float32)
SPECS = [
    QuantSpec(bits=4),
    QuantSpec(bits=8, group_size=16),
    QuantSpec(bits=4, granularity="tensor"),
    QuantSpec(bits=4, grid="qwix", clip_percentile=99.0),
    QuantSpec(bits=8, grid="qwix", group_size=8, clip_percentile=90.0),
]


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(48, 64, rngs=rngs), nnx.Linear(64, 16, rngs=rngs)])

    def __call__(self, x):
        return self.layers[1](jax.nn.relu(self.layers[0](x)))


def torch_mlp():
    return torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))


MLP_NAMES = {"layers.0": "0", "layers.1": "2"}


def _codes(value):
    """The stored codes of a QuantizedValue as the (out, in) int8 matrix (numpy unpacking)."""
    rows, cols = value.matrix_shape
    codes = value.file_codes()
    return unpack_int4(codes, (rows, cols)) if value.spec.bits == 4 else codes


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.short())
def test_convert_stores_numpys_codes_and_runs_the_qat_forward_exactly(spec):
    x = jnp.asarray(X)
    model = MLP(nnx.Rngs(0))
    apply_qat(model, spec=spec, example_inputs=(x,))
    converted = api_convert(model)
    assert type(converted) is MLP and type(model) is not MLP  # the user's class; the QAT model untouched
    for layer, qat_layer in zip(converted.layers, model.layers):
        assert isinstance(layer.kernel, QuantizedKernel)
        value = layer.kernel.get_raw_value()
        w = np.asarray(qat_layer.kernel[...]).T  # torch layout (out, in)
        codes, scale, expected = reference_codes_scales(w, spec.bits, spec.granularity, spec.group_size,
                                                        spec.clip_percentile, grid=spec.grid)
        assert int((_codes(value) == codes).sum()) == w.size  # every element on numpy's grid
        np.testing.assert_array_equal(np.asarray(value.scale_matrix()).reshape(scale.shape), scale)
        np.testing.assert_array_equal(np.asarray(layer.kernel[...]).T, expected)
    # Same dequantized kernels, same matmuls: bit for bit eagerly; under jit XLA may fuse the
    # QAT program's quantizer differently (float32 reassociation over 64 inputs).
    np.testing.assert_array_equal(converted(x), model(x))
    run = nnx.jit(lambda m: m(x))
    np.testing.assert_allclose(run(converted), run(model), rtol=0, atol=1e-6 * float(np.abs(model(x)).max()))
    # nnx.split / merge carry codes and scales as state
    graphdef, state = nnx.split(converted)
    np.testing.assert_array_equal(nnx.merge(graphdef, state)(x), converted(x))
    assert not jax.tree.leaves(nnx.state(converted, nnx.Param).filter(lambda p, v: p[-1] == "kernel"))


def test_model_nbytes_counts_packed_int4_codes_scales_and_floats():
    x = jnp.asarray(X)
    model = MLP(nnx.Rngs(0))
    float_bytes = model_nbytes(model)
    assert float_bytes.float_bytes == 4 * (48 * 64 + 64 + 64 * 16 + 16) and float_bytes.int4_code_bytes == 0
    converted = api_convert(apply_qat(model, bits=4, group_size=16, example_inputs=(x,)))
    nbytes = model_nbytes(converted)
    assert nbytes.int4_code_bytes == (48 * 64 + 64 * 16) // 2
    assert nbytes.scale_bytes == 4 * (64 * 3 + 16 * 4)  # one fp32 scale per 16 inputs of each output
    assert nbytes.float_bytes == 4 * (64 + 16)  # the biases
    assert model_nbytes(quantize_model(MLP(nnx.Rngs(0)), bits=8, example_inputs=(x,))).int8_code_bytes == 48 * 64 + 64 * 16


def test_quantize_model_is_convert_of_apply_qat_and_leaves_the_model_alone():
    x = jnp.asarray(X)
    model = MLP(nnx.Rngs(0))
    before = np.asarray(model(x))
    ptq = quantize_model(model, bits=4, example_inputs=(x,))
    np.testing.assert_array_equal(model(x), before)
    assert type(model) is MLP and isinstance(model.layers[0].kernel, nnx.Param)
    qat = apply_qat(MLP(nnx.Rngs(0)), bits=4, example_inputs=(x,))
    np.testing.assert_array_equal(ptq(x), qat(x))


def test_convert_refuses_qwix_only_forwards_naming_the_kernel():
    model = MLP(nnx.Rngs(0))
    apply_qat(model, bits=8, grid="qwix", act_bits=8, example_inputs=(jnp.asarray(X),))
    with pytest.raises(ValueError, match=r"kernel 'layers.0.kernel' trains as .*act_bits=8"):
        api_convert(model)
    with pytest.raises(ValueError, match="no QAT set up"):
        api_convert(MLP(nnx.Rngs(0)))


def _token_codes(a):
    """numpy: per-token int8 codes and scales (absmax / 127) of a (tokens, K) array."""
    absmax = np.abs(a).max(axis=-1, keepdims=True)
    return np.round(a * (np.float32(127) / absmax)), absmax / np.float32(127)


@pytest.mark.parametrize("spec", [QuantSpec(bits=8, act_bits=8), QuantSpec(bits=4, act_bits=8),
                                  QuantSpec(bits=8, group_size=16, act_bits=8, bwd_bits=8)])
def test_convert_multiplies_the_inputs_codes_by_the_stored_codes_with_act_bits(spec, tmp_path):
    x = jnp.asarray(X.reshape(1, 5, 48))
    model = MLP(nnx.Rngs(0))
    w = np.asarray(model.layers[0].kernel[...]).T  # (out, in) float32 master
    bias = np.asarray(model.layers[0].bias[...])
    apply_qat(model, spec=spec, example_inputs=(x,))
    converted = api_convert(model)
    jitted = nnx.jit(lambda m, a: m(a))
    # the same float operations on the same integers: equal, eagerly and compiled
    np.testing.assert_array_equal(converted(x), model(x))
    np.testing.assert_array_equal(jitted(converted, x), jitted(model, x))
    codes, scale, _ = reference_codes_scales(w, spec.bits, spec.granularity, spec.group_size)
    qx, sx = _token_codes(X)
    if spec.granularity == "group":  # one exact integer sum per group, scaled, then summed
        want = sum((qx[:, k:k + 16] @ codes[:, k:k + 16].T) * scale.reshape(64, 3)[:, k // 16] for k in (0, 16, 32))
    else:
        want = (qx @ codes.T) * scale.reshape(1, -1)
    # each float32 scaling of an exact integer sum rounds once (a group's three products: a sum of three)
    np.testing.assert_allclose(np.asarray(converted.layers[0](x)).reshape(5, 64), want * sx + bias,
                               rtol=8 * np.finfo(np.float32).eps, atol=8 * np.finfo(np.float32).eps)
    graphdef, state = nnx.split(converted)
    program = jax.jit(lambda s, a: nnx.merge(graphdef, s)(a)).lower(state, x).as_text()
    products = [line for line in program.splitlines() if "dot_general" in line]
    assert len(products) == 2 and all(line.count("xi8>") == 2 for line in products), products
    path = str(tmp_path / "w8a8.safetensors")
    save_quantized(converted, path)
    loaded = load_quantized(path, MLP(nnx.Rngs(5)))
    np.testing.assert_array_equal(jitted(loaded, x), jitted(converted, x))


def test_act_bits_layers_convert_only_as_integer_products(tmp_path):
    class Scaled(nnx.Linear):
        def __call__(self, x):
            return 2 * super().__call__(x)

    x = jnp.asarray(X)
    model = nnx.Sequential(Scaled(48, 16, rngs=nnx.Rngs(0)))
    apply_qat(model, bits=8, act_bits=8, example_inputs=(x,))
    before = np.asarray(model(x))
    with pytest.raises(ValueError, match=r"kernel 'layers.0.kernel' is .*a8.* only in an nnx.Linear with its own "
                                         r"__call__.*this is a Scaled"):
        api_convert(model)
    np.testing.assert_array_equal(model(x), before)
    dense = nn.Dense(16)
    variables = dense.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"convert_linen: kernel 'kernel' trains with act_bits=8 on integer"):
        convert_linen(apply_qat(dense, bits=8, act_bits=8, example_inputs=(x,)), variables)
    net = quantize_model(torch.nn.Sequential(torch.nn.Linear(64, 16)), bits=4, grid="q4_0", act_bits=8)
    torch_export.save_quantized(net, str(tmp_path / "q4_0_a8.safetensors"))
    with pytest.raises(ValueError, match=r"kernel 'layers.0.kernel' is stored as .*q4_0.* whose activation rounding"):
        load_quantized(str(tmp_path / "q4_0_a8.safetensors"), nnx.Sequential(nnx.Linear(64, 16, rngs=nnx.Rngs(0))),
                       names={"layers.0": "0"})


def test_linen_convert_runs_the_qat_forward_on_stored_codes():
    class Dense2(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16, name="fc2")(nn.relu(nn.Dense(32, name="fc1")(x)))

    x = jnp.asarray(X)
    variables = Dense2().init(jax.random.key(0), x)
    qat = apply_qat(Dense2(), bits=4, group_size=8, clip_percentile=95.0, example_inputs=(x,))
    plain, quantized = convert_linen(qat, variables)
    np.testing.assert_array_equal(plain.apply(quantized, x), qat.apply(variables, x))
    assert flax_model_nbytes(plain, quantized).int4_code_bytes == (48 * 32 + 32 * 16) // 2
    assert type(variables["params"]["fc1"]["kernel"]) is not type(quantized["params"]["fc1"]["kernel"])


# ------------------------------------------------------------------------------- files shared with torch


def test_mlp_file_from_flax_loads_into_torch_and_back(tmp_path):
    x = jnp.asarray(X)
    model = MLP(nnx.Rngs(0))
    converted = api_convert(apply_qat(model, bits=4, group_size=16, example_inputs=(x,)))
    path = tmp_path / "flax.safetensors"
    manifest = save_quantized(converted, path, names=MLP_NAMES)
    assert [(e["path"], e["kind"], e["weight_shape"]) for e in manifest["layers"]] == \
        [("0", "linear", [64, 48]), ("2", "linear", [16, 64])]
    net = load_quantized(path, torch_mlp())
    # The same dequantized weights bit for bit (torch layout); logits up to summation order.
    for index, layer in ((0, converted.layers[0]), (2, converted.layers[1])):
        np.testing.assert_array_equal(net[index].dequantized_weight().numpy(), np.asarray(layer.kernel[...]).T)
    logits = net(torch.from_numpy(X)).detach().numpy()
    np.testing.assert_allclose(logits, converted(x), rtol=0, atol=1e-6 * np.abs(logits).max())  # fp32 sums of 64
    # torch saves it again: the same tensors; and it loads back into Flax
    again = tmp_path / "torch.safetensors"
    save_quantized(net, again)
    assert read_manifest(again)["tensors"] == manifest["tensors"]
    back = load_quantized(again, MLP(nnx.Rngs(9)), names=MLP_NAMES)
    np.testing.assert_array_equal(back(x), converted(x))


def test_mlp_file_from_torch_loads_into_flax(tmp_path):
    torch.manual_seed(0)
    qat = apply_qat(torch_mlp(), bits=4, clip_percentile=99.0)
    converted = api_convert(qat)
    path = tmp_path / "torch.safetensors"
    torch_export.save_quantized(converted, path)
    model = load_quantized(path, MLP(nnx.Rngs(3)), names=MLP_NAMES)
    np.testing.assert_array_equal(np.asarray(model.layers[0].kernel[...]).T, converted[0].dequantized_weight().numpy())
    logits = converted(torch.from_numpy(X)).detach().numpy()
    np.testing.assert_allclose(model(jnp.asarray(X)), logits, rtol=0, atol=1e-6 * np.abs(logits).max())
    with pytest.raises(ValueError, match="no tensor 'layers.0.bias'"):
        load_quantized(path, MLP(nnx.Rngs(3)))  # without the names, nothing lines up


def test_names_are_refused_for_torch_models_whose_paths_are_the_files_names(tmp_path):
    converted = api_convert(apply_qat(torch_mlp(), bits=4))
    path = tmp_path / "torch.safetensors"
    with pytest.raises(TypeError, match=r"save_quantized\(names=...\) maps Flax module paths.*drop names="):
        save_quantized(converted, path, names=MLP_NAMES)
    assert not path.exists()
    save_quantized(converted, path)
    with pytest.raises(TypeError, match=r"load_quantized\(names=...\).*drop names="):
        load_quantized(path, torch_mlp(), names=MLP_NAMES)


V, D = 40, 16


class TiedLM(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Embed(V, D, rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.fc = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, ids):
        return self.emb.attend(self.fc(jax.nn.relu(self.norm(self.emb(ids)))))


class TorchTiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.norm = torch.nn.LayerNorm(D, eps=1e-6)  # flax's default epsilon
        self.fc = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.fc(torch.relu(self.norm(self.emb(ids)))))


LM_NAMES = {"emb": ("emb", "head")}
IDS = RNG.integers(0, V, (3, 7))


def test_tied_lm_file_from_flax_loads_into_torch_with_one_shared_table(tmp_path):
    ids = jnp.asarray(IDS)
    model = TiedLM(nnx.Rngs(0))
    apply_qat(model, bits=4, example_inputs=(ids,))
    converted = api_convert(model)
    np.testing.assert_array_equal(converted(ids), model(ids))
    path = tmp_path / "lm.safetensors"
    manifest = save_quantized(converted, path, names=LM_NAMES)
    assert manifest["aliases"] == {"head.codes": "emb.codes", "head.scale": "emb.scale"}
    assert manifest["nbytes"]["int4_code_bytes"] == (V * D + D * D) // 2  # the table stored once
    net = torch_export.load_quantized(path, TorchTiedLM())
    assert net.head.codes is net.emb.codes
    logits = net(torch.from_numpy(IDS)).detach().numpy()
    np.testing.assert_allclose(logits, converted(ids), rtol=0, atol=2e-6 * np.abs(logits).max())  # fp32 norm + sums of 16
    with pytest.raises(ValueError, match=r"name both torch modules"):
        save_quantized(converted, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_tied_lm_file_from_torch_loads_into_flax(tmp_path):
    torch.manual_seed(0)
    converted = api_convert(apply_qat(TorchTiedLM(), bits=8, group_size=8))
    path = tmp_path / "lm.safetensors"
    torch_export.save_quantized(converted, path)
    model = load_quantized(path, TiedLM(nnx.Rngs(1)), names=LM_NAMES)
    np.testing.assert_array_equal(np.asarray(model.emb.embedding[...]), converted.emb.dequantized_weight().numpy())
    logits = converted(torch.from_numpy(IDS)).detach().numpy()
    np.testing.assert_allclose(model(jnp.asarray(IDS)), logits, rtol=0, atol=2e-6 * np.abs(logits).max())


def test_a_tampered_or_misfitting_file_is_refused_and_nothing_is_changed(tmp_path):
    x = jnp.asarray(X)
    converted = quantize_model(MLP(nnx.Rngs(0)), bits=4, example_inputs=(x,))
    path = tmp_path / "m.safetensors"
    save_quantized(converted, path, names=MLP_NAMES)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    target = MLP(nnx.Rngs(2))
    before = np.asarray(target(x))
    with pytest.raises(ValueError, match="sha256"):
        load_quantized(bad, target, names=MLP_NAMES)

    class Wider(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(48, 32, rngs=rngs), nnx.Linear(32, 16, rngs=rngs)])

    with pytest.raises(ValueError, match=r"layer '0'.*\[64, 48\] weight"):
        load_quantized(path, Wider(nnx.Rngs(0)), names=MLP_NAMES)
    np.testing.assert_array_equal(target(x), before)
    assert sorted(os.listdir(tmp_path)) == ["bad.safetensors", "m.safetensors"]


def test_save_refuses_kernels_without_a_torch_layer_naming_them(tmp_path):
    class Conv(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)

        def __call__(self, x):
            return self.conv(x)

    x = jnp.ones((1, 6, 6, 3))
    converted = quantize_model(Conv(nnx.Rngs(0)), bits=4, example_inputs=(x,))
    np.testing.assert_array_equal(converted(x), apply_qat(Conv(nnx.Rngs(0)), bits=4, example_inputs=(x,))(x))
    with pytest.raises(ValueError, match=r"kernel 'conv.kernel' of a Conv .*keep this layer in float"):
        save_quantized(converted, tmp_path / "c.safetensors")


# ------------------------------------------------------------------------------- one grid


def _agreement(got_codes, want_codes):
    return int((np.asarray(got_codes) == np.asarray(want_codes)).sum())


def test_qwix_grid_codes_agree_with_numpy_and_torch_for_every_element_of_a_64x48_linear():
    from mixle.core.layer_weights import quantize_linear_weight

    w = RNG.standard_normal((64, 48)).astype(np.float32)  # torch layout (out, in)
    spec = QuantSpec(bits=4, grid="qwix")
    layer = nnx.Linear(48, 64, use_bias=False, rngs=nnx.Rngs(0))
    layer.kernel[...] = jnp.asarray(w.T)
    eye = jnp.eye(48)
    apply_qat(layer, spec=spec, example_inputs=(eye,))
    numpy_q = quantize_linear_weight(w, spec)
    torch_q = quantize_linear_weight(torch.from_numpy(w), spec)
    qat_codes = np.rint(np.asarray(layer(eye)).T.reshape(1, 64, 48) / numpy_q.scale).reshape(64, 48)
    stored = _codes(api_convert(layer).kernel.get_raw_value())
    ties = int(np.isclose(np.abs(w) / numpy_q.scale.reshape(64, 1), 7.5).sum())
    assert ties > 0  # the elements on which Qwix's own scale could land one step off
    for got in (qat_codes, stored, torch_q.codes.numpy()):
        assert _agreement(got, numpy_q.codes) == 64 * 48


class MiniGPT(nnx.Module):
    """Embed + causal self-attention + MLP + tied head, as in the Flax MiniGPT example (small)."""

    def __init__(self, rngs, vocab=50, dim=32, heads=4):
        self.emb = nnx.Embed(vocab, dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False, rngs=rngs)
        self.norm1, self.norm2 = nnx.LayerNorm(dim, rngs=rngs), nnx.LayerNorm(dim, rngs=rngs)
        self.up, self.down = nnx.Linear(dim, 4 * dim, rngs=rngs), nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, ids):
        h = self.emb(ids)
        h = h + self.attn(self.norm1(h), mask=nnx.make_causal_mask(ids))
        h = h + self.down(jax.nn.gelu(self.up(self.norm2(h))))
        return self.emb.attend(h)


def test_qwix_grid_codes_agree_with_numpy_for_every_element_of_a_minigpt():
    from mixle.core.layer_weights import quantize_linear_weight

    ids = jnp.asarray(RNG.integers(0, 50, (2, 6)))
    model = MiniGPT(nnx.Rngs(0))
    spec = QuantSpec(bits=4, grid="qwix")
    apply_qat(model, spec=spec, example_inputs=(ids,))
    converted = api_convert(model)
    np.testing.assert_array_equal(converted(ids), model(ids))
    k = lambda m, name: np.asarray(getattr(m, name)[...])  # noqa: E731
    # Each kernel as torch's (out, in), written out by hand for this model's layers.
    matrices = {
        "emb.embedding": k(model.emb, "embedding"),
        **{f"attn.{p}.kernel": k(getattr(model.attn, p), "kernel").reshape(32, -1).T for p in ("query", "key", "value")},
        "attn.out.kernel": k(model.attn.out, "kernel").reshape(-1, 32).T,
        "up.kernel": k(model.up, "kernel").T,
        "down.kernel": k(model.down, "kernel").T,
    }
    modules = {".".join(map(str, p)): m for p, m in nnx.iter_modules(converted)}
    total = agree = channels = 0
    for path, matrix in matrices.items():
        owner, _, name = path.rpartition(".")
        value = vars(modules[owner])[name].get_raw_value()
        want = quantize_linear_weight(matrix, spec).codes
        total, agree, channels = total + matrix.size, agree + _agreement(_codes(value), want), channels + matrix.shape[0]
    assert sorted(get_qat_report(model).wrapped) == sorted(matrices)
    assert agree == total == 50 * 32 + 4 * 32 * 32 + 2 * 32 * 128
    assert channels == 50 + 4 * 32 + 128 + 32


@pytest.mark.parametrize("group_size,codes_shape,scale_shape", [(16, (3, 16, 64), (3, 1, 64)), (None, (64, 48), (1, 64, 1))])
def test_int4_codes_are_stored_as_native_int4_groups_in_the_kernels_layout(group_size, codes_shape, scale_shape):
    # The program reads 4-bit codes, unpacked by XLA: no bytes unpacked by hand. Group-wise codes
    # keep the kernel's own (in / 16, 16, out) layout, the scales broadcast along the groups (in
    # the (out, in) matrix the groups would lie along a TPU's lane axis); per-channel codes are
    # the (out, in) matrix. Files keep pairs.
    import re

    x = jnp.asarray(X)
    model = MLP(nnx.Rngs(0))
    spec = QuantSpec(bits=4, group_size=group_size)
    apply_qat(model, spec=spec, example_inputs=(x,))
    converted = api_convert(model)
    graphdef, state = nnx.split(converted)
    text = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, x).as_text()
    assert re.search(r"tensor<%sxi4>" % "x".join(map(str, codes_shape)), text) and "ui8" not in text
    value = converted.layers[0].kernel.get_raw_value()
    assert (value.codes.dtype, value.codes.shape, value.scale.shape) == (jnp.int4, codes_shape, scale_shape)
    kernel = np.asarray(model.layers[0].kernel[...])
    codes, scale, _ = reference_codes_scales(np.ascontiguousarray(kernel.T), 4, spec.granularity, group_size)
    np.testing.assert_array_equal(unpack_int4(value.file_codes(), (64, 48)), codes)
    np.testing.assert_array_equal(np.asarray(value.scale_matrix()).reshape(scale.shape), scale)


@pytest.mark.parametrize("spec", [QuantSpec(bits=8), QuantSpec(bits=4), QuantSpec(bits=4, group_size=16)])
def test_off_the_cpu_the_dequantized_kernel_fuses_into_its_product(monkeypatch, spec):
    # A barrier kept the dequantized float32 kernel as its own value on every backend: a TPU then
    # wrote and read it back at every call (the 470M model's 16 x 1 serving: 32 kernel-sized
    # float values in the program; none for int4 per channel without it). The CPU keeps it.
    import mixle.flax_backend.fake_quant as fake_quant
    from mixle.flax_backend.convert import quantize_kernel

    kernel = (np.random.default_rng(3).standard_normal((48, 40)) * 0.05).astype(np.float32)
    value = quantize_kernel(jnp.asarray(kernel), (0,), spec)

    def barriers():
        return jax.jit(lambda v: v.dequantize()).lower(value).as_text().count("optimization_barrier")

    monkeypatch.setattr(fake_quant.jax, "default_backend", lambda: "cpu")  # the test also runs on a TPU
    on_cpu = barriers()
    monkeypatch.setattr(fake_quant.jax, "default_backend", lambda: "tpu")
    assert (on_cpu, barriers()) == (1, 0)
    want = reference_codes_scales(np.ascontiguousarray(kernel.T), spec.bits, spec.granularity, spec.group_size)[2].T
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: v.dequantize())(value)), want)


class Wide(nnx.Module):
    """Two quantized Linears with 256 inputs (groups of 128 contract their view off the CPU) around a
    float one."""

    def __init__(self, rngs):
        self.a = nnx.Linear(256, 64, rngs=rngs)
        self.b = nnx.Linear(64, 256, use_bias=False, rngs=rngs)
        self.c = nnx.Linear(256, 8, rngs=rngs)

    def __call__(self, x):
        return self.c(self.b(jax.nn.relu(self.a(x))))


@pytest.mark.parametrize("group_size,wide,viewed", [(128, None, 2), (32, None, 0), (32, 64, 1)])
def test_groups_of_128_contract_their_view_off_the_cpu_in_qat_and_converted_forwards(monkeypatch, group_size,
                                                                                     wide, viewed):
    # The TPU's program traced on this CPU: a product that contracts a group view of 128 lets XLA fuse
    # the dequantizing into it (a TPU v5e, 470M model, 16 tokens: 0.395x of float instead of 0.569x);
    # groups of 32 only in a kernel with GROUP_VIEW_WIDE_OUTPUTS outputs (a vocabulary's head; here
    # lowered to 64: layer a, not c). The QAT forward and the converted model run the same product,
    # so they stay equal.
    if wide is not None:
        monkeypatch.setattr(group_view, "GROUP_VIEW_WIDE_OUTPUTS", wide)
    # each product's rounding: none on the CPU; a TPU's default precision multiplies bfloat16 operands
    product = 0.0 if jax.default_backend() == "cpu" else 2.0**-8
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 3, 256)).astype(np.float32))
    model = Wide(nnx.Rngs(0))
    apply_qat(model, bits=4, group_size=group_size, exclude=("b",), example_inputs=(x,))
    converted = api_convert(model)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    # more rows than GROUP_VIEW_MAX_ROWS (prefill, training): the reshaped kernel's product, in both
    long = jnp.asarray(np.random.default_rng(6).standard_normal((2, GROUP_VIEW_MAX_ROWS // 2 + 1, 256)), jnp.float32)
    for inputs, want_viewed in ((long, 0), (x, viewed)):
        programs, outputs = [], []
        for net in (model, converted):
            graphdef, state = nnx.split(net)
            forward = jax.jit(lambda s, a, g=graphdef: nnx.merge(g, s)(a))
            programs.append(forward.lower(state, inputs).as_text())
            outputs.append(np.asarray(forward(state, inputs)))
        np.testing.assert_array_equal(outputs[0], outputs[1])
        assert [p.count("contracting_dims = [2, 3] x [0, 1]") for p in programs] == [want_viewed, want_viewed]
    monkeypatch.undo()
    # against float64 numpy on the stored kernels: the order of 256 float32 sums apart
    # (|relu(u) - relu(v)| <= |u - v|: a layer's bound carries through the ReLU)
    h = np.asarray(x, np.float64).reshape(6, 256)
    bound = np.zeros_like(h)
    for name in ("a", "b", "c"):
        layer = getattr(converted, name)
        w = np.asarray(layer.kernel[...], np.float64)
        bias = 0.0 if layer.bias is None else np.asarray(layer.bias[...], np.float64)
        error = product + (w.shape[0] + 1) * np.finfo(np.float32).eps  # and the float32 sums
        bound = (np.abs(h) @ np.abs(w) + np.abs(bias)) * error + bound @ np.abs(w)
        h = h @ w + bias
        h = np.maximum(h, 0) if name == "a" else h
    np.testing.assert_array_less(np.abs(outputs[1].reshape(6, 8) - h), bound)
