"""The plan of a model's GGUF file is built once per call: ``save_gguf``, the importance-matrix
functions and ``apply_qat(gguf_mix=, importance=)`` walk the model's layout once, however many
matrices it has (they walked it once per matrix, or once per question, before)."""

import numpy as np
import pytest
import torch

import mixle
from mixle.core.imatrix import Imatrix
from mixle.gguf import plan
from mixle.gguf.imatrix_file import importance_by_layer, importance_by_tensor, model_imatrix_names

pytest.importorskip("gguf")


@pytest.fixture
def layouts(monkeypatch):
    """Counts the layouts built (``mixle.gguf.layouts.layout_of`` calls through the plan)."""
    calls = []
    real = plan.layout_of

    def counted(model, gguf):
        calls.append(type(model).__name__)
        return real(model, gguf)

    monkeypatch.setattr(plan, "layout_of", counted)
    return calls


def _lm():
    torch.manual_seed(0)
    return mixle.build_causal_lm(vocab=40, d_model=32, n_layer=3, n_head=2, block=8, activation="gelu_tanh")


def _imatrix(model):
    names, shapes = model_imatrix_names(model), plan.plan_of(model).matrix_shapes
    rng = np.random.default_rng(0)
    return Imatrix({path: rng.random((1, shapes[names[path][0]][-1]), dtype=np.float32) + 0.5 for path in names},
                   {path: np.array([64]) for path in names}, ("t",), 1, 64)


def test_importance_functions_walk_the_layout_once(layouts):
    model = _lm()
    imatrix = _imatrix(model)
    layouts.clear()
    by_layer = importance_by_layer(model, imatrix)
    assert len(layouts) == 1
    assert set(by_layer) == set(imatrix.sums)
    np.testing.assert_array_equal(by_layer["blocks.2.out"], imatrix.sums["blocks.2.out"][0] / 64)
    layouts.clear()
    by_tensor = importance_by_tensor(model, imatrix)
    assert len(layouts) == 1
    np.testing.assert_array_equal(by_tensor["blk.2.ffn_down.weight"], imatrix.sums["blocks.2.out"][0] / 64)


def test_save_gguf_and_apply_qat_walk_the_layout_once(layouts, tmp_path):
    model = _lm()
    imatrix = _imatrix(model)
    layouts.clear()
    types = mixle.save_gguf(model, tmp_path / "m.gguf", gguf_mix="Q4_0", importance=imatrix)
    assert len(layouts) == 1 and types["blk.0.attn_qkv.weight"] == "Q4_0"
    layouts.clear()
    mixle.apply_qat(model, gguf_mix="Q4_0", importance=imatrix)
    assert len(layouts) == 1
    assert mixle.get_qat_report(model).wrapped


def test_save_gguf_gathers_the_torch_side_once_and_writes_from_numpy(monkeypatch, tmp_path):
    """The model's weights leave torch in one call (``gather_weights``): the writer after it gets
    numpy arrays and stored arrays, and neither it nor the plan imports torch."""
    from mixle.core.stored import QuantizedArray
    from mixle.gguf import writer

    gathered = []
    real = writer.gather_weights

    def counted(parts, given=None):
        gathered.append(real(parts, given))
        return gathered[-1]

    monkeypatch.setattr(writer, "gather_weights", counted)
    model = mixle.apply_qat(_lm(), grid="q4_0", exclude=["blocks.2.fc"])
    types = mixle.save_gguf(model, tmp_path / "m.gguf")
    assert len(gathered) == 1 and set(gathered[0]) == set(types)
    kinds = {name: type(data) for name, data in gathered[0].items()}
    assert kinds["blk.0.attn_qkv.weight"] is QuantizedArray and kinds["blk.2.ffn_up.weight"] is np.ndarray
    assert set(kinds.values()) == {QuantizedArray, np.ndarray}
    for module in (writer, plan):
        source = open(module.__file__).read()
        assert "import torch" not in source and "from torch" not in source, module.__name__
