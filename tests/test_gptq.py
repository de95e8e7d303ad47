"""GPTQ (mixle.gptq_quantize, mixle.core.gptq) against an independent numpy GPTQ, and its point:
a lower layer output error than round-to-nearest on the same grid."""

import os

import numpy as np
import pytest
import torch
from torch import nn

import mixle
from mixle.core.gptq import gptq_quantize_weight
from mixle.core.numerics import quantize_array
from mixle.core.spec import QuantSpec


def reference_gptq(w, h, group, qmax, damp=0.01):
    """Textbook GPTQ, one column at a time with the full update (no lazy batches), symmetric grid:
    scale = float32(absmax of the compensated group) / qmax, codes round-half-even, clipped."""
    w, h = w.astype(np.float64), h.astype(np.float64).copy()
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * np.mean(np.diag(h)) * np.eye(len(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: inv(h) = u.T @ u
    codes, scales, before = np.zeros(w.shape, np.int64), [], np.zeros(w.shape)
    for j in range(w.shape[1]):
        if j % group == 0:
            scale = np.abs(w[:, j:j + group].astype(np.float32)).max(1) / np.float32(qmax)
            scales.append(scale)
        before[:, j] = w[:, j].astype(np.float32) / scale
        codes[:, j] = np.clip(np.round(before[:, j]), -qmax, qmax)
        err = (w[:, j] - codes[:, j] * scale.astype(np.float64)) / u[j, j]
        w[:, j:] -= np.outer(err, u[j, j:])
    return codes, np.stack(scales, 1), before


def correlated_inputs(rng, rows, cols):
    mix = rng.standard_normal((cols, cols)) / np.sqrt(cols) + np.eye(cols)
    return (rng.standard_normal((rows, cols)) @ mix).astype(np.float32)


@pytest.mark.parametrize("group, block_size", [(32, 128), (16, 40), (64, 64)])
def test_matches_independent_numpy_gptq(group, block_size):
    rng = np.random.default_rng(group)
    x = correlated_inputs(rng, 256, 128)
    x[:, 5] = 0.0  # a dead input column
    w = rng.standard_normal((24, 128)).astype(np.float32)
    h = x.astype(np.float64).T @ x
    q = gptq_quantize_weight(w, h, QuantSpec(bits=4, group_size=group), block_size=block_size)
    codes, scales, before = reference_gptq(w, h, group, 7)
    np.testing.assert_allclose(q.scale.reshape(scales.shape), scales, rtol=1e-6)
    differ = q.codes != codes
    # The lazy batches sum the same float64 updates in another order: a code may differ only where
    # the value before rounding sits at a rounding boundary (half-integer) to float64 rounding.
    assert differ.sum() <= 2 and np.all(np.abs(np.abs(before[differ]) % 1 - 0.5) < 1e-6)
    assert np.all(q.codes[:, 5] == 0)


@pytest.mark.parametrize("spec", [QuantSpec(bits=4, group_size=32), QuantSpec(bits=4), QuantSpec(grid="q4_0"),
                                  QuantSpec(bits=8, grid="qwix", granularity="tensor"), QuantSpec(grid="q8_0")])
def test_uncorrelated_inputs_give_round_to_nearest(spec):
    """H = I: no compensation, so the codes and scales are quantize_array's bit for bit (the same grid)."""
    w = np.random.default_rng(1).standard_normal((6, 64)).astype(np.float32)
    q, rtn = gptq_quantize_weight(w, np.eye(64), spec), quantize_array(w, spec)
    np.testing.assert_array_equal(q.codes, rtn.codes)
    np.testing.assert_array_equal(q.scale, rtn.scale)


@pytest.mark.parametrize("spec", [QuantSpec(bits=4, group_size=32), QuantSpec(grid="q4_0")])
def test_output_error_below_round_to_nearest(spec):
    rng = np.random.default_rng(3)
    x = correlated_inputs(rng, 512, 64)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    q = gptq_quantize_weight(w, x.astype(np.float64).T @ x, spec)
    err = lambda deq: np.linalg.norm(x @ w.T - x @ np.asarray(deq).T)
    gptq, rtn = err(q.dequantize()), err(quantize_array(w, spec).dequantize())
    assert gptq < 0.8 * rtn, (gptq, rtn)


def tiny_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))


def test_model_layer_by_layer_and_converted_paths(tmp_path):
    net, batches = tiny_net(), [torch.from_numpy(correlated_inputs(np.random.default_rng(i), 64, 64)) for i in range(2)]
    before = {k: v.clone() for k, v in net.state_dict().items()}
    q = mixle.gptq_quantize(net, batches, bits=4, group_size=32)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())  # the user's model is untouched
    x = torch.cat(batches)
    # sequential: layer 2 from the inputs through GPTQ's layer 0
    h0 = x.double().T @ x.double()
    a = torch.nn.functional.gelu(x @ q[0].dequantized_weight().T + net[0].bias).detach()
    h2 = a.double().T @ a.double()
    for layer, h in ((0, h0), (2, h2)):
        expected = gptq_quantize_weight(net[layer].weight.detach().numpy(), h.numpy(), q[layer].spec)
        np.testing.assert_array_equal(q[layer].quantized_array().codes.numpy(), expected.codes)
    rtn = mixle.quantize_model(net, bits=4, group_size=32)
    assert mixle.model_nbytes(q).total == mixle.model_nbytes(rtn).total
    assert not torch.equal(q[0].codes, rtn[0].codes)
    path = os.path.join(tmp_path, "g.safetensors")
    mixle.save_quantized(q, path)
    loaded = mixle.load_quantized(path, tiny_net())
    assert torch.equal(loaded(x), q(x))


def test_q4_0_writes_gguf(tmp_path):
    """grid="q4_0": llama.cpp's grid and scale rule, so save_gguf writes GPTQ's blocks as they are."""
    pytest.importorskip("gguf")
    from mixle.lm.transformer import build_causal_lm

    torch.manual_seed(0)
    lm = build_causal_lm(vocab=40, d_model=32, n_layer=1, n_head=2, block=16, activation="gelu_tanh")
    q = mixle.gptq_quantize(lm, [torch.randint(0, 40, (8, 16))], grid="q4_0")
    rtn = mixle.quantize_model(lm, grid="q4_0")
    assert not torch.equal(q.blocks[0].fc.codes, rtn.blocks[0].fc.codes)
    assert torch.equal(q.head.codes, rtn.head.codes)  # tied="round": the tied head keeps its codes
    path = os.path.join(tmp_path, "m.gguf")
    mixle.save_gguf(q, path)
    back = mixle.load_gguf_weights(lm, path)
    for name in ("qkv", "proj", "fc", "out"):
        assert torch.equal(getattr(back.blocks[0], name).weight, getattr(q.blocks[0], name).dequantized_weight())


def test_refusals():
    net, batches = tiny_net(), [torch.randn(16, 64)]
    with pytest.raises(ValueError, match="grid='q4_k'"):
        mixle.gptq_quantize(net, batches, grid="q4_k")
    with pytest.raises(ValueError, match="act_bits"):
        mixle.gptq_quantize(net, batches, bits=4, act_bits=8)
    with pytest.raises(ValueError, match="no calibration batch reached layer 'unused'"):
        mixle.gptq_quantize(Skips(), batches, bits=4)
    with pytest.raises(ValueError, match="damp"):
        mixle.gptq_quantize(net, batches, damp=0)
    with pytest.raises(TypeError, match="wrap it in a list"):
        mixle.gptq_quantize(net, torch.randn(16, 64))
    with pytest.raises(ValueError, match="opt_in"):
        mixle.gptq_quantize(nn.Sequential(nn.Embedding(10, 64)), [torch.randint(0, 10, (2, 8))], opt_in=("embedding",))
    mha = nn.Sequential(nn.MultiheadAttention(64, 2))
    with pytest.raises(ValueError, match="not an nn.Linear"):
        mixle.gptq_quantize(mha, batches, bits=4)


class Skips(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(64, 8), nn.Linear(64, 8)

    def forward(self, x):
        return self.used(x)
