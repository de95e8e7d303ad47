"""quantize_linear/conv/embedding_weight against a per-slice numpy loop, for every axis-count option."""

import itertools
import math

import numpy as np
import pytest
import torch

from mixle.task.quantize import (
    QuantizedArray,
    QuantSpec,
    quantize_conv_weight,
    quantize_embedding_weight,
    quantize_linear_weight,
)


def loop_reference(w, n_batch, n_out, bits, granularity, group_size=None, grid="symmetric"):
    """Codes and scales by visiting every (batch, output) slice in a Python loop.

    Each slice holds the inputs of one output channel; its scale is max|slice| / qmax (qmax + 0.5
    on the qwix grid), per group_size consecutive inputs for group granularity, or one scale per
    batch element for tensor granularity. Scales come out in (batch, output, group) order.
    """
    qmax = 2 ** (bits - 1) - 1
    lowest = -qmax if grid == "symmetric" else -qmax - 1
    divisor = np.float32(qmax if grid == "symmetric" else qmax + 0.5)
    codes = np.zeros(w.shape, np.int8)
    scales = []
    for b in itertools.product(*[range(d) for d in w.shape[:n_batch]]):
        batch_scales = []
        outs = list(itertools.product(*[range(d) for d in w.shape[n_batch : n_batch + n_out]]))
        if granularity == "tensor":
            whole = w[b]
            s = np.abs(whole).max() / divisor
            s = np.float32(1.0) if s == 0 else s
            codes[b] = np.clip(np.rint(whole / s), lowest, qmax)
            scales.append([s])
            continue
        for o in outs:
            row = w[b + o].reshape(-1)
            size = group_size if granularity == "group" else row.size
            row_codes = []
            for start in range(0, row.size, size):
                chunk = row[start : start + size]
                s = np.abs(chunk).max() / divisor
                s = np.float32(1.0) if s == 0 else s
                row_codes.append(np.clip(np.rint(chunk / s), lowest, qmax))
                batch_scales.append(s)
            codes[b + o] = np.concatenate(row_codes).reshape(w[b + o].shape)
        scales.append(batch_scales)
    return codes, np.array(scales, np.float32)[..., None]


def weights(shape, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    w.reshape(-1)[: shape[-1]] = 0.0  # an all-zero slice: scale 1, codes 0
    return w


def check(q, w, n_batch, n_out, spec, library):
    codes, scales = loop_reference(w, n_batch, n_out, spec.bits, spec.granularity, spec.group_size, spec.grid)
    assert isinstance(q, QuantizedArray) and q.spec == spec
    assert (q.batch_ndim, q.out_ndim) == (n_batch, n_out)
    if library == "torch":
        assert q.codes.dtype == torch.int8 and q.scale.dtype == torch.float32
        got_codes, got_scales = q.codes.numpy(), q.scale.numpy()
    else:
        assert q.codes.dtype == np.int8 and q.scale.dtype == np.float32
        got_codes, got_scales = q.codes, q.scale
    np.testing.assert_array_equal(got_codes, codes)
    np.testing.assert_array_equal(got_scales, scales)
    deq = q.dequantize()
    deq = deq.numpy() if library == "torch" else deq
    ref = codes.astype(np.float32).reshape(scales.shape[0], scales.shape[1], -1) * scales
    np.testing.assert_array_equal(deq, ref.reshape(w.shape))


SPECS = [
    QuantSpec(bits=4),
    QuantSpec(bits=8),
    QuantSpec(bits=4, granularity="tensor"),
    QuantSpec(bits=4, group_size=8),
    QuantSpec(bits=4, grid="qwix", group_size=8),
    QuantSpec(bits=8, grid="qwix"),
]


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.short())
@pytest.mark.parametrize(
    "shape,input_axis_count,batch_axis_count",
    [((12, 32), 1, 0), ((6, 4, 8), 2, 0), ((3, 6, 16), 1, 1), ((2, 3, 4, 8), 2, 1), ((2, 2, 3, 16), 1, 2)],
)
def test_linear_weight_matches_loop_reference(shape, input_axis_count, batch_axis_count, spec, library):
    w = weights(shape)
    x = torch.from_numpy(w) if library == "torch" else w
    q = quantize_linear_weight(x, spec, input_axis_count=input_axis_count, batch_axis_count=batch_axis_count)
    check(q, w, batch_axis_count, len(shape) - batch_axis_count - input_axis_count, spec, library)


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("spec", [QuantSpec(bits=4), QuantSpec(bits=8, group_size=9), QuantSpec(bits=4, granularity="tensor")],
                         ids=lambda s: s.short())
@pytest.mark.parametrize("shape,output_axis_count", [((8, 3, 3, 3), 1), ((2, 4, 3, 3, 3), 2), ((5, 2, 9), 1)])
def test_conv_weight_matches_loop_reference(shape, output_axis_count, spec, library):
    w = weights(shape, seed=1)
    x = torch.from_numpy(w) if library == "torch" else w
    q = quantize_conv_weight(x, spec, output_axis_count=output_axis_count)
    check(q, w, 0, output_axis_count, spec, library)


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("spec", [QuantSpec(bits=4), QuantSpec(bits=8), QuantSpec(bits=4, group_size=4)],
                         ids=lambda s: s.short())
@pytest.mark.parametrize("shape,vocabulary_axis_count", [((20, 16), 1), ((3, 10, 16), 2)])
def test_embedding_weight_matches_loop_reference(shape, vocabulary_axis_count, spec, library):
    w = weights(shape, seed=2)
    x = torch.from_numpy(w) if library == "torch" else w
    q = quantize_embedding_weight(x, spec, vocabulary_axis_count=vocabulary_axis_count)
    check(q, w, 0, vocabulary_axis_count, spec, library)
    rows = math.prod(shape[:vocabulary_axis_count])
    if spec.granularity == "channel":
        assert q.scale.shape == (1, rows, 1)  # one scale per vocabulary row


def test_spec_fields_as_keywords_equal_a_spec():
    w = weights((6, 8))
    a = quantize_linear_weight(w, bits=4, group_size=4)
    b = quantize_linear_weight(w, QuantSpec(bits=4, group_size=4))
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_array_equal(a.scale, b.scale)


@pytest.mark.parametrize(
    "call,error,words",
    [
        (lambda w: quantize_linear_weight(w, input_axis_count=0), ValueError, "input_axis_count=0"),
        (lambda w: quantize_linear_weight(w, input_axis_count=2), ValueError, "input_axis_count=2"),
        (lambda w: quantize_linear_weight(w, batch_axis_count=1), ValueError, "batch_axis_count=1"),
        (lambda w: quantize_linear_weight(w, input_axis_count=1.0), TypeError, "input_axis_count must be an int"),
        (lambda w: quantize_linear_weight(w, batch_axis_count=True), TypeError, "batch_axis_count must be an int"),
        (lambda w: quantize_linear_weight(w[0]), ValueError, "no output axis"),
        (lambda w: quantize_conv_weight(w, output_axis_count=2), ValueError, "output_axis_count=2"),
        (lambda w: quantize_conv_weight(w[0]), ValueError, "at least 2 axes"),
        (lambda w: quantize_embedding_weight(w, vocabulary_axis_count=0), ValueError, "vocabulary_axis_count=0"),
        (lambda w: quantize_linear_weight(w, group_size=5), ValueError, "group_size=5 does not divide"),
        (lambda w: quantize_linear_weight(w.tolist()), TypeError, "numpy array"),
        (lambda w: quantize_linear_weight(w.astype(np.int8)), TypeError, "floating dtype"),
    ],
)
def test_bad_arguments_are_refused_by_name(call, error, words):
    with pytest.raises(error, match=words):
        call(weights((4, 8)))
