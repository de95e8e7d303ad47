"""ggml's importance-weighted block quantizers bit for bit: what ``llama-quantize --imatrix`` does.

With an importance matrix (``quant_weights``: one float per input column of a matrix, llama.cpp's
per-column mean of squared activations) ggml's ``quantize_<type>`` (``ggml/src/ggml-quants.c`` of
the llama.cpp vendored by llama-cpp-python 0.3.36) runs a weighted search per row instead of the
reference quantizer:

* Q4_0 / Q5_0 (``quantize_row_q4_0_impl``, ``_q5_0_impl``): ``make_qx_quants`` (nmax 8 / 16) on
  each block of 32 with weights ``imatrix * sqrt(sigma2 + x*x)``, ``sigma2`` the mean of ``x*x``
  over the whole row.
* Q4_1 / Q5_1: ``make_qkx3_quants`` (nmax 15 / 31, rmin -0.9, rdelta 0.05, 36 steps) with the
  same weights: a scale and a min per block.
* Q4_K / Q5_K (``quantize_row_q4_K_impl``, ``_q5_K_impl``): ``make_qkx3_quants`` per sub-block of
  32 with weights ``imatrix * sqrt(sigma2 + x*x)``, ``sigma2 = 2 * sum(x*x) / 256`` over the
  super-block; then the 8 sub-block scales and mins are quantized to 6 bits by ``make_qp_quants``
  weighted by each sub-block's summed weights, and the codes are requantized under them.
* Q6_K: ``make_qx_quants`` (nmax 32) per sub-block of 16 weighted by the importance itself.
* Q8_0 and MXFP4 ignore the importance (``quantize_q8_0`` / ``quantize_mxfp4`` discard it): so
  does mixle (``Grid.importance == "ignored"``). Other grids have no weighted search in ggml and
  refuse one.

Each search is a ``WeightedSearch`` record (``mixle.core.grids``) that the grid record holds
(``Grid.weighted``, ``mixle.gguf.formats``); ``mixle.core.grids.run_weighted`` runs it.

``make_qkx3_quants`` with weights given is ``make_qkx2_quants`` (``mixle.gguf.ggml_kquants``)
with other search constants, and ``make_qx_quants`` with weights is the same search as without
(``make_qx_quants_rmse1``); both are reused. Everything is float32 in C's operation order and runs
on numpy arrays and torch tensors through the same code (``c_ops``), giving the same bits.
"""

import numpy as np

from mixle.core.c_arith import c_ops, float_blocks, ieee, nearest_int, running_max, seq_sum, to_half
from mixle.core.grids import WeightedSearch
from mixle.gguf.ggml_kquants import (
    GROUP_MAX_EPS,
    QK_K,
    k_fields,
    make_qkx2_quants,
    make_qx_quants_rmse1,
    q6_k_fields,
)
from mixle.gguf.ggml_quants import AffineFields, ScaleFields

__all__ = ["make_qp_quants"] + [f"{name}_WEIGHTED" for name in ("Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K")]


def _row_sigma2(o, xb):
    """``sum_x2 / n_per_row`` over each whole row of the blocks ``xb`` (..., n_blocks, 32), in order."""
    rows = xb.reshape(tuple(xb.shape[:-2]) + (xb.shape[-2] * xb.shape[-1],))
    return o.divide(seq_sum(o, rows * rows), o.c(float(rows.shape[-1])))


def _block_weights(o, xb, qw, sigma2):
    """``qw * sqrtf(sigma2 + x*x)`` per element of the blocks ``xb``."""
    return qw * o.sqrt(sigma2[..., None] + o.rounded(xb * xb))


@ieee
def _symmetric(x, qw, nmax):
    """``quantize_row_q4_0_impl`` (nmax 8) / ``_q5_0_impl`` (nmax 16): ScaleFields, codes l + nmax."""
    o, xb = float_blocks(x, 32)
    w = _block_weights(o, xb, _blocked(o, qw, xb), _row_sigma2(o, xb)[..., None])
    d, levels = make_qx_quants_rmse1(o, xb, nmax, qw=w)
    return ScaleFields(o.to_named(levels, "uint8"), to_half(o, d))


@ieee
def _affine(x, qw, nmax):
    """``quantize_row_q4_1_impl`` (nmax 15) / ``_q5_1_impl`` (nmax 31): AffineFields."""
    o, xb = float_blocks(x, 32)
    w = _block_weights(o, xb, _blocked(o, qw, xb), _row_sigma2(o, xb)[..., None])
    d, the_min, levels = make_qkx2_quants(o, xb, w, nmax, -0.9, 0.05, 36)
    return AffineFields(o.to_named(levels, "uint8"), to_half(o, d), to_half(o, -the_min))


def _blocked(o, qw, xb):
    """The importance (..., n) as float32 blocks shaped like ``xb``."""
    qw = o.to_named(qw, "float32")
    return qw.reshape(tuple(qw.shape[:-1]) + tuple(xb.shape[-2:]))


def make_qp_quants(o, x, qw, nmax):
    """ggml's ``make_qp_quants`` on groups ``x`` (S, n) of non-negative values with weights ``qw``.

    Returns ``(scale, L)``: float32 (S,) and int32 codes 0..nmax (S, n). The 8 trial scales are
    chosen in C's order; the 5 passes of single-code changes run in full (a pass that changes
    nothing leaves every later pass unchanged too, as C's early exit does).

    >>> s, L = make_qp_quants(c_ops(np.zeros(1)), np.array([[1.0, 0.5, 0.25]], np.float32), np.ones((1, 3), np.float32), 63)
    >>> float(s[0]), L.tolist()
    (0.01581253483891487, [[63, 32, 16]])
    """
    mx = running_max(o, x)
    zero = mx < o.c(GROUP_MAX_EPS)
    iscale = o.divide(o.c(float(nmax)), mx)
    levels = nearest_int(o, iscale[..., None] * x) & 0xFF  # stored to uint8_t
    best = _qp_error(o, x, qw, o.divide(o.c(1.0), iscale), levels)
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        trial = o.divide(o.c(0.1) * o.c(float(step)) + o.c(float(nmax)), mx)
        cur = _qp_error(o, x, qw, o.divide(o.c(1.0), trial),
                        o.clip(nearest_int(o, trial[..., None] * x), -(2**31), nmax))
        take = cur < best
        best = o.where(take, cur, best)
        iscale = o.where(take, trial, iscale)
    levels = o.clip(nearest_int(o, iscale[..., None] * x), -(2**31), nmax)
    wx = qw * x
    lf = o.to_named(levels, "float32")
    sumlx, suml2 = seq_sum(o, wx * lf), seq_sum(o, (qw * lf) * lf)
    levels = levels & 0xFF
    for _ in range(5):
        for i in range(x.shape[-1]):
            w, old = qw[..., i], o.to_named(levels[..., i], "float32")
            slx, sl2 = sumlx - o.rounded(wx[..., i] * old), suml2 - o.rounded((w * old) * old)
            new = o.clip(nearest_int(o, o.divide(x[..., i] * sl2, slx)), -(2**31), nmax)
            nf = o.to_named(new, "float32")
            slx_new, sl2_new = slx + o.rounded(wx[..., i] * nf), sl2 + o.rounded((w * nf) * nf)
            take = (slx > 0) & (sl2 > 0) & (new != levels[..., i])
            take = take & ((slx_new * slx_new) * suml2 > (sumlx * sumlx) * sl2_new)
            levels = o.assign(levels, i, o.where(take, new & 0xFF, levels[..., i]))
            sumlx = o.where(take, slx_new, sumlx)
            suml2 = o.where(take, sl2_new, suml2)
    scale = o.where(suml2 > 0, o.divide(sumlx, suml2), o.zeros(sumlx))
    return o.where(zero, o.zeros(scale), scale), o.where(zero[..., None], o.zeros(levels, "int32"), levels)


def _qp_error(o, x, qw, scale, levels):
    """``sum w * diff * diff`` with ``diff = x - scale * l``, summed in order."""
    diff = x - o.rounded(scale[..., None] * o.to_named(levels, "float32"))
    return seq_sum(o, (qw * diff) * diff)


@ieee
def _k_weighted(x, qw, nmax):
    """``quantize_row_q4_K_impl`` (nmax 15) / ``_q5_K_impl`` (nmax 31): KFields."""
    o, xb = float_blocks(x, QK_K)
    xs = xb.reshape(tuple(xb.shape[:-1]) + (8, 32))
    sigma2 = o.divide(o.c(2.0) * seq_sum(o, xb * xb), o.c(float(QK_K)))
    qs = _blocked(o, qw, xb).reshape(tuple(qw.shape[:-1]) + tuple(xs.shape[-3:]))
    w = qs * o.sqrt(sigma2[..., None, None] + o.rounded(xs * xs))
    sw = seq_sum(o, w)
    scales, mins, levels = make_qkx2_quants(o, xs, w, nmax, -0.9, 0.05, 36)
    d_block, ls = make_qp_quants(o, scales, sw, 63)
    m_block, lm = make_qp_quants(o, mins, sw, 63)
    ls, lm = o.clip(ls, 0, 63), o.clip(lm, 0, 63)  # Q5_K's MIN(63, .); Q4_K's codes never pass 63
    return k_fields(o, xb, xs, levels, ls, lm, to_half(o, d_block), to_half(o, m_block), nmax)


@ieee
def _q6_k_weighted(x, qw):
    """``quantize_row_q6_K_impl``: Q6KFields."""
    o, xb = float_blocks(x, QK_K)
    xs = xb.reshape(tuple(xb.shape[:-1]) + (16, 16))
    qs = _blocked(o, qw, xb).reshape(tuple(qw.shape[:-1]) + tuple(xs.shape[-3:]))
    scales, levels = make_qx_quants_rmse1(o, xs, 32, qw=qs)
    return q6_k_fields(o, xb, xs, scales, levels)


Q4_0_WEIGHTED = WeightedSearch(lambda x, qw: _symmetric(x, qw, 8), (("codes", "codes"), ("scale", "d")), -8)
Q5_0_WEIGHTED = WeightedSearch(lambda x, qw: _symmetric(x, qw, 16))
Q4_1_WEIGHTED = WeightedSearch(lambda x, qw: _affine(x, qw, 15))
Q5_1_WEIGHTED = WeightedSearch(lambda x, qw: _affine(x, qw, 31))
Q4_K_WEIGHTED = WeightedSearch(lambda x, qw: _k_weighted(x, qw, 15))
Q5_K_WEIGHTED = WeightedSearch(lambda x, qw: _k_weighted(x, qw, 31))
Q6_K_WEIGHTED = WeightedSearch(_q6_k_weighted)
