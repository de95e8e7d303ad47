"""``swap.Change`` on its own: a failure injected after each kind of edit undoes every edit already
made, newest first, so objects, tensor bits, ``requires_grad`` flags and attribute presence are
exactly as before; without a failure the edits stay."""

import types

import pytest
import torch
from torch import nn

from mixle.torch_backend.transforms.swap import Change


class Injected(RuntimeError):
    pass


def bits(tensor):
    """The tensor's bytes: exact, and NaN- and signed-zero-safe."""
    return tensor.detach().numpy().tobytes()


def fail_after(edit, error=Injected):
    """Run ``edit(change)`` inside a Change, then raise: the Change must undo it."""
    with pytest.raises(error):
        with Change() as change:
            edit(change)
            raise error("injected after the edit")


def test_set_of_an_existing_attribute_restores_the_old_object():
    layer = nn.Linear(3, 2)
    weight, spec = layer.weight, object()
    layer.spec = spec
    fail_after(lambda c: (c.set(layer, "weight", nn.Parameter(torch.zeros(2, 3))), c.set(layer, "spec", None)))
    assert layer.weight is weight and layer._parameters["weight"] is weight and layer.spec is spec


def test_set_of_a_missing_attribute_removes_it_again():
    layer, plain = nn.Linear(3, 2), types.SimpleNamespace()
    before = sorted(vars(layer)), dict(layer._modules)
    fail_after(lambda c: (c.set(layer, "report", "new"), c.set(layer, "extra", nn.ReLU()), c.set(plain, "x", 1)))
    assert not hasattr(layer, "report") and not hasattr(layer, "extra") and not hasattr(plain, "x")
    assert (sorted(vars(layer)), dict(layer._modules)) == before


def test_edits_are_undone_newest_first():
    holder = types.SimpleNamespace(value="original")
    tensor = torch.tensor([1.0, 2.0])

    def edit(change):
        change.set(holder, "value", "first")
        change.set(holder, "value", "second")  # undone first: back to "first", then to "original"
        change.copy_(tensor, torch.tensor([3.0, 4.0]))
        change.copy_(tensor, torch.tensor([5.0, 6.0]))

    fail_after(edit)
    assert holder.value == "original" and tensor.tolist() == [1.0, 2.0]


def test_delete_restores_the_attribute_and_skips_a_missing_one():
    model = nn.Sequential(nn.Linear(2, 2))
    report = object()
    model.report = report
    before = sorted(vars(model))
    fail_after(lambda c: (c.delete(model, "report"), c.delete(model, "never_there")))
    assert model.report is report and sorted(vars(model)) == before and not hasattr(model, "never_there")


def test_copy_restores_the_same_tensor_bit_for_bit():
    layer = nn.Linear(5, 1)
    with torch.no_grad():
        layer.weight[0] = torch.tensor([1.5, -0.0, float("nan"), float("inf"), 1e-45])  # odd bits survive
    weight, before = layer.weight, bits(layer.weight)
    fail_after(lambda c: c.copy_(layer.weight, torch.zeros(1, 5)))
    assert layer.weight is weight and bits(weight) == before and weight.requires_grad


def test_requires_grad_restores_both_flags():
    on, off = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2), requires_grad=False)
    fail_after(lambda c: (c.requires_grad(on, False), c.requires_grad(off, True)))
    assert on.requires_grad and not off.requires_grad


def test_swap_of_a_child_under_two_parents_restores_both():
    shared = nn.Linear(2, 2)
    left, right = nn.Sequential(shared, nn.ReLU()), nn.Sequential(nn.Tanh(), shared)
    model = nn.Sequential(left, right)
    modules = [(path, m) for path, m in model.named_modules(remove_duplicate=False)]
    new = nn.Identity()

    def edit(change):
        assert change.swap(model, {id(shared): new}) is model
        assert left[0] is new and right[1] is new  # swapped everywhere before the failure

    fail_after(edit)
    assert [(p, m) for p, m in model.named_modules(remove_duplicate=False)] == modules
    assert left[0] is shared and right[1] is shared


def test_root_swap_returns_the_replacement_and_restores_children_inside_it():
    inner = nn.Linear(2, 2)
    model = nn.Sequential(inner)
    new_root, new_inner = nn.Sequential(inner, nn.ReLU()), nn.Identity()  # the replacement holds a replaced child

    def edit(change):
        assert change.swap(model, {id(model): new_root, id(inner): new_inner}) is new_root
        assert model[0] is new_inner and new_root[0] is new_inner

    fail_after(edit)
    assert model[0] is inner and new_root[0] is inner and len(model) == 1


def test_a_keyboard_interrupt_is_undone_too():
    layer = nn.Linear(2, 2)
    weight = layer.weight
    fail_after(lambda c: c.set(layer, "weight", nn.Parameter(torch.zeros(2, 2))), KeyboardInterrupt)
    assert layer.weight is weight


def test_without_a_failure_every_edit_stays():
    layer = nn.Linear(2, 2)
    model = nn.Sequential(layer)
    new = nn.Identity()
    with Change() as change:
        change.set(model, "report", "kept")
        change.copy_(layer.bias, torch.tensor([7.0, 8.0]))
        change.requires_grad(layer.weight, False)
        change.swap(model, {id(layer): new})
    assert model.report == "kept" and model[0] is new
    assert layer.bias.tolist() == [7.0, 8.0] and not layer.weight.requires_grad
