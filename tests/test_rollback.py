"""Every model transform finishes or leaves the model exactly as it was: each is interrupted by an
exception raised from inside (a layer constructor, the quantizer, the merge, or the commit
itself), and the model must then equal a snapshot taken before the call.

Two different guarantees are checked, and each case says which:

* apply_qat, apply_lora and merge_lora edit the model in place. Interrupted inside their commit,
  the edits already made are undone by ``swap.Change`` (its own unit tests are in test_swap.py);
  these cases fail when Change's undo is disabled. Interrupted while planning (before the
  commit), the model is untouched because planning edits nothing: no undo is involved.
* convert, quantize_model and load_quantized work on a private copy of their input. They cannot
  test the undo (it runs on the copy, which the caller never sees); they check that the input's
  modules, Parameters and buffers stay the same objects, bit for bit, however far the transform
  got, and after it succeeds too."""

import os

import pytest
import torch
from torch import nn

from mixle.experimental.program.lora import apply_lora, merge_lora
from mixle.models.qat import apply_qat, get_qat_report
from mixle.task.quantize import convert, load_quantized, quantize_model, save_quantized
from mixle.torch_backend.transforms import convert as convert_module
from mixle.torch_backend.layers.qat import QATWrapper
from mixle.torch_backend.layers.lora import LoRALinear
from mixle.torch_backend.transforms.swap import Change


class Interrupted(RuntimeError):
    pass


def fail_on_call(monkeypatch, owner, name, at=2):
    """Make ``owner.name`` raise Interrupted on its ``at``-th call (the earlier ones run normally)."""
    original = getattr(owner, name)
    calls = []

    def patched(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise Interrupted(f"{name} interrupted at its call {at}")
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


# ----------------------------------------------------------------------------------------------
# In-place transforms: interrupted inside the commit, Change undoes what was already done


def adapted_model():
    model = apply_lora(apply_qat(make_model(), bits=4), rank=2, alpha=2)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, LoRALinear):
                layer.lora_B.normal_()  # a trained adapter: merging changes the weights
    return model


IN_PLACE = {
    "apply_qat": (make_model, lambda m: apply_qat(m, bits=4)),
    "apply_lora": (make_model, lambda m: apply_lora(m, rank=2, alpha=2)),
    "merge_lora": (adapted_model, merge_lora),
}


@pytest.mark.parametrize("name, step", [("apply_qat", "set"), ("apply_lora", "set"), ("apply_lora", "requires_grad"),
                                        ("merge_lora", "copy_"), ("merge_lora", "set")])
def test_in_place_commits_interrupted_at_their_second_edit_are_undone(monkeypatch, name, step):
    """The commit fails at its second edit of this kind, after the first was made on the caller's
    model: Change must undo it (and every other edit before it)."""
    build, transform = IN_PLACE[name]
    model = build()
    x = torch.randn(5, 8)
    with torch.no_grad():
        expected = model(x)
    before = snapshot(model)
    calls = fail_on_call(monkeypatch, Change, step)
    with pytest.raises(Interrupted):
        transform(model)
    assert len(calls) == 2
    assert_unchanged(model, before)
    with torch.no_grad():
        assert torch.equal(model(x), expected)  # same modules, same bits: the same float ops


def test_merge_lora_interrupted_while_merging_restores_the_first_weight(monkeypatch):
    """The second layer's merged weight fails after the first layer's weight was overwritten in
    place: Change restores its bits."""
    model = adapted_model()
    x = torch.randn(5, 8)
    expected = model(x)
    before = snapshot(model)
    fail_on_call(monkeypatch, LoRALinear, "merged_weight")
    with pytest.raises(Interrupted):
        merge_lora(model)
    assert_unchanged(model, before)
    assert torch.equal(model(x), expected)  # still adapted, and not merged twice


# ----------------------------------------------------------------------------------------------
# In-place transforms: interrupted or refused while planning, before anything is edited (no undo)


def test_apply_qat_interrupted_while_planning_has_edited_nothing(monkeypatch):
    """The wrappers are built before the commit: the second one fails while the model is still
    untouched (Change is never entered)."""
    model = make_model()
    before = snapshot(model)
    calls = fail_on_call(monkeypatch, QATWrapper, "__init__")
    entered = fail_on_call(monkeypatch, Change, "__enter__", at=0)  # counts, never fails
    with pytest.raises(Interrupted):
        apply_qat(model, bits=4)
    assert len(calls) == 2 and entered == []
    assert_unchanged(model, before)


def test_apply_lora_interrupted_while_planning_has_edited_nothing(monkeypatch):
    model = apply_qat(make_model(), bits=4)
    before = snapshot(model)
    fail_on_call(monkeypatch, QATWrapper, "__init__")  # QATLoRALinear builds on it
    entered = fail_on_call(monkeypatch, Change, "__enter__", at=0)
    with pytest.raises(Interrupted):
        apply_lora(model, rank=2, alpha=2)
    assert entered == []
    assert_unchanged(model, before)
    assert get_qat_report(model).wrapped == ["0", "2", "4"]


def test_merge_lora_refuses_a_non_finite_adapter_before_editing():
    model = apply_lora(make_model(), rank=2, alpha=2)
    with torch.no_grad():
        model[2].lora_A[0, 0] = float("nan")
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"'2'.*NaN or infinity"):
        merge_lora(model)
    assert_unchanged(model, before)


# ----------------------------------------------------------------------------------------------
# Copying transforms: the input is never edited, however far the transform got on its copy


def saved_file(tmp_path):
    path = tmp_path / "m.safetensors"
    save_quantized(quantize_model(make_model(), bits=4), path)
    return path


def with_extra_buffer():
    model = make_model()
    model.register_buffer("extra", torch.arange(3.0))  # not in the file: refused after the swap
    return model


# (input model, transform, what fails and at which call): each failure comes after the copy was
# edited (the QAT wrapping inside quantize_model, a commit, or load_quantized's state check after
# its swap). Without the copy, quantize_model's cases and the not-fitting load would leave the
# input edited; the commits of convert and load_quantized would then still be undone by Change,
# so those two fail only with the copy and the undo both gone. (A failure before any edit, e.g.
# while quantizing convert's first layers, could not tell a copy from none: no such case.)
COPYING = {
    "convert-committing": (lambda: apply_qat(make_model(), bits=4), lambda m, p: convert(m), (Change, "delete", 1)),
    "quantize_model-quantizing": (make_model, lambda m, p: quantize_model(m, bits=4),
                                  (convert_module, "to_storage", 2)),
    "quantize_model-committing": (make_model, lambda m, p: quantize_model(m, bits=4), (Change, "delete", 1)),
    "load_quantized-committing": (make_model, lambda m, p: load_quantized(p, m), (Change, "set", 2)),
    "load_quantized-not-fitting": (with_extra_buffer, lambda m, p: load_quantized(p, m), None),
}


@pytest.mark.parametrize("case", list(COPYING))
def test_a_failing_copying_transform_leaves_its_input_untouched(monkeypatch, tmp_path, case):
    """Not an undo test (the undo runs on the private copy): the input's modules, Parameters and
    buffers are the same objects with the same bits and flags, and any file is unchanged."""
    build, transform, failure = COPYING[case]
    path = saved_file(tmp_path)
    data = path.read_bytes()
    model = build()
    before = snapshot(model)
    if failure is None:
        error = pytest.raises(ValueError, match="does not fit this model")
    else:
        calls = fail_on_call(monkeypatch, failure[0], failure[1], at=failure[2])
        error = pytest.raises(Interrupted)
    with error:
        transform(model, path)
    assert failure is None or len(calls) == failure[2]
    assert_unchanged(model, before)
    assert path.read_bytes() == data and os.listdir(tmp_path) == ["m.safetensors"]


@pytest.mark.parametrize("name", ["convert", "quantize_model", "load_quantized"])
def test_a_copying_transform_that_succeeds_leaves_its_input_untouched(tmp_path, name):
    """The result is a new model: none of the input's modules or tensors is in it, and the input
    still computes bit for bit what it did."""
    model = apply_qat(make_model(), bits=4) if name == "convert" else make_model()
    path = saved_file(tmp_path) if name == "load_quantized" else None
    x = torch.randn(5, 8)
    with torch.no_grad():
        expected = model(x)
    before = snapshot(model)
    result = {"convert": lambda: convert(model), "quantize_model": lambda: quantize_model(model, bits=4),
              "load_quantized": lambda: load_quantized(path, model)}[name]()
    assert_unchanged(model, before)
    objects = lambda m: {id(x) for x in [*m.modules(), *m.state_dict(keep_vars=True).values()]}  # noqa: E731
    assert objects(model).isdisjoint(objects(result))
    with torch.no_grad():
        assert torch.equal(model(x), expected)
