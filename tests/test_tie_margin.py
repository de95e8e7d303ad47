"""``pull_toward_stored`` (``--tie-margin``): weights on Q4_0's rounding ties move inside PTQ's bin, what the
layer stores stays the same, and a small step against PTQ's choice no longer flips them. Checked against
llama.cpp's Q4_0 rule written in numpy, for the torch and the Flax backend (the same pulled weights)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mixle.api import apply_qat, pull_toward_stored  # noqa: E402
from mixle.lm.finetune_config import FinetuneConfig  # noqa: E402

MARGIN = 0.25  # a power of two: the pulled values are exact in float32, in any order of the two operations


def tied_rows():
    """Two Q4_0 blocks whose scale is 1 (the largest magnitude is -8) and whose other 31 values are ties k + 1/2."""
    ties = np.arange(-8, 7, dtype=np.float32) + np.float32(0.5)
    row = np.concatenate([[-8.0], np.resize(ties, 31)]).astype(np.float32)
    return np.stack([row, -row[::-1] * 0.5]).astype(np.float32)  # the second: scale 1/2 (max 4 at the end)


def q4_0(x):
    """llama.cpp's quantize_row_q4_0_ref then dequantize, per block of 32."""
    blocks = x.reshape(-1, 32)
    peak = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(1)]
    d = (peak / np.float32(-8)).astype(np.float32)[:, None]
    inverse = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    codes = np.minimum(15, np.trunc(blocks * inverse + np.float32(8.5))).astype(np.int8)
    return ((codes - 8).astype(np.float32) * d).reshape(x.shape)


def _torch_layer(rows):
    layer = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(rows))
    return apply_qat(torch.nn.Sequential(layer), grid="q4_0")


def test_ties_move_a_margin_inside_ptqs_bin_and_what_is_stored_stays():
    rows = tied_rows()
    stored = q4_0(rows)
    scale = np.repeat(np.abs(rows.reshape(-1, 32)).max(1) / 8, 32).reshape(rows.shape)
    assert np.count_nonzero(np.abs(rows - stored) == scale / 2) == 62  # on ties: all but each block's peak
    net = _torch_layer(rows)
    assert np.array_equal(net[0].quantized_weight().detach().numpy(), stored)
    moved = pull_toward_stored(net, MARGIN)
    assert moved == {"margin": MARGIN, "weights": 64, "layers": 1, "kept": []}
    pulled = net[0].weight.detach().numpy()
    assert np.array_equal(pulled, rows + np.float32(MARGIN) * (stored - rows))
    assert np.array_equal(net[0].quantized_weight().detach().numpy(), stored)
    # A step of a tenth of the scale against PTQ's choice, for every weight: ties flip without the margin.
    against = np.float32(0.1) * scale * -np.sign(stored - rows)
    assert np.array_equal(q4_0(pulled + against), stored)
    assert np.count_nonzero(q4_0(rows + against) != stored) == 62


def test_zero_changes_nothing_and_a_bad_margin_is_refused():
    net = _torch_layer(tied_rows())
    assert pull_toward_stored(net, 0)["weights"] == 0
    assert np.array_equal(net[0].weight.detach().numpy(), tied_rows())
    for bad in (1.0, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match="margin=.* must be a number in \\[0, 1\\)"):
            pull_toward_stored(net, bad)
        with pytest.raises(ValueError, match="tie_margin=.* must be in \\[0, 1\\)"):
            FinetuneConfig(model="m", out="o", tie_margin=bad)
    assert np.array_equal(net[0].weight.detach().numpy(), tied_rows())


def test_a_failure_part_way_leaves_every_weight_as_it_was():
    rows = tied_rows()
    net = _torch_layer(rows)
    second = torch.nn.Linear(32, 2, bias=False)
    net = apply_qat(torch.nn.Sequential(net[0], second), grid="q4_0")
    untouched = second.weight.detach().clone()

    def broken():
        raise RuntimeError("quantizer failed")

    net[1].quantized_weight = broken
    with pytest.raises(RuntimeError, match="quantizer failed"):
        pull_toward_stored(net, MARGIN)
    assert np.array_equal(net[0].weight.detach().numpy(), rows)  # moved first, then put back
    assert torch.equal(net[1].weight, untouched)


def test_flax_pulls_the_same_weights_as_torch():
    pytest.importorskip("qwix")
    jax = pytest.importorskip("jax")
    from flax import nnx

    rows = tied_rows()
    net = nnx.Linear(32, 2, use_bias=False, rngs=nnx.Rngs(0))
    net.kernel[...] = jax.numpy.asarray(rows.T)
    apply_qat(net, grid="q4_0", example_inputs=(jax.numpy.ones((1, 32)),))
    assert pull_toward_stored(net, MARGIN) == {"margin": MARGIN, "weights": 64, "layers": 1, "kept": []}
    torch_net = _torch_layer(rows)
    pull_toward_stored(torch_net, MARGIN)
    assert np.array_equal(np.asarray(net.kernel[...]).T, torch_net[0].weight.detach().numpy())
    with pytest.raises(ValueError, match="needs a model wrapped by apply_qat"):
        pull_toward_stored(nnx.Linear(32, 2, rngs=nnx.Rngs(0)), MARGIN)
