"""Every model transform finishes or leaves the model exactly as it was: each is interrupted at its
second layer by an exception raised from inside (a layer constructor, the quantizer, the merge,
or the commit itself), and the model must then equal a snapshot taken before the call."""

import os

import pytest
import torch
from torch import nn

from mixle.experimental.program.lora import apply_lora, merge_lora
from mixle.models.qat import apply_qat, get_qat_report
from mixle.task.quantize import convert, load_quantized, quantize_model, save_quantized
from mixle.torch_backend import convert as convert_module
from mixle.torch_backend.layers import QATWrapper
from mixle.torch_backend.lora import LoRALinear
from mixle.torch_backend.quantized import QuantizedLinear
from mixle.torch_backend.swap import Change


class Interrupted(RuntimeError):
    pass


def fail_on_second_call(monkeypatch, owner, name):
    """Make ``owner.name`` raise Interrupted on its second call (the first runs normally)."""
    original = getattr(owner, name)
    calls = []

    def patched(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise Interrupted(f"{name} interrupted at its second call")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, patched)
    return calls


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def snapshot(model):
    """Everything a transform may touch: module objects per path, tensors (object and value),
    requires_grad flags and the attributes of every module."""
    return {
        "modules": [(path, id(m), type(m)) for path, m in model.named_modules()],
        "tensors": {k: (id(v), v.detach().clone(), v.requires_grad) for k, v in model.state_dict(keep_vars=True).items()},
        "attributes": {path: sorted(vars(m)) for path, m in model.named_modules()},
    }


def assert_unchanged(model, before):
    after = snapshot(model)
    assert after["modules"] == before["modules"]
    assert after["attributes"] == before["attributes"]
    assert after["tensors"].keys() == before["tensors"].keys()
    for key, (ident, value, flag) in before["tensors"].items():
        new_ident, new_value, new_flag = after["tensors"][key]
        same_bits = new_value.numpy().tobytes() == value.numpy().tobytes()  # NaN-safe, exact
        assert new_ident == ident and new_flag == flag and same_bits, key


def test_apply_qat_interrupted_while_wrapping(monkeypatch):
    model = make_model()
    before = snapshot(model)
    calls = fail_on_second_call(monkeypatch, QATWrapper, "__init__")
    with pytest.raises(Interrupted):
        apply_qat(model, bits=4)
    assert len(calls) == 2
    assert_unchanged(model, before)


def adapted_model():
    model = apply_lora(apply_qat(make_model(), bits=4), rank=2, alpha=2)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, LoRALinear):
                layer.lora_B.normal_()  # a trained adapter: merging changes the weights
    return model


COMMITS = {
    "apply_qat": (make_model, lambda m: apply_qat(m, bits=4)),
    "quantize_model": (make_model, lambda m: quantize_model(m, bits=4)),
    "apply_lora": (make_model, lambda m: apply_lora(m, rank=2, alpha=2)),
    "merge_lora": (adapted_model, merge_lora),
}


@pytest.mark.parametrize("name, step", [("apply_qat", "set"), ("quantize_model", "set"), ("apply_lora", "set"),
                                        ("apply_lora", "requires_grad"), ("merge_lora", "copy_"),
                                        ("merge_lora", "set")])
def test_commits_interrupted_at_their_second_edit(monkeypatch, name, step):
    """The commit itself fails at its second edit of this kind: every edit before it is undone."""
    build, transform = COMMITS[name]
    model = build()
    x = torch.randn(5, 8)
    with torch.no_grad():
        expected = model(x)
    before = snapshot(model)
    calls = fail_on_second_call(monkeypatch, Change, step)
    with pytest.raises(Interrupted):
        transform(model)
    assert len(calls) == 2
    assert_unchanged(model, before)
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_apply_lora_interrupted_while_wrapping(monkeypatch):
    model = apply_qat(make_model(), bits=4)
    before = snapshot(model)
    fail_on_second_call(monkeypatch, QATWrapper, "__init__")  # QATLoRALinear builds on it
    with pytest.raises(Interrupted):
        apply_lora(model, rank=2, alpha=2)
    assert_unchanged(model, before)
    assert get_qat_report(model).wrapped == ["0", "2", "4"]


def test_merge_lora_interrupted_while_merging_restores_the_first_weight(monkeypatch):
    model = apply_lora(apply_qat(make_model(), bits=4), rank=2, alpha=2)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, LoRALinear):
                layer.lora_B.normal_()
    x = torch.randn(5, 8)
    expected = model(x)
    before = snapshot(model)
    fail_on_second_call(monkeypatch, LoRALinear, "merged_weight")
    with pytest.raises(Interrupted):
        merge_lora(model)
    assert_unchanged(model, before)
    assert torch.equal(model(x), expected)  # still adapted, and not merged twice


def test_merge_lora_refuses_a_non_finite_adapter():
    model = apply_lora(make_model(), rank=2, alpha=2)
    with torch.no_grad():
        model[2].lora_A[0, 0] = float("nan")
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"'2'.*NaN or infinity"):
        merge_lora(model)
    assert_unchanged(model, before)


@pytest.mark.parametrize("transform", ["convert", "quantize_model"])
def test_convert_and_ptq_interrupted_while_quantizing(monkeypatch, transform):
    model = apply_qat(make_model(), bits=4) if transform == "convert" else make_model()
    before = snapshot(model)
    fail_on_second_call(monkeypatch, convert_module, "to_storage")
    with pytest.raises(Interrupted):
        convert(model) if transform == "convert" else quantize_model(model, bits=4)
    assert_unchanged(model, before)


def test_load_quantized_interrupted_while_building_layers(monkeypatch, tmp_path):
    path = tmp_path / "m.safetensors"
    save_quantized(quantize_model(make_model(), bits=4), path)
    data = path.read_bytes()
    model = make_model()
    before = snapshot(model)
    fail_on_second_call(monkeypatch, QuantizedLinear, "__init__")
    with pytest.raises(Interrupted):
        load_quantized(path, model)
    assert_unchanged(model, before)
    assert path.read_bytes() == data and os.listdir(tmp_path) == ["m.safetensors"]
