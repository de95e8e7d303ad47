"""ggml's K-quant block quantizers (Q4_K, Q5_K, Q6_K) bit for bit.

Each quantizer follows the operation order of ggml's reference C code without an importance
matrix (``ggml/src/ggml-quants.c`` of the llama.cpp vendored by llama-cpp-python 0.3.36):
float32 throughout, every sum a sequential loop over a block's elements (vectorized across
blocks, never numpy's pairwise or torch's blocked reductions), products and sums grouped as C
groups them, no fused multiply-add (ggml-base is built without FMA code generation). The maths
is written once against the C-arithmetic adapter (``mixle.core.c_arith``) and gives the same
bits on numpy arrays and torch tensors. Inputs are finite float32 rows.

Fields records hold what a block stores: codes as small unsigned ints, sub-block scales and
mins as small ints, super-block scales as float16. ``pack_*`` writes ggml's block bytes (numpy
uint8, shape ``(..., n_blocks * bytes_per_block)`` like ``gguf.quants.quantize``); ``unpack_*``
reads them back.
"""

from typing import NamedTuple

import numpy as np

from mixle.core.c_arith import (
    as_numpy,
    block_rows,
    JaxC,
    NumpyC,
    c_ops,
    first_absmax,
    flat_rows,
    float_blocks,
    half_bytes,
    half_from,
    ieee,
    nearest_int,
    running_max,
    seq_sum,
    to_half,
)

__all__ = [
    "KFields",
    "Q6KFields",
    "quantize_q4_k",
    "dequantize_q4_k",
    "pack_q4_k",
    "unpack_q4_k",
    "quantize_q5_k",
    "dequantize_q5_k",
    "pack_q5_k",
    "unpack_q5_k",
    "quantize_q6_k",
    "dequantize_q6_k",
    "pack_q6_k",
    "unpack_q6_k",
]

QK_K = 256
GROUP_MAX_EPS = 1e-15  # ggml-quants.c: below this a group's max counts as zero


# ---------------------------------------------------------------- the K-quants' scale searches


def make_qkx2_quants(o, x, w, nmax, rmin, rdelta, nstep):
    """ggml's ``make_qkx2_quants`` (use_mad false) on groups ``x`` with weights ``w``, (S, n).

    Returns ``(scale, the_min, L)``: float32 (S,), float32 (S,) and int32 codes (S, n). The
    trials run in C's order, one after another: a trial that wins moves ``min``, which the
    later trials' scales and codes are computed from.

    >>> x = np.linspace(-1, 2, 32, dtype=np.float32)[None]
    >>> scale, the_min, L = make_qkx2_quants(c_ops(np.zeros(0, np.float32)), x, np.ones_like(x), 15, -1.0, 0.1, 20)
    >>> float(scale[0]), float(the_min[0]), L[0, [0, -1]].tolist()
    (0.19354838132858276, 0.9516129493713379, [0, 15])
    """
    x, w = o.leading(x), o.leading(w)  # element-major (n, S): C's running sums read contiguous rows
    if isinstance(o, JaxC):  # the same values (sum_w's first term plus 0: no -0.0 in a sum of weights)
        (mn, mx), sum_w, sum_x = o.min_max(x, axis=0), o.ordered_sum(w, 0), o.ordered_sum(w * x, 0)
    else:
        mn, mx, sum_w, sum_x = x[0], x[0], w[0], w[0] * x[0]
        for i in range(1, x.shape[0]):
            mn = o.where(x[i] < mn, x[i], mn)
            mx = o.where(x[i] > mx, x[i], mx)
            sum_w = sum_w + w[i]
            sum_x = sum_x + w[i] * x[i]
    zero = o.zeros(mn)
    mn = o.where(mn > 0, zero, mn)
    flat, flat_min = mx == mn, mn  # C returns early here: L = 0, scale 0
    iscale = o.divide(o.c(float(nmax)), mx - mn)
    scale = o.divide(o.c(1.0), iscale)
    levels = o.clip(nearest_int(o, iscale * (x - mn)), 0, nmax)
    best_error = _weighted_error(o, w, x, scale, mn, levels)

    def step_trial(step, carry):
        best_error, scale, mn, levels = carry
        trial, this_scale, this_min, cur_error, valid = _qkx2_trial(o, x, w, mn, mx, step, nmax, sum_w, sum_x)
        take = valid & (cur_error < best_error)
        return (o.where(take, cur_error, best_error), o.where(take, this_scale, scale), o.where(take, this_min, mn),
                o.where(take, trial, levels))

    steps = [(o.c(rmin) + o.c(rdelta) * o.c(float(s))) + o.c(float(nmax)) for s in range(nstep + 1)]
    _, scale, mn, levels = _trials(o, steps, step_trial, (best_error, scale, mn, levels))
    levels = o.where(flat, o.zeros(levels, "int32"), levels)
    return o.where(flat, zero, scale), -o.where(flat, flat_min, mn), o.trailing(levels)


def _trials(o, values, body, carry):
    """``carry = body(value, carry)`` for each of ``values`` in order: the scale searches' trials (jax:
    one ``fori_loop`` over them, so XLA compiles one trial instead of one per value)."""
    if isinstance(o, JaxC):
        table = o.xp.stack([o.xp.asarray(v, o.xp.float32) for v in values])
        return o.jax.lax.fori_loop(0, len(values), lambda i, c: body(table[i], c), carry)
    for value in values:
        carry = body(value, carry)
    return carry


def _qkx2_trial(o, x, w, mn, mx, step, nmax, sum_w, sum_x):
    """One trial of ``make_qkx2_quants`` on element-major ``x``, ``w`` (n, S): iscale = step / (max -
    min), then the weighted least squares scale and min of its codes. Returns ``(Laux, scale, min,
    error, D > 0)``."""
    iscale = o.divide(step, mx - mn)
    trial = o.clip(nearest_int(o, iscale * (x - mn)), 0, nmax)
    lt = o.to_named(trial, "float32")
    wl = w * lt
    sum_l, sum_l2, sum_xl = _lead_sum(o, wl), _lead_sum(o, wl * lt), _lead_sum(o, wl * x)
    r = o.rounded
    big_d = r(sum_w * sum_l2) - r(sum_l * sum_l)
    this_scale = o.divide(r(sum_w * sum_xl) - r(sum_x * sum_l), big_d)
    this_min = o.divide(r(sum_l2 * sum_x) - r(sum_l * sum_xl), big_d)
    positive = this_min > 0
    this_min = o.where(positive, o.zeros(this_min), this_min)
    this_scale = o.where(positive, o.divide(sum_xl, sum_l2), this_scale)
    return trial, this_scale, this_min, _weighted_error(o, w, x, this_scale, this_min, trial), big_d > 0


def _weighted_error(o, w, x, scale, mn, levels):
    """``sum w * diff * diff`` with ``diff = scale * L + min - x``, summed in order (element-major)."""
    diff = (o.rounded(scale * o.to_named(levels, "float32")) + mn) - x
    return _lead_sum(o, w * (diff * diff))


def make_qx_quants_rmse1(o, x, nmax, qw=None):
    """ggml's ``make_qx_quants`` with rmse_type 1 on groups ``x`` (S, n): weights ``x * x``, or
    ``qw`` (S, n) where given (the importance-weighted search).

    Returns ``(scale, L)``: float32 (S,) and int32 codes ``l + nmax`` (S, n). The 19 trial
    scales (is = 0, then -9..9 without 0) run in C's order, on the groups laid out element-major
    (``(n, S)``: each of C's running sums is then one pass over contiguous memory).

    >>> scale, L = make_qx_quants_rmse1(c_ops(np.zeros(0, np.float32)), np.linspace(-1, 1, 16, dtype=np.float32)[None], 32)
    >>> float(scale[0]), L[0, [0, -1]].tolist()
    (0.032094523310661316, [1, 63])
    """
    amax, vmax = first_absmax(o, x)
    xl = o.leading(x)
    wl = xl * xl if qw is None else o.leading(qw)
    wx = wl * xl

    def levels_of(numerator):
        return o.clip(nearest_int(o, o.divide(numerator, vmax) * xl), -nmax, nmax - 1)

    def sums(numerator):
        lf = o.to_named(levels_of(numerator), "float32")
        return _lead_sum(o, wx * lf), _lead_sum(o, (wl * lf) * lf)

    # Each block keeps its best trial's numerator, not its codes: a trial then writes no array of
    # the weights' size, and the codes are computed once from it (the same quotients, so the same codes).
    def trial(numerator, carry):
        scale, best, chosen = carry
        sumlx, suml2 = sums(numerator)
        take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = o.where(take, o.divide(sumlx, suml2), scale)
        return scale, o.where(take, scale * sumlx, best), o.where(take, numerator, chosen)

    first = o.c(float(-nmax))  # is = 0
    sumlx, suml2 = sums(first)
    scale = o.where(suml2 != 0, o.divide(sumlx, suml2), o.zeros(sumlx))
    numerators = [-(o.c(float(nmax)) + o.c(0.1) * o.c(float(s))) for s in range(-9, 10) if s]
    scale, _, numerator = _trials(o, numerators, trial, (scale, scale * sumlx, o.zeros(sumlx) + first))
    chosen = levels_of(numerator)
    zero = amax < o.c(GROUP_MAX_EPS)
    chosen = o.where(zero, o.zeros(chosen, "int32") - nmax, chosen)
    return o.where(zero, o.zeros(scale), scale), o.trailing(chosen) + nmax


def _lead_sum(o, terms):
    """``seq_sum`` over the first axis (element-major groups)."""
    if isinstance(o, (JaxC, NumpyC)):
        return o.ordered_sum(terms, 0)
    terms = o.rounded(terms)
    acc = o.c(0.0) + terms[0]
    for i in range(1, terms.shape[0]):
        acc = acc + terms[i]
    return acc


# ------------------------------------------------------------------------- Q4_K and Q5_K


class KFields(NamedTuple):
    """A Q4_K / Q5_K super-block of 256: ``x = d * scales[j] * codes - dmin * mins[j]`` per
    sub-block j of 32.

    Attributes:
        codes: uint8 (..., n_blocks, 256), 0..15 (Q4_K) or 0..31 (Q5_K).
        scales: uint8 (..., n_blocks, 8), 6-bit sub-block scales.
        mins: uint8 (..., n_blocks, 8), 6-bit sub-block mins.
        d: float16 (..., n_blocks), the scales' scale.
        dmin: float16 (..., n_blocks), the mins' scale.
    """

    codes: object
    scales: object
    mins: object
    d: object
    dmin: object


@ieee
def _quantize_k(x, nmax, rmin, nstep):
    """``quantize_row_q4_K_ref`` / ``quantize_row_q5_K_ref``: the shared K-quant recipe."""
    o, xb = float_blocks(x, QK_K)
    xs = xb.reshape(tuple(xb.shape[:-1]) + (8, 32))
    av_x = o.sqrt(o.divide(seq_sum(o, xs * xs), o.c(32.0)))
    w = av_x[..., None] + abs(xs)
    scales, mins, levels = make_qkx2_quants(o, xs, w, nmax, rmin, 0.1, nstep)
    max_scale, max_min = running_max(o, scales), running_max(o, mins)
    zero = o.zeros(max_scale)
    inv_scale = o.where(max_scale > 0, o.divide(o.c(63.0), max_scale), zero)
    inv_min = o.where(max_min > 0, o.divide(o.c(63.0), max_min), zero)
    ls = o.clip(nearest_int(o, inv_scale[..., None] * scales) & 0xFF, 0, 63)  # uint8_t, then MIN(63, .)
    lm = o.clip(nearest_int(o, inv_min[..., None] * mins) & 0xFF, 0, 63)
    d = to_half(o, o.divide(max_scale, o.c(63.0)))
    dmin = to_half(o, o.divide(max_min, o.c(63.0)))
    return k_fields(o, xb, xs, levels, ls, lm, d, dmin, nmax)


def k_fields(o, xb, xs, levels, ls, lm, d, dmin, nmax):
    """The K-quants' last step, shared by the reference and the importance-weighted quantizers:
    the codes requantized under the stored ``d * ls`` and ``dmin * lm`` (a sub-block whose scale
    is zero keeps the search's ``levels``), as KFields."""
    sub_d = o.to_named(d, "float32")[..., None] * o.to_named(ls, "float32")
    sub_m = o.to_named(dmin, "float32")[..., None] * o.to_named(lm, "float32")
    requant = o.clip(nearest_int(o, o.divide(xs + o.rounded(sub_m)[..., None], sub_d[..., None])), 0, nmax)
    levels = o.where((sub_d == 0)[..., None], levels, requant)  # `if (!d) continue;` keeps L
    codes = o.to_named(levels.reshape(tuple(xb.shape)), "uint8")
    return KFields(codes, o.to_named(ls, "uint8"), o.to_named(lm, "uint8"), d, dmin)


@ieee
def _dequantize_k(f):
    """``dequantize_row_q4_K`` / ``_q5_K``: ``(d * sc) * q - (dmin * m)`` per sub-block."""
    o = c_ops(f.codes)
    sub_d = o.to_named(f.d, "float32")[..., None] * o.to_named(f.scales, "float32")
    sub_m = o.to_named(f.dmin, "float32")[..., None] * o.to_named(f.mins, "float32")
    q = o.to_named(f.codes, "float32").reshape(tuple(f.codes.shape[:-1]) + (8, 32))
    # an infinite d stored by a huge block
    y = o.rounded(sub_d[..., None] * q) - o.rounded(sub_m)[..., None]
    return y.reshape(tuple(f.codes.shape[:-2]) + (f.codes.shape[-2] * QK_K,))


def quantize_q4_k(x):
    """ggml's Q4_K (``quantize_row_q4_K_ref``) of x (..., n), n a multiple of 256.

    Args:
        x: float32 numpy array or torch tensor (other floats are cast to float32).

    Returns:
        KFields, arrays of x's library.

    >>> f = quantize_q4_k(np.linspace(-1, 1, 256, dtype=np.float32))
    >>> f.codes.shape, f.scales.tolist()[0], f.mins.tolist()[0]
    ((1, 256), [15, 15, 15, 15, 15, 31, 48, 63], [63, 47, 31, 15, 0, 0, 0, 0])
    """
    return _quantize_k(x, 15, -1.0, 20)


def quantize_q5_k(x):
    """ggml's Q5_K (``quantize_row_q5_K_ref``) of x (..., n), n a multiple of 256.

    Args:
        x: float32 numpy array or torch tensor (other floats are cast to float32).

    Returns:
        KFields, arrays of x's library.

    >>> int(quantize_q5_k(np.linspace(-1, 1, 256, dtype=np.float32)).codes.max())
    31
    """
    return _quantize_k(x, 31, -0.5, 15)


def dequantize_q4_k(fields):
    """float32 values (..., n) of Q4_K fields.

    >>> x = np.linspace(-1, 1, 256, dtype=np.float32)
    >>> float(abs(dequantize_q4_k(quantize_q4_k(x)) - x).max()) < 0.07
    True
    """
    return _dequantize_k(fields)


def dequantize_q5_k(fields):
    """float32 values (..., n) of Q5_K fields.

    >>> x = np.linspace(-1, 1, 256, dtype=np.float32)
    >>> float(abs(dequantize_q5_k(quantize_q5_k(x)) - x).max()) < 0.04
    True
    """
    return _dequantize_k(fields)


def _pack_scales(ls, lm):
    """The 12 scale bytes of a K block (the inverse of ggml's ``get_scale_min_k4``)."""
    low = (ls[..., :4] | ((ls[..., 4:] >> 4) << 6)).astype(np.uint8)
    mid = (lm[..., :4] | ((lm[..., 4:] >> 4) << 6)).astype(np.uint8)
    high = ((ls[..., 4:] & 0xF) | ((lm[..., 4:] & 0xF) << 4)).astype(np.uint8)
    return np.concatenate([low, mid, high], axis=-1)


def _unpack_scales(q):
    """``(scales, mins)`` from the 12 scale bytes (``get_scale_min_k4`` for j = 0..7)."""
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.uint8), mn.astype(np.uint8)


def _nibbles(codes):
    """The 128 qs bytes: per 64 codes, code l in the low nibble of byte l, code l + 32 high."""
    c = codes.reshape(codes.shape[:-1] + (4, 2, 32)).astype(np.uint8)
    return ((c[..., 0, :] & 0xF) | ((c[..., 1, :] & 0xF) << 4)).reshape(codes.shape[:-1] + (128,))


def _from_nibbles(qs):
    """The 256 low nibble codes from the 128 qs bytes (the inverse of ``_nibbles``)."""
    q = qs.reshape(qs.shape[:-1] + (4, 1, 32))
    return np.concatenate([q & 0xF, q >> 4], axis=-2).reshape(qs.shape[:-1] + (256,))


def pack_q4_k(fields):
    """ggml's ``block_q4_K`` bytes (144 per block): d, dmin, scales[12], qs[128].

    >>> pack_q4_k(quantize_q4_k(np.ones(256, np.float32))).shape
    (144,)
    """
    c = [as_numpy(v) for v in fields]
    scales = _pack_scales(c[1].astype(np.uint8), c[2].astype(np.uint8))
    out = np.concatenate([half_bytes(c[3]), half_bytes(c[4]), scales, _nibbles(c[0])], axis=-1)
    return flat_rows(out)


def unpack_q4_k(data):
    """KFields (numpy) from ``block_q4_K`` bytes (..., n_blocks * 144).

    >>> f = quantize_q4_k(np.ones(256, np.float32))
    >>> np.array_equal(unpack_q4_k(pack_q4_k(f)).codes, f.codes)
    True
    """
    b = block_rows(data, 144)
    sc, mn = _unpack_scales(b[..., 4:16])
    return KFields(_from_nibbles(b[..., 16:]), sc, mn, half_from(b[..., 0:2]), half_from(b[..., 2:4]))


def pack_q5_k(fields):
    """ggml's ``block_q5_K`` bytes (176 per block): d, dmin, scales[12], qh[32], qs[128].

    >>> pack_q5_k(quantize_q5_k(np.ones((2, 256), np.float32))).shape
    (2, 176)
    """
    c = [as_numpy(v) for v in fields]
    codes = c[0].astype(np.uint8)
    high = ((codes >> 4) & 1).reshape(codes.shape[:-1] + (8, 32))  # bit j of qh[l]: code 32 j + l
    qh = np.zeros(codes.shape[:-1] + (32,), np.uint8)
    for j in range(8):
        qh |= (high[..., j, :] << j).astype(np.uint8)
    scales = _pack_scales(c[1].astype(np.uint8), c[2].astype(np.uint8))
    out = np.concatenate([half_bytes(c[3]), half_bytes(c[4]), scales, qh, _nibbles(codes)], axis=-1)
    return flat_rows(out)


def unpack_q5_k(data):
    """KFields (numpy) from ``block_q5_K`` bytes (..., n_blocks * 176).

    >>> f = quantize_q5_k(np.ones(256, np.float32))
    >>> np.array_equal(unpack_q5_k(pack_q5_k(f)).codes, f.codes)
    True
    """
    b = block_rows(data, 176)
    sc, mn = _unpack_scales(b[..., 4:16])
    qh = b[..., 16:48]
    high = np.stack([(qh >> j) & 1 for j in range(8)], axis=-2).reshape(qh.shape[:-1] + (256,))
    codes = (_from_nibbles(b[..., 48:]) | (high << 4)).astype(np.uint8)
    return KFields(codes, sc, mn, half_from(b[..., 0:2]), half_from(b[..., 2:4]))


# ---------------------------------------------------------------------------------- Q6_K


class Q6KFields(NamedTuple):
    """A Q6_K super-block of 256: ``x = d * scales[j] * (codes - 32)`` per sub-block j of 16.

    Attributes:
        codes: uint8 (..., n_blocks, 256), 0..63 (the stored ``l + 32``).
        scales: int8 (..., n_blocks, 16), sub-block scales.
        d: float16 (..., n_blocks), the scales' scale.
    """

    codes: object
    scales: object
    d: object


@ieee
def quantize_q6_k(x):
    """ggml's Q6_K (``quantize_row_q6_K_ref``) of x (..., n), n a multiple of 256.

    Args:
        x: float32 numpy array or torch tensor (other floats are cast to float32).

    Returns:
        Q6KFields, arrays of x's library.

    >>> f = quantize_q6_k(np.linspace(-1, 1, 256, dtype=np.float32))
    >>> f.codes.shape, f.scales.tolist()[0][:4]
    ((1, 256), [127, 112, 96, 80])
    """
    o, xb = float_blocks(x, QK_K)
    xs = xb.reshape(tuple(xb.shape[:-1]) + (16, 16))
    scales, levels = make_qx_quants_rmse1(o, xs, 32)
    return q6_k_fields(o, xb, xs, scales, levels)


def q6_k_fields(o, xb, xs, scales, levels):
    """Q6_K's super-block step from the 16 sub-block ``scales`` and codes ``levels`` of the search,
    shared by the reference and the importance-weighted quantizers."""
    max_abs, max_scale = first_absmax(o, scales)
    zero = max_abs < o.c(GROUP_MAX_EPS)  # the whole block is stored as zero bytes
    iscale = o.divide(o.c(-128.0), max_scale)
    d = to_half(o, o.where(zero, o.zeros(iscale), o.divide(o.c(1.0), iscale)))
    q_scales = o.clip(nearest_int(o, iscale[..., None] * scales), -(2**31), 127)
    q_scales = o.where(zero[..., None], o.zeros(q_scales, "int32"), ((q_scales + 128) & 0xFF) - 128)
    sub_d = o.to_named(d, "float32")[..., None] * o.to_named(q_scales, "float32")
    requant = o.clip(nearest_int(o, o.divide(xs, sub_d[..., None])), -32, 31) + 32
    levels = o.where((sub_d == 0)[..., None], levels, requant)  # `if (!d) continue;` keeps L
    levels = o.where(zero[..., None, None], o.zeros(levels, "int32"), levels)
    codes = o.to_named(levels.reshape(tuple(xb.shape)), "uint8")
    return Q6KFields(codes, o.to_named(q_scales, "int8"), d)


@ieee
def dequantize_q6_k(fields):
    """float32 values (..., n) of Q6_K fields: ``(d * sc) * (code - 32)`` (``dequantize_row_q6_K``).

    >>> x = np.linspace(-1, 1, 256, dtype=np.float32)
    >>> float(abs(dequantize_q6_k(quantize_q6_k(x)) - x).max()) < 0.02
    True
    """
    o = c_ops(fields.codes)
    codes = fields.codes
    q = o.to_named(o.to_named(codes, "int32") - 32, "float32").reshape(tuple(codes.shape[:-1]) + (16, 16))
    sub_d = o.to_named(fields.d, "float32")[..., None] * o.to_named(fields.scales, "float32")
    y = sub_d[..., None] * q
    return y.reshape(tuple(codes.shape[:-2]) + (codes.shape[-2] * QK_K,))


def pack_q6_k(fields):
    """ggml's ``block_q6_K`` bytes (210 per block): ql[128], qh[64], scales[16], d.

    >>> pack_q6_k(quantize_q6_k(np.ones(512, np.float32))).shape
    (420,)
    """
    codes, scales, d = (as_numpy(v) for v in fields)
    c = codes.astype(np.uint8).reshape(codes.shape[:-1] + (2, 4, 32))  # halves of 128, quarters of 32
    low = c & 0xF
    ql = np.concatenate([low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)], axis=-1)
    qh = (c[..., 0, :] >> 4) | ((c[..., 1, :] >> 4) << 2) | ((c[..., 2, :] >> 4) << 4) | ((c[..., 3, :] >> 4) << 6)
    lead = codes.shape[:-1]
    parts = [ql.reshape(lead + (128,)), qh.reshape(lead + (64,)), scales.astype(np.int8).view(np.uint8), half_bytes(d)]
    return flat_rows(np.concatenate([p.astype(np.uint8) for p in parts], axis=-1))


def unpack_q6_k(data):
    """Q6KFields (numpy) from ``block_q6_K`` bytes (..., n_blocks * 210).

    >>> f = quantize_q6_k(np.ones(256, np.float32))
    >>> np.array_equal(unpack_q6_k(pack_q6_k(f)).codes, f.codes)
    True
    """
    b = block_rows(data, 210)
    lead = b.shape[:-1]
    ql = b[..., :128].reshape(lead + (2, 2, 32))
    qh = b[..., 128:192].reshape(lead + (2, 1, 32))
    low = np.concatenate([ql & 0xF, ql >> 4], axis=-2)  # quarters 0, 1 (low nibbles), 2, 3 (high)
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-2)
    codes = (low | (high << 4)).astype(np.uint8).reshape(lead + (256,))
    return Q6KFields(codes, b[..., 192:208].view(np.int8), half_from(b[..., 208:210]))
