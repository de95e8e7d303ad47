"""No host synchronisation in the QAT forward and backward of tensors the host cannot read.

On an accelerator, reading a value on the host (``.item()``, ``bool()``, ``torch.equal``,
``.tolist()``, ``torch.unique``, a ``torch.tensor(value, device=...)`` copy) stalls the host until
the device catches up. This CPU-only torch cannot run CUDA, so the accelerator route is checked
three ways: under ``FakeTensorMode`` with CPU fake tensors (mixle treats them as unreadable, as
it does CUDA tensors; fake tensors raise on any read of a value, and autograd runs), with a
dispatch mode that records every op that would read back (``SYNC_OPS``); under ``FakeTensorMode``
with CUDA fake tensors (the forward only: autograd aborts without a CUDA device guard); and on
real CPU tensors with the route forced, where the values must equal the CPU route's bit for bit.
"""

import collections
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from mixle.core.array_ops import TorchOps
from mixle.api import apply_qat, convert

transformers_utils = pytest.importorskip("transformers.pytorch_utils")

# Ops that make the host wait for the device: values read back, data-dependent shapes, and
# host-to-device copies of Python data (torch.tensor of a number).
SYNC_OPS = {"aten._local_scalar_dense", "aten.equal", "aten.lift_fresh", "aten.lift_fresh_copy", "aten.nonzero",
            "aten._unique2", "aten.unique_dim", "aten.unique_consecutive", "aten.masked_select", "aten.item"}

GRIDS = {"symmetric": dict(bits=4, group_size=32), "qwix": dict(bits=4, group_size=32, grid="qwix"),
         "q4_0": dict(bits=4, grid="q4_0"), "q8_0": dict(bits=8, grid="q8_0")}


class SyncCounter(TorchDispatchMode):
    """Counts the ``SYNC_OPS`` dispatched (and ``.tolist()`` calls, which bypass the dispatcher)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        if name in SYNC_OPS:
            self.counts[name] += 1
        elif name in ("aten._to_copy", "aten.copy_"):  # a copy between devices
            devices = {t.device.type for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor)}
            if len(devices) > 1 or (kwargs or {}).get("device", None) not in (None, *devices):
                self.counts["cross-device copy"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_syncs():
    counter = SyncCounter()
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        counter.counts["tolist"] += 1
        return tolist(self)

    torch.Tensor.tolist = counted_tolist
    try:
        with counter:
            yield counter.counts
    finally:
        torch.Tensor.tolist = tolist


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(50, 64), nn.Linear(64, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


KINDS = {
    "linear": (lambda: nn.Sequential(nn.Linear(64, 64)), lambda: (torch.randn(4, 64),)),
    "conv1d_hf": (lambda: nn.Sequential(transformers_utils.Conv1D(64, 64)), lambda: (torch.randn(4, 64),)),
    "embedding_tied": (TiedLM, lambda: (torch.randint(0, 50, (4, 6)),)),
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(32, 64, 3)), lambda: (torch.randn(2, 32, 10),)),
    "conv2d": (lambda: nn.Sequential(nn.Conv2d(32, 64, 3)), lambda: (torch.randn(2, 32, 6, 6),)),
    "mha": (lambda: nn.MultiheadAttention(64, 4), lambda: (torch.randn(5, 2, 64),) * 3),
}


# The kinds whose QAT layer honours act_bits and learned scales (the others refuse them).
ACTIVATION_KINDS = ("linear", "embedding_tied")


def act8(kind):
    return dict(act_bits=8) if kind in ACTIVATION_KINDS else {}


def options(grid, kind):
    """Every option on this grid that the kind honours: plain, act_bits, learned scales, clipping."""
    yield {}
    if kind in ACTIVATION_KINDS:
        yield dict(act_bits=8)
    if grid in ("symmetric", "qwix"):
        if kind in ACTIVATION_KINDS:
            yield dict(scale="learned")
        yield dict(clip_percentile=99.0, clip_gradient=True)


def output(model, inputs):
    out = model(*inputs)
    return out[0] if isinstance(out, tuple) else out


def steps(model, make_inputs):
    """Two forward+backward passes (the second reuses the cache on the CPU route) and an eval
    forward; returns the last training output and the gradients."""
    for _ in range(2):
        for p in model.parameters():
            p.grad = None
        out = output(model, make_inputs())
        out.float().square().mean().backward()
    with torch.no_grad():
        output(model, make_inputs())
    return out.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("grid", GRIDS)
def test_unreadable_tensors_train_without_a_sync(kind, grid):
    build, make_inputs = KINDS[kind]
    found = {}
    with FakeTensorMode():
        for extra in options(grid, kind):
            torch.manual_seed(0)
            model = apply_qat(build(), **GRIDS[grid], **extra)
            with counting_syncs() as counts:
                steps(model, make_inputs)
            found[str(extra)] = dict(counts)
    assert all(not counts for counts in found.values()), found


@pytest.mark.parametrize("grid", GRIDS)
def test_cuda_fake_tensors_run_the_qat_forward(grid):
    """Every layer kind moved to (fake) CUDA: no CPU-only branch is taken and nothing reads back.
    (Converted layers run core's int4 unpacking, which this CPU-only build cannot fake on CUDA:
    they are checked on the forced device route below.)"""
    models = {}
    for kind, (build, make_inputs) in KINDS.items():
        torch.manual_seed(0)
        models[kind] = (apply_qat(build(), **GRIDS[grid], **act8(kind)), make_inputs())
    with FakeTensorMode(allow_non_fake_inputs=True), counting_syncs() as counts, torch.no_grad():
        for kind, (model, inputs) in models.items():
            inputs = [torch.empty_like(t, device="cuda") for t in inputs]
            assert output(model.to_empty(device="cuda"), inputs).device.type == "cuda", kind
    assert not counts, dict(counts)


def test_converted_layers_run_without_a_sync_on_the_device_route(monkeypatch):
    converted = {}
    for kind, (build, make_inputs) in KINDS.items():
        torch.manual_seed(0)
        converted[kind] = (convert(apply_qat(build(), grid="q4_0", **act8(kind))), make_inputs())
    monkeypatch.setattr(TorchOps, "readable", lambda self, x: False)
    with counting_syncs() as counts, torch.no_grad():
        for kind, (model, inputs) in converted.items():
            output(model, inputs)
    assert not counts, dict(counts)


@pytest.fixture
def device_route(monkeypatch):
    """Real CPU tensors taken as unreadable: the accelerator's code path, with values to compare."""
    monkeypatch.setattr(TorchOps, "readable", lambda self, x: False)


def run_both_routes(monkeypatch, build, make_inputs, fields):
    results = []
    for unreadable in (False, True):
        if unreadable:
            monkeypatch.setattr(TorchOps, "readable", lambda self, x: False)
        torch.manual_seed(0)
        model = apply_qat(build(), **fields)
        torch.manual_seed(1)
        with counting_syncs() as counts:
            results.append((steps(model, make_inputs), dict(counts)))
    return results


@pytest.mark.parametrize("grid", GRIDS)
def test_the_device_route_computes_the_cpu_route_values(monkeypatch, grid):
    for kind in ("linear", "embedding_tied", "mha"):
        build, make_inputs = KINDS[kind]
        for extra in options(grid, kind):
            (host, _), (device, counts) = run_both_routes(monkeypatch, build, make_inputs, {**GRIDS[grid], **extra})
            monkeypatch.undo()
            assert not counts, (kind, extra, counts)
            assert torch.equal(host[0], device[0]), (kind, extra)
            assert all(torch.equal(a, b) for a, b in zip(host[1], device[1])), (kind, extra)


def test_a_nan_weight_is_a_device_assert_on_the_device_route(device_route):
    model = apply_qat(nn.Sequential(nn.Linear(64, 8)), bits=4)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="weight contains NaN or infinity"):
        model(torch.randn(2, 64))


def test_a_float16_overflowing_scale_is_a_device_assert_on_the_device_route(device_route):
    model = apply_qat(nn.Sequential(nn.Linear(64, 8)), grid="q4_0")
    with torch.no_grad():
        model[0].weight[0, 0] = 1e9
    with pytest.raises(RuntimeError, match="a block scale does not fit float16.*rescale them or use another grid"):
        model(torch.randn(2, 64))


def test_a_bad_embedding_index_is_a_device_assert_on_the_device_route(device_route):
    converted = convert(apply_qat(TiedLM(), bits=4))
    with pytest.raises(RuntimeError, match="QuantizedEmbedding: an index lies outside the table's"):
        converted.emb(torch.tensor([[0, 50]]))


def test_embedding_max_norm_renormalises_each_row_on_the_device_route(monkeypatch):
    layer = nn.Embedding(20, 8, max_norm=1.0)
    converted = convert(apply_qat(nn.Sequential(layer), bits=8, opt_in=("embedding",)))
    ids = torch.tensor([[3, 3, 7, 1]])
    with torch.no_grad():
        expected = converted(ids)
        monkeypatch.setattr(TorchOps, "readable", lambda self, x: False)
        with counting_syncs() as counts:
            got = converted(ids)
    assert not counts
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_a_grid_with_its_own_block_numerics_plugs_into_the_fake_quant(monkeypatch):
    """``fake_quant.BLOCK_NUMERICS`` is where a grid with its own block numerics (llama.cpp's
    K-quants) plugs in: forward, the backward rebuild and the device route all use it."""
    from mixle.torch_backend import fake_quant

    calls = []

    def numerics(x, spec):
        calls.append(x.dtype)
        return torch.round(x * 64) / 64

    monkeypatch.setitem(fake_quant.BLOCK_NUMERICS, "q8_0", numerics)
    torch.manual_seed(0)
    model = apply_qat(nn.Sequential(nn.Linear(64, 8)), grid="q8_0").bfloat16()
    x = torch.randn(3, 64).bfloat16().requires_grad_()
    out = model(x)
    assert calls == [torch.float32]  # the numerics run in float32
    assert torch.equal(out, F.linear(x, numerics(model[0].weight.float(), None).bfloat16(), model[0].bias))
    calls.clear()
    out.float().sum().backward()
    assert calls == [torch.float32]  # the backward's rebuild
