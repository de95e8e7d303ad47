"""QAT with an importance matrix: ``apply_qat(..., importance=)`` fake-quantizes each covered linear
layer by ggml's importance-weighted search (``quantize_array(..., importance=)`` in numpy, bit for
bit), with the fused kernels and without, an STE gradient, ``convert`` storing those codes, and the
stored array (``qat_stored_array``) equal to ``llama-quantize --imatrix``'s tensors of the same
weights (``tests/fixtures/imatrix_reference.npz``). Refusals leave the model unchanged.
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixle
from mixle.core.numerics import quantize_array
from mixle.core.spec import QuantSpec
from mixle.torch_backend.kernels import fused_cpu
from mixle.torch_backend import fused_ggml
from mixle.torch_backend.kernels import packed_linear
from mixle.torch_backend.layers.layer_kinds import qat_stored_array
from mixle.torch_backend.layers.qat import QATWrapper
from tests.test_imatrix import reference  # noqa: F401  (the fixture)

WEIGHTED = ("q4_0", "q5_0", "q4_1", "q5_1", "q4_k", "q5_k", "q6_k")


def importance(cols, seed=0):
    rng = np.random.default_rng(seed)
    values = (rng.random(cols) ** 4 * 10.0 ** rng.uniform(-2, 2, cols)).astype(np.float32)
    values[::11] = 0.0
    return values


def layer_and_reference(grid, shape=(6, 512), seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    linear = nn.Linear(shape[1], shape[0]).to(dtype)
    with torch.no_grad():
        linear.weight[0, :40] = 0.0  # an all-zero block
        linear.weight[1] *= 30.0  # larger rows
    imp = importance(shape[1], seed)
    layer = QATWrapper(linear, QuantSpec(grid=grid), importance=imp)
    w = linear.weight.detach().float().numpy()
    ref = quantize_array(w, QuantSpec(grid=grid), importance=imp)
    plain = quantize_array(w, QuantSpec(grid=grid)).dequantize()
    return layer, ref, plain


def bits(t):
    return np.ascontiguousarray(t.detach().float().numpy() if isinstance(t, torch.Tensor) else t).view(np.int32)


@pytest.mark.parametrize("grid", WEIGHTED)
def test_forward_is_numpy_weighted_round_trip_kernels_on_and_off(grid):
    layer, ref, plain = layer_and_reference(grid)
    x = torch.randn(3, 512)
    outs = []
    for off in (False, True):
        mixle.invalidate_fake_quant_caches()
        if off:
            with fused_cpu.switched_off():
                deq, y = layer.quantized_weight(), layer(x)
        else:
            assert fused_ggml.available()
            deq, y = layer.quantized_weight(), layer(x)
        assert np.array_equal(bits(deq), bits(ref.dequantize())), (grid, off)
        assert torch.equal(y, F.linear(x, torch.from_numpy(np.asarray(ref.dequantize())), layer.bias))
        outs.append(y)
    assert torch.equal(*outs)
    assert not np.array_equal(np.asarray(ref.dequantize()), plain)  # the importance changes the lattice


@pytest.mark.parametrize("grid", ["q4_0", "q4_k", "q6_k"])
def test_kernel_equals_torch_path_on_bfloat16_and_short_rows(grid):
    cols = 96 if grid == "q4_0" else 256  # rows of 96: a kernel unit of 32 blocks spans rows
    torch.manual_seed(1)
    w = (torch.randn(13, cols) * 0.05).to(torch.bfloat16)
    imp = torch.from_numpy(importance(cols, 1))
    spec = QuantSpec(grid=grid)
    fused = fused_ggml.fake_quant(w, spec, want_codes=True, importance=imp)
    from mixle.torch_backend.fake_quant import fake_quantized_weight

    with fused_cpu.switched_off():
        torch_path = fake_quantized_weight(w, spec, importance=imp)[0]
    assert torch.equal(fused[0], torch_path) and fused[4] == 0 and fused[5] == 0
    ref = quantize_array(w.float().numpy(), spec, importance=imp.numpy())
    assert np.array_equal(fused[1].numpy(), ref.codes)
    if grid != "q4_0":  # q4_0 holds its scale in bfloat16 first, as without an importance
        assert torch.equal(torch_path, torch.from_numpy(np.asarray(ref.dequantize())).to(torch.bfloat16))


def test_gradient_is_straight_through_and_cache_follows_importance():
    layer, ref, _ = layer_and_reference("q4_k", shape=(4, 256))
    x = torch.randn(5, 256, requires_grad=True)
    grad = torch.randn(5, 4)
    layer(x).backward(grad)
    deq = torch.from_numpy(np.asarray(ref.dequantize()))
    assert torch.equal(layer.weight.grad, grad.t().mm(x.detach()))
    assert torch.allclose(x.grad, grad.mm(deq), rtol=0, atol=1e-6)
    first = layer.quantized_weight().detach().clone()
    layer.importance.mul_(0).add_(torch.from_numpy(importance(256, 7)))  # an in-place change is seen
    other = quantize_array(layer.weight.detach().numpy(), QuantSpec(grid="q4_k"), importance=layer.importance.numpy())
    assert np.array_equal(bits(layer.quantized_weight()), bits(other.dequantize()))
    assert not torch.equal(first, layer.quantized_weight())
    assert "importance" not in layer.state_dict()


def test_apply_qat_convert_and_stored_array_equal_the_forward():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 8))
    keys = list(net.state_dict())
    imp = {"0": importance(256, 2), "2": importance(64, 3)}
    mixle.apply_qat(net, patterns=[("0", QuantSpec(grid="q4_k")), ("2", QuantSpec(grid="q4_0"))], importance=imp)
    assert list(net.state_dict()) == keys
    x = torch.randn(2, 256)
    y = net(x)
    converted = mixle.convert(net)
    with packed_linear.switched_off():  # its kernel sums in another order
        assert torch.equal(converted(x), y)
    for path, grid in (("0", "q4_k"), ("2", "q4_0")):
        ref = quantize_array(net.get_submodule(path).weight.detach().numpy(), grid=grid, importance=imp[path])
        stored = qat_stored_array(net.get_submodule(path))
        assert np.array_equal(stored.codes.numpy(), ref.codes) and np.array_equal(stored.scale.numpy(), ref.scale)
        assert torch.equal(converted.get_submodule(path).dequantized_weight().reshape(-1),
                           net.get_submodule(path).quantized_weight().detach().reshape(-1))
    net.to(torch.bfloat16)
    assert net[0].importance.dtype == torch.float32  # not rounded with the weights


def test_q8_0_ignores_importance_as_llama_cpp():
    net = nn.Sequential(nn.Linear(64, 4))
    mixle.apply_qat(net, grid="q8_0", bits=8, importance={"0": importance(64)})
    assert net[0].importance is None
    with pytest.raises(ValueError, match="64 input columns"):
        mixle.apply_qat(nn.Sequential(nn.Linear(64, 4)), grid="q8_0", bits=8, importance={"0": np.ones(3)})


@pytest.mark.parametrize("kwargs, imp, message", [
    ({"bits": 4}, {"0": np.ones(64)}, "layer '0': weight: grid='symmetric' has no importance-weighted search"),
    ({"grid": "nf4", "bits": 4, "group_size": 64}, {"0": np.ones(64)}, "grid='nf4' has no importance-weighted"),
    ({"grid": "q4_0", "bits": 4}, {"0": -np.ones(64)}, r"layer '0': weight: importance\[0\] = -1.0"),
    ({"grid": "q4_0", "bits": 4}, {"1": np.ones(64)}, "which apply_qat does not fake-quantize"),
    ({"grid": "q4_0", "bits": 4}, {"2": np.ones(64)}, "which apply_qat does not fake-quantize"),
    ({"grid": "q4_0", "bits": 4}, {"0": np.ones(32)}, "pass one value per column, shape \\(64,\\)"),
])
def test_refusals_leave_the_model_unchanged(kwargs, imp, message):
    net = nn.Sequential(nn.Linear(64, 4), nn.Linear(4, 4), nn.Embedding(3, 64))
    before = copy.deepcopy(net)
    with pytest.raises(ValueError, match=message):
        mixle.apply_qat(net, patterns=["0"], importance=imp, **kwargs)
    assert [type(m) for m in net.modules()] == [type(m) for m in before.modules()]
    assert not hasattr(net, "_mixle_qat_report")


def test_other_layer_kinds_are_refused():  # Flax kernels take importance too: tests/test_flax_llama_cpp.py
    net = nn.Sequential(nn.Embedding(8, 64), nn.Linear(64, 8))
    with pytest.raises(ValueError, match="taken only by plain linear layers"):
        mixle.apply_qat(net, grid="q4_0", bits=4, opt_in=("embedding",), importance={"0": np.ones(64)})
    assert type(net[1]) is nn.Linear


def test_stored_arrays_equal_llama_quantize_imatrix(reference, tmp_path):  # noqa: F811
    """apply_qat(gguf_mix=, importance=) on the seeded model: every blk matrix's stored array, packed, is
    the tensor llama-quantize --imatrix made of the same weights with the same imatrix, and so is every
    tensor of save_gguf's file of the QAT model."""
    from mixle.gguf.blocks import pack_array
    from mixle.gguf.imatrix_file import model_imatrix_names
    from tests.test_gguf_mixes import read_tensors, sha
    from tests.test_imatrix import fixture_imatrix, seeded_model

    meta, arrays = reference
    case, which, ftype = "qwen2_h64", "known", "Q4_K_M"
    want = meta["cases"][case]["imatrix"][which]["ftypes"][ftype]
    model = copy.deepcopy(seeded_model(case))
    mixle.apply_qat(model, gguf_mix=ftype, importance=fixture_imatrix(arrays, case, which))
    modules, checked = dict(model.named_modules()), 0
    for path, names in model_imatrix_names(model).items():
        if len(names) != 1 or not names[0].startswith("blk.") or want[names[0]][0] in ("F32", "F16"):
            continue
        module = modules[path]
        assert module.spec.grid == want[names[0]][0].lower(), names[0]
        assert (module.importance is None) == (module.spec.grid == "q8_0"), names[0]  # ggml ignores it on Q8_0
        stored = qat_stored_array(module)
        assert sha(pack_array(stored)) == want[names[0]][1], names[0]
        checked += 1
    assert checked >= 10
    path = tmp_path / "qat.gguf"  # the whole file: QAT layers as trained, the rest as the mix quantizes it
    types = mixle.save_gguf(model, path, gguf_mix=ftype, importance=fixture_imatrix(arrays, case, which))
    got = read_tensors(path)
    assert types == {n: t for n, (t, _) in want.items()}
    bad = [n for n, (_, digest) in want.items() if sha(got[n][2]) != digest]
    assert not bad, f"{len(bad)} tensors differ from llama-quantize --imatrix: {bad[:4]}"



def test_reapplying_needs_reconfigure_to_change_the_importance():
    net = nn.Sequential(nn.Linear(64, 4))
    mixle.apply_qat(net, grid="q4_0", bits=4)
    w = net[0].weight.detach().numpy()
    imp = importance(64, 4)
    with pytest.raises(ValueError, match="already fake-quantized with another importance"):
        mixle.apply_qat(net, grid="q4_0", bits=4, importance={"0": imp})
    assert net[0].importance is None
    mixle.apply_qat(net, grid="q4_0", bits=4, importance={"0": imp}, reconfigure=True)
    ref = quantize_array(w, grid="q4_0", importance=imp).dequantize()
    first, again = net[0].quantized_weight(), net[0].quantized_weight()  # the second from the kept codes
    assert np.array_equal(bits(first), bits(ref)) and torch.equal(first, again)


def test_apply_lora_refuses_a_layer_holding_an_importance_and_changes_nothing():
    net = nn.Sequential(nn.Linear(64, 4), nn.ReLU(), nn.Linear(4, 4))
    mixle.apply_qat(net, grid="q4_0", bits=4, patterns=["0"], importance={"0": np.ones(64, np.float32)})
    before = [type(m) for m in net.modules()]
    with pytest.raises(ValueError, match="layer '0' is fake-quantized with an importance matrix"):
        mixle.apply_lora(net, rank=2, alpha=2)
    assert [type(m) for m in net.modules()] == before and net[0].importance is not None
