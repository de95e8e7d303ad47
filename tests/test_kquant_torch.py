"""The torch QAT layers on llama.cpp's other block types and NF4 (issue 24): a tiny model per grid.

The forward equals ``quantize_dequantize_array`` (ggml's reference quantize -> dequantize) bit for
bit, the STE passes the gradient unchanged, the toggle is exact, convert equals the fake-quant
forward, save_quantized / load_quantized round-trip, model_nbytes counts every part and the
report names the grid.
"""

import numpy as np
import pytest
import torch

import mixle
from mixle.core.grids import GRIDS
from mixle.core.numerics import quantize_dequantize_array
from mixle.torch_backend.kernels.packed_linear import switched_off

NEW_GRIDS = sorted(name for name, grid in GRIDS.items() if grid.numerics is not None)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))


def _bits(t):
    return t.detach().numpy().view(np.uint32)


def test_the_new_grids_are_the_eight_block_types_and_train_on_torch_and_flax():
    assert NEW_GRIDS == ["mxfp4", "nf4", "q4_1", "q4_k", "q5_0", "q5_1", "q5_k", "q6_k"]
    assert all(GRIDS[name].backends == (("torch",) if name in ("mxfp4", "nf4") else ("torch", "flax"))
               for name in NEW_GRIDS)


@pytest.mark.parametrize("grid", NEW_GRIDS)
def test_qat_forward_is_bit_exact_and_the_ste_passes_the_gradient(grid):
    model, plain = _model(), _model()
    weights = [plain[0].weight.detach().clone(), plain[2].weight.detach().clone()]
    mixle.apply_qat(model, grid=grid)
    x = torch.randn(5, 256)
    deq = [quantize_dequantize_array(w, grid=grid) for w in weights]
    want = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, deq[0], plain[0].bias)), deq[1],
                                      plain[2].bias)
    got = model(x)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    np.testing.assert_array_equal(_bits(model(x)), _bits(want))  # the cached weight is the same
    got.square().sum().backward()
    # STE: the weight's gradient is that of the fake-quantized weight, unchanged.
    ref = [d.clone().requires_grad_(True) for d in deq]
    y = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, ref[0], plain[0].bias)), ref[1],
                                   plain[2].bias)
    y.square().sum().backward()
    np.testing.assert_array_equal(_bits(model[0].weight.grad), _bits(ref[0].grad))
    mixle.set_fake_quant_enabled(model, False)
    np.testing.assert_array_equal(_bits(model(x)), _bits(plain(x)))  # the toggle is exact
    mixle.set_fake_quant_enabled(model, True)
    assert grid in str(mixle.get_qat_report(model))


@pytest.mark.parametrize("grid", NEW_GRIDS)
def test_convert_equals_the_fake_quant_forward_and_round_trips_through_files(grid, tmp_path):
    model = mixle.apply_qat(_model(), grid=grid)
    x = torch.randn(3, 256)
    with torch.no_grad():
        want = model(x)
    converted = mixle.convert(model)
    assert {type(m).__name__ for m in converted if not isinstance(m, torch.nn.ReLU)} == {"QuantizedLinear"}
    np.testing.assert_array_equal(_bits(converted(x)), _bits(want))  # no packed kernel on these grids
    with switched_off():
        np.testing.assert_array_equal(_bits(converted(x)), _bits(want))
    path = tmp_path / "m.safetensors"
    manifest = mixle.save_quantized(converted, path)
    back = mixle.load_quantized(path, _model())
    np.testing.assert_array_equal(_bits(back(x)), _bits(want))
    for layer, again in ((converted[0], back[0]), (converted[2], back[2])):
        assert sorted(layer.grid_parts()) == sorted(again.grid_parts())
        for part, value in layer.grid_parts().items():
            assert torch.equal(value, again.grid_parts()[part]), part
    nbytes = mixle.model_nbytes(converted)
    parts = sum(t.numel() * t.element_size() for m in (converted[0], converted[2]) for t in m.grid_parts().values()
                if not t.is_floating_point())
    assert nbytes.other_bytes == 0 and nbytes.scale_bytes >= parts
    assert nbytes == mixle.model_nbytes(back) and manifest["nbytes"]["total"] == nbytes.total


def test_an_embedding_on_a_k_quant_looks_up_the_dequantized_rows():
    emb = torch.nn.Sequential(torch.nn.Embedding(8, 256))
    table = quantize_dequantize_array(emb[0].weight.detach(), grid="q4_k")
    mixle.apply_qat(emb, grid="q4_k", opt_in=("embedding",))
    idx = torch.tensor([[3, 0, 7]])
    np.testing.assert_array_equal(_bits(emb(idx)), _bits(table[idx]))
    np.testing.assert_array_equal(_bits(mixle.convert(emb)(idx)), _bits(table[idx]))


@pytest.mark.parametrize("grid", ["q4_k", "q4_1", "nf4"])
def test_bfloat16_models_convert_and_reload_bit_for_bit(grid, tmp_path):
    """The blocks dequantize in float32 (as ggml) and are cast to bfloat16, in QAT and after convert."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, 256)).to(torch.bfloat16)

    model = mixle.apply_qat(build(), grid=grid)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x)
    converted = mixle.convert(model)
    mixle.save_quantized(converted, tmp_path / "m.safetensors")
    back = mixle.load_quantized(tmp_path / "m.safetensors", build())
    assert torch.equal(converted(x), want) and torch.equal(back(x), want)
