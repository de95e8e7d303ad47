"""The quantization numerics, written once: scales, integer grids, clipping and round trips.

Every backend (the torch STE, PTQ, the converted int model, the Flax check) calls these
functions, so a weight quantized anywhere in mixle lands on the same grid.

Layout convention: an array is viewed as ``batch + out + in`` axes. Scales are shared by all of
``in`` (``channel``), by ``group_size`` consecutive elements of the flattened ``in`` axes
(``group``), or by the whole array per batch element (``tensor``). Internally the array is
reshaped to *blocks* of shape ``(B, S, K)`` and every reduction runs over the last axis K.

llama.cpp's grids also take an importance matrix (``quantize_array(..., importance=)``): one
weight per input column, quantized by ggml's importance-weighted search as ``llama-quantize
--imatrix`` does (``mixle.gguf.ggml_weighted``).
"""

import functools
import math

import numpy as np

from mixle.core.array_ops import array_kind, array_ops, is_tracer  # noqa: F401
from mixle.core.checks import ScaleOverflowError, check_array, check_block_max, not_finite_error, require_finite  # noqa: F401,E501
from mixle.core.product_inputs import act_rounding_named
from mixle.core.spec import QuantSpec, block_shape, resolve_spec  # noqa: F401

__all__ = [
    "QuantSpec",
    "QuantizedArray",
    "quantize_array",
    "dequantize_array",
    "quantize_dequantize_array",
    "clip_threshold",
    "fake_quant_forward",
    "fake_quant_blocks",
    "check_array",
    "block_shape",
    "percentile_positions",
    "block_threshold",
    "block_scale",
    "block_stats",
    "stored_scale",
    "check_scale_range",
    "widened",
    "NARROW_FLOATS",
    "round_codes",
    "round_half_away",
    "round_q8_0_input",
    "round_q8_k_input",
    "PRODUCT_INPUT_ROUNDINGS",
    "quantize_blocks",
    "quantize_linear_weight",
    "quantize_conv_weight",
    "quantize_embedding_weight",
    "ScaleOverflowError",
]


# ----------------------------------------------------------------------------------------------
# Blocks: the (B, S, K) view every reduction works on.


def percentile_positions(count, percentile):
    """Order-statistic indices (lo, hi) and the weight of hi for a linear-interpolated percentile.

    The percentile of K sorted values v is ``v[lo] + (v[hi] - v[lo]) * frac`` with
    ``pos = percentile / 100 * (K - 1)``, ``lo = floor(pos)``, ``hi = min(lo + 1, K - 1)``,
    ``frac = pos - lo`` (numpy's default "linear" method, evaluated in the array's dtype).

    Args:
        count: K, the number of values.
        percentile: the percentile, in (0, 100].

    Returns:
        ``(lo, hi, frac)``.

    >>> percentile_positions(5, 50.0)
    (2, 3, 0.0)
    """
    pos = percentile / 100.0 * (count - 1)
    lo = min(int(math.floor(pos)), count - 1)
    hi = min(lo + 1, count - 1)
    return lo, hi, pos - lo


def block_threshold(ops, magnitude, spec, axis=-1):
    """Per-block clipping threshold ``c``: the max of ``|w|``, or its ``spec.clip_percentile``.

    Args:
        ops: ``array_ops`` of the blocks.
        magnitude: ``|w|`` of a block view, blocks along ``axis``; may be overwritten (it is a
            temporary for the order statistics).
        spec: the QuantSpec.
        axis: the axis each block lies along.

    Returns:
        The thresholds, ``axis`` kept with length 1.

    >>> m = np.arange(1, 6, dtype=np.float32).reshape(1, 1, 5)
    >>> block_threshold(array_ops(m), m, QuantSpec(clip_percentile=50)).tolist()
    [[[3.0]]]
    """
    p = spec.clip_percentile
    if p is None or p == 100.0:
        return ops.amax(magnitude, axis)
    lo, hi, frac = percentile_positions(magnitude.shape[axis], p)
    if frac == 0.0 or lo == hi:
        return ops.order_stats(magnitude, [lo], axis)[0]
    low, high = ops.order_stats(magnitude, [lo, hi], axis)
    return low + ops.rounded((high - low) * ops.scalar(frac, magnitude))


def _absmax_top(ops, blocks, threshold, axis):
    return threshold + ops.scalar(0.0, threshold)  # torch's max(amax, -amin) can be -0.0


def _signed_top(ops, blocks, threshold, axis):
    return ops.signed_max(blocks, axis)


# Scale rules (see mixle.core.grids): the value a block's scale is divided from.
_SCALE_TOPS = {"absmax": _absmax_top, "signed_max": _signed_top}


def block_scale(ops, blocks, threshold, spec, axis=-1):
    """Per-block scale the codes are computed with, from the threshold by the grid's scale rule.

    Args:
        ops: ``array_ops`` of the blocks.
        blocks: a block view, blocks along ``axis``.
        threshold: the blocks' ``block_threshold`` (``axis`` kept, length 1).
        spec: the QuantSpec (its grid decides the rule and the divisor).
        axis: the axis each block lies along.

    Returns:
        The scales, shaped like ``threshold``; the grid's zero scale where a scale is 0.

    >>> b = np.array([[[0.7, -0.35], [0.0, 0.0]]], np.float32)
    >>> block_scale(array_ops(b), b, abs(b).max(-1, keepdims=True), QuantSpec(bits=4)).tolist()
    [[[0.10000000149011612], [1.0]]]
    """
    grid = spec.grid_record
    top = _SCALE_TOPS[grid.scale_rule](ops, blocks, threshold, axis)
    scale = ops.divide(top, ops.divisor(spec.scale_divisor, top))
    # An all-zero block (or one whose scale underflows) gets the grid's zero scale: with 1,
    # codes 0 and no NaN. ggml's grids (None) keep the signed zero and multiply by a reciprocal of 0.
    if grid.zero_scale is None:
        return scale
    return ops.where(scale == 0, ops.scalar(grid.zero_scale, scale), scale)


def block_stats(ops, blocks, spec, with_max=False, axis=-1):
    """Per-block ``(scale, threshold, max of |w| or None)`` of a (B, S, K) block view (or of
    any view whose blocks lie along ``axis``).

    The scale is the one codes are computed with (see ``stored_scale`` for the one kept). The
    maximum (asked for with ``with_max``) is the threshold itself unless clip_percentile is
    set; it is what ``check_block_max`` reads.

    Args:
        ops: ``array_ops`` of the blocks.
        blocks: the block view.
        spec: the QuantSpec.
        with_max: also return the per-block maximum of ``|w|``.
        axis: the axis each block lies along.

    Returns:
        ``(scale, threshold, block_max)``, each with ``axis`` kept (length 1); ``block_max``
        is None unless ``with_max``.

    >>> b = np.array([[[0.7, -0.35]]], np.float32)
    >>> scale, threshold, _ = block_stats(array_ops(b), b, QuantSpec(bits=4))
    >>> scale.tolist(), threshold.tolist()
    ([[[0.10000000149011612]]], [[[0.699999988079071]]])
    """
    p = spec.clip_percentile
    if p is None or p == 100.0:
        threshold = ops.absmax(blocks, axis)
        return block_scale(ops, blocks, threshold, spec, axis), threshold, threshold if with_max else None
    magnitude = abs(blocks)
    block_max = ops.amax(magnitude, axis) if with_max else None
    threshold = block_threshold(ops, magnitude, spec, axis)  # may overwrite magnitude
    return block_scale(ops, blocks, threshold, spec, axis), threshold, block_max


def stored_scale(ops, scale, spec, name=None):
    """The scale as stored and dequantized with: rounded through the grid's scale dtype, if any.

    Args:
        ops: ``array_ops`` of the scales.
        scale: scales from ``block_stats``.
        spec: the QuantSpec (its grid's ``scale_dtype``, e.g. float16 for llama.cpp's grids).
        name: what the error calls the array (None: a caller that names it adds the name).

    Returns:
        The scales in their own dtype, holding values of the grid's scale dtype.

    Raises:
        ScaleOverflowError: a scale does not fit that dtype (e.g. above float16's 65504). Scales
            on an accelerator are checked by an asynchronous device assert instead (a
            RuntimeError with the same advice), so that no host waits for the device.

    >>> s = np.array([[[0.1]]], np.float32)
    >>> stored_scale(array_ops(s), s, QuantSpec(bits=8, grid="q8_0")).item()  # float16's nearest
    0.0999755859375
    """
    dtype = spec.grid_record.scale_dtype
    if dtype is None:
        return scale
    narrow = ops.to_named(scale, spec.grid_record.codec.dtype)
    advice = (f"which grid={spec.grid!r} stores its scales in: the weights are too large for this file "
              f"format; rescale them or use another grid")
    where = "" if name is None else f"{name}: "
    if not ops.readable(narrow):
        ops.assert_finite(narrow, f"{where}a block scale does not fit {dtype} (or is NaN), {advice}")
    elif not ops.all_finite(narrow):
        raise ScaleOverflowError(
            f"{where}a block scale does not fit {dtype} (largest {float(abs(scale).max()):.6g}), {advice}")
    return ops.to_dtype(narrow, scale)


def round_half_away(ops, scaled, lo, hi):
    """``scaled`` rounded half away from zero (C's ``roundf``) and clipped to ``[lo, hi]``, as floats.

    >>> round_half_away(array_ops(np.zeros(1)), np.array([2.5, -0.5, 9.0]), -7, 7).tolist()
    [3.0, -1.0, 7.0]
    """
    # floor(|x|) + floor(2 (|x| - floor|x|)) is exact in floating point (|x| + 0.5 is not);
    # adding 0 turns a -0.0 code into 0.0, as an integer code dequantizes. ``scaled`` is
    # round_codes' own temporary: the in-place steps may overwrite it. Magnitudes past the codes
    # are clipped first: an infinite one (a block whose scale's reciprocal overflows float32,
    # values near 1e-39) would make inf - inf, where the code is the range's end.
    magnitude = ops.clip_(abs(scaled), 0, max(-lo, hi) + 1)
    whole = ops.floor(magnitude)
    halves = ops.floor_(ops.mul_(ops.sub_(magnitude, whole), 2))
    codes = ops.mul_(ops.sign_(scaled), ops.add_(whole, halves))
    return ops.add_(ops.clip_(codes, lo, hi), 0.0)


def _round_offset_trunc(ops, scaled, lo, hi):
    # trunc, as ggml's (int) cast; floor gives the same codes once clipped to >= 0 (values in
    # (-1, 0) truncate to -0 and floor to -1, both clip to 0), and floor is a vector op on CPU.
    offset = -lo
    codes = ops.clip_(ops.floor_(ops.add_(scaled, offset + 0.5)), 0, 2 * offset - 1)
    return ops.add_(codes, -offset)


# Rounding rules (see mixle.core.grids) of the grids that multiply by the scale's reciprocal.
_RECIPROCAL_ROUNDINGS = {"half_away": round_half_away, "offset_trunc": _round_offset_trunc}


def round_codes(ops, blocks, scale, spec):
    """Codes as floats in a fresh array: ``blocks`` rounded onto the spec's grid with ``scale``
    (the scale computed by ``block_stats``, not the stored one).

    Args:
        ops: ``array_ops`` of the blocks.
        blocks: the block view.
        scale: its ``block_stats`` scale (broadcast against ``blocks``).
        spec: the QuantSpec (its grid's rounding rule and code range).

    Returns:
        Codes in ``[spec.code_min, spec.code_max]``, shaped and typed like ``blocks``.

    >>> b = np.array([[[0.7, -0.35, 0.04]]], np.float32)
    >>> round_codes(array_ops(b), b, np.float32(0.1), QuantSpec(bits=4)).tolist()
    [[[7.0, -4.0, 0.0]]]
    """
    rounding = spec.grid_record.rounding
    if rounding == "half_even":
        return ops.divide_round_clip(blocks, scale, spec.code_min, spec.code_max)
    nonzero = ops.where(scale == 0, ops.scalar(1.0, scale), scale)
    inverse = ops.where(scale == 0, ops.scalar(0.0, scale), ops.divide(ops.scalar(1.0, nonzero), nonzero))
    return _RECIPROCAL_ROUNDINGS[rounding](ops, ops.rounded(blocks * inverse), spec.code_min, spec.code_max)


def round_q8_0_input(ops, rows, rounding, name="activations"):
    """``rows`` (``(tokens, inputs)``, float32) rounded to Q8_0 blocks of 32 along each row as the
    llama.cpp build ``rounding`` (``mixle.core.product_inputs``) rounds a product's input:
    ``code * float16(max / 127)``.

    Args:
        ops: ``array_ops`` of ``rows`` (its ``divide`` is IEEE's on every backend).
        rows: the product's input, one token a row, its width a multiple of 32.
        rounding: a ``ProductInputRounding``.
        name: what a scale overflow error calls the rows.

    Returns:
        The rounded values, shaped and typed like ``rows``.

    Raises:
        ScaleOverflowError: a block's scale does not fit float16 (llama.cpp would compute infinity).

    >>> from mixle.core.product_inputs import ACT_ROUNDINGS
    >>> x = np.full((1, 32), 8.5 / 16, np.float32); x[0, 0] = 127 / 16  # x * 127 / max = 8.5: a tie
    >>> [float(round_q8_0_input(array_ops(x), x, ACT_ROUNDINGS[r])[0, 1] * 16) for r in ("x86", "reference")]
    [8.0, 9.0]
    """
    spec = _q8_0_spec()
    grid = spec.grid_record
    blocks = rows.reshape(rows.shape[0], -1, grid.block)
    top = _absmax_top(ops, blocks, ops.absmax(blocks, -1), -1)
    divisor = ops.divisor(grid.divisor[8], top)
    scale = ops.divide(top, divisor)
    stored = stored_scale(ops, scale, spec, name)
    # A block whose stored scale is 0 comes back as zeros; its multiplier may overflow (x * inf = NaN at 0).
    empty = stored == 0
    if rounding.inverse == "quotient":
        inverse = ops.divide(divisor, ops.where(empty, ops.scalar(1.0, top), top))
    else:
        inverse = ops.divide(ops.scalar(1.0, scale), ops.where(empty, ops.scalar(1.0, scale), scale))
    scaled = ops.rounded(blocks * ops.where(empty, ops.scalar(0.0, inverse), inverse))
    lo, hi = grid.code_range(8)
    codes = round_half_away(ops, scaled, lo, hi) if rounding.ties == "away" else ops.round_clip(scaled, lo, hi)
    return (codes * stored).reshape(rows.shape)


@functools.cache
def _q8_0_spec():
    return QuantSpec(bits=8, grid="q8_0")  # llama.cpp's grids are registered after this module is imported


def round_q8_k_input(ops, rows, grid):
    """``rows`` (``(tokens, inputs)``, float32) rounded to llama.cpp's Q8_K blocks (``grid``, 256 values)
    along each row, as ggml's ``quantize_row_q8_K``: ``m`` the block's first value of largest magnitude,
    ``inverse = -127 / m``, codes ``nearest_int(x * inverse)`` (ties to even) at most 127, value
    ``code * (1 / inverse)`` in float32; a block whose ``inverse`` overflows (zeros, subnormals) gives zeros.

    >>> from mixle.core.grids import ACTIVATION_GRIDS
    >>> x = np.linspace(-1, 2, 256, dtype=np.float32)[None]
    >>> float(round_q8_k_input(array_ops(x), x, ACTIVATION_GRIDS["q8_k"])[0, 0] * 127 / 2)  # 63.5 rounds to code 64; 1 / inverse = -2 / 127
    -64.0
    """
    blocks = rows.reshape(rows.shape[0], -1, grid.block)
    top = ops.signed_max(blocks, -1)
    with np.errstate(over="ignore", divide="ignore"):  # numpy's: the overflowing inverses are the empty blocks
        inverse = ops.divide(ops.divisor(grid.divisor[8], top), top)
        empty = abs(inverse) == math.inf
        scale = ops.where(empty, ops.scalar(0.0, inverse), ops.divide(ops.scalar(1.0, inverse), inverse))
    scaled = ops.rounded(blocks * ops.where(empty, ops.scalar(0.0, inverse), inverse))
    return (ops.round_clip(scaled, *grid.code_range(8)) * scale).reshape(rows.shape)


# How llama.cpp rounds a product's input, by its activation grid's (scale rule, rounding): Q8_0 as the
# build ``spec.act_rounding`` names, Q8_K as every build. ``(ops, rows, spec, grid, name)``.
PRODUCT_INPUT_ROUNDINGS = {
    ("absmax", "half_away"): lambda ops, rows, spec, grid, name: round_q8_0_input(
        ops, rows, act_rounding_named(spec.act_rounding), name),
    ("signed_max", "nearest_int"): lambda ops, rows, spec, grid, name: round_q8_k_input(ops, rows, grid),
}


def quantize_blocks(ops, blocks, spec, axis=-1, name=None):
    """The whole pipeline on a block view: ``block_stats``, ``round_codes``, ``stored_scale``.

    Elementwise ops see the same operands in any layout, and the reductions are exact (max,
    order statistics), so every layout gives the same codes and scales.

    Args:
        ops: ``array_ops`` of the blocks.
        blocks: the block view, e.g. ``x.reshape(block_shape(x.shape, spec))``.
        spec: the QuantSpec.
        axis: the axis each block lies along.
        name: what errors call the array (see ``stored_scale``).

    Returns:
        ``(codes, scale, threshold)``: the codes as floats shaped like ``blocks``, the stored
        scales and the clipping thresholds (``axis`` kept, length 1); ``codes * scale`` is the
        round trip.

    >>> b = np.array([[[0.7, -0.35], [0.0, 0.2]]], np.float32)
    >>> codes, scale, _ = quantize_blocks(array_ops(b), b, QuantSpec(bits=4))
    >>> codes.tolist(), scale.tolist()
    ([[[7.0, -4.0], [0.0, 7.0]]], [[[0.10000000149011612], [0.02857142873108387]]])
    """
    scale, threshold, _ = block_stats(ops, blocks, spec, axis=axis)
    codes = round_codes(ops, blocks, scale, spec)
    return codes, stored_scale(ops, scale, spec, name), threshold


def _quantize_blocks(x, spec, batch_ndim, out_ndim, name=None):
    """``quantize_blocks`` of x's (B, S, K) view: ``(ops, blocks, codes, scale, threshold)``."""
    blocks = x.reshape(block_shape(x.shape, spec, batch_ndim, out_ndim))
    ops = array_ops(blocks)
    codes, scale, threshold = quantize_blocks(ops, blocks, spec, name=name)
    return ops, blocks, codes, scale, threshold


# 16-bit floats: their numerics run in float32 (a 16-bit array gets exactly the codes and scales
# of its float32 copy) and the dequantized values are rounded once to their dtype.
NARROW_FLOATS = ("bfloat16", "float16")


def widened(ops, x):
    """``(x as the numerics compute it, the 16-bit dtype name its values are rounded to or None)``:
    a bfloat16/float16 array in float32 (``NARROW_FLOATS``), any other as it is.

    >>> widened(array_ops(np.ones(2, np.float16)), np.ones(2, np.float16))
    (array([1., 1.], dtype=float32), 'float16')
    """
    name = ops.dtype_name(x)
    if name in NARROW_FLOATS:
        return ops.to_named(x, "float32"), name
    return x, None


def check_scale_range(ops, scale, spec, name="x", dtype=None):
    """``check_dequantized_range`` (no level times a scale may overflow, nor round to infinity in the
    16-bit ``dtype`` the values are written in) where the host can read the scales; an asynchronous
    device assert (a RuntimeError with the same advice) where it cannot; nothing on jax tracers.

    Args:
        ops: ``array_ops`` of the scales.
        scale: the stored scales.
        spec: the QuantSpec.
        name: what the error calls the array.
        dtype: ``widened``'s 16-bit dtype name, or None.

    Raises:
        ScaleOverflowError: a finite weight would dequantize to infinity.

    >>> scale = np.float32([4.25e37])  # times 8: 3.4e38, finite in float32, infinite in bfloat16
    >>> check_scale_range(array_ops(scale), scale, QuantSpec(grid="qwix"), "w")
    >>> check_scale_range(array_ops(scale), scale, QuantSpec(grid="qwix"), "w", "bfloat16")
    Traceback (most recent call last):
    mixle.core.checks.ScaleOverflowError: w: on int4/channel/qwix the block scale 4.2e+37 times the grid's largest level 8 overflows bfloat16 (the block's weights reach about 3.2e+38), so a finite weight would dequantize to infinity: rescale the weights (e.g. halve them and double what they feed), or use a grid whose largest code is its divisor (grid='symmetric' at bits=4)
    """
    if is_tracer(scale) or (spec.grid_record.scale_dtype is not None and dtype is None):
        return
    if ops.readable(scale):
        # The largest |scale| decides (the product rounds monotonically): one reduction, no temporary.
        check_dequantized_range(ops.absmax(scale.reshape(-1), -1), spec, name, dtype)
        return
    largest = spec.grid_record.largest_level(spec.bits)
    top = abs(scale) * largest
    ops.assert_finite(top if dtype is None else ops.to_named(top, dtype),
                      f"{name}: on {spec.short()} a block scale times the grid's largest level {largest:g} overflows "
                      f"{dtype or ops.dtype_name(scale)}, so a finite weight would dequantize to infinity: rescale the "
                      f"weights (e.g. halve them and double what they feed)")


# ----------------------------------------------------------------------------------------------
# Public numerics.


# The stored-array record (codes, scales, offsets, second-level scales) lives with its validation.
from mixle.core.stored import QuantizedArray, block_quantized_array, check_dequantized_range  # noqa: E402
from mixle.core.imatrix import check_importance  # noqa: E402
from mixle.core.grids import importance_grid  # noqa: E402


def quantize_array(x, spec=None, *, batch_ndim=0, out_ndim=None, name=None, importance=None, **spec_fields):
    """Quantize an array to integer codes and per-block scales.

    A grid with block numerics (llama.cpp's ``q4_1`` ... ``q6_k``, ``mxfp4``; ``nf4``) is quantized
    by its block numerics (``mixle.gguf.ggml_quants``), bit for bit as ggml's reference quantizer, and the record holds
    that block type's fields (``mixle.core.stored.block_quantized_array``).

    Args:
        x: float numpy array, torch tensor or jax array, laid out ``batch + out + in``.
        spec: a QuantSpec; or pass its fields as keywords (``bits=4, group_size=32``).
        batch_ndim: leading axes with their own scales.
        out_ndim: output axes (default: 1 for 2-D and larger arrays, else 0).
        name: what errors call x (e.g. ``"layer 'fc'"``; default ``x``, which a float16 scale's
            overflow leaves to a caller that names it).
        importance: llama.cpp's importance matrix entry of x (the mean squared activation of
            each input column: shape ``(in,)``, or ``batch + (in,)`` for stacked experts; numpy
            or torch), or None. With it, x is quantized as ``llama-quantize --imatrix`` quantizes
            it, bit for bit (``mixle.gguf.ggml_weighted``): a weighted search on ``q4_0``,
            ``q4_1``, ``q5_0``, ``q5_1``, ``q4_k``, ``q5_k``, ``q6_k``; on ``q8_0`` and ``mxfp4``
            llama.cpp ignores it, and so does this (after checking it); other grids refuse it.

    Returns:
        QuantizedArray with int8 codes in ``[spec.code_min, spec.code_max]``; a bfloat16/float16 x
        is quantized in float32 (``widened``), so its scales are float32.

    Raises:
        ScaleOverflowError: a scale does not fit the grid's scale dtype, or its largest code times
            the scale overflows (a finite weight would dequantize to infinity; for a 16-bit x, in
            its dtype).

    >>> q = quantize_array(np.array([[0.7, -0.35], [0.0, 0.0]], np.float32), bits=4)
    >>> q.codes.tolist(), q.scale.ravel().tolist()
    ([[7, -4], [0, 0]], [0.10000000149011612, 1.0])
    """
    spec = resolve_spec(spec, spec_fields)
    label = "x" if name is None else name
    check_array(x, label)
    if importance is not None:
        if importance_grid(spec.grid, label) == "ignored":
            check_importance(importance, tuple(x.shape), batch_ndim=batch_ndim, out_ndim=out_ndim, name=label)
            importance = None
        else:
            return block_quantized_array(x, spec, batch_ndim=batch_ndim, out_ndim=out_ndim, name=label,
                                         importance=importance)
    if spec.grid_record.numerics is not None:
        return block_quantized_array(x, spec, batch_ndim=batch_ndim, out_ndim=out_ndim, name=label)
    wide, narrow = widened(array_ops(x), x)
    ops, blocks, codes, scale, _ = _quantize_blocks(wide, spec, batch_ndim, out_ndim, name)
    if not is_tracer(scale):
        check_dequantized_range(scale, spec, label, narrow)
    return QuantizedArray(ops.to_int8(codes).reshape(x.shape), scale, spec, batch_ndim, out_ndim)


def dequantize_array(q):
    """Float array from a QuantizedArray: ``codes * scale`` per block (``QuantizedArray.dequantize``,
    which also applies a grid's offsets, second-level scales and lookup table; on block-numerics
    grids it equals ggml's ``dequantize_row_*`` bit for bit).

    >>> q = quantize_array(np.array([1.0, -0.5], np.float32), bits=8)
    >>> dequantize_array(q).tolist()
    [1.0, -0.5039370059967041]
    """
    return q.dequantize()


def quantize_dequantize_array(x, spec=None, *, batch_ndim=0, out_ndim=None, **spec_fields):
    """Round trip ``dequantize(quantize(x))`` in x's own dtype and array library.

    This is the fake-quant forward: every backend's fake-quantized weight equals it.

    >>> quantize_dequantize_array(np.array([0.7, 0.1, -0.2], np.float32), bits=4).tolist()
    [0.699999988079071, 0.10000000149011612, -0.20000000298023224]
    """
    spec = resolve_spec(spec, spec_fields)
    check_array(x)
    return fake_quant_forward(x, spec, batch_ndim=batch_ndim, out_ndim=out_ndim)[0]


def fake_quant_forward(x, spec, *, with_mask=False, batch_ndim=0, out_ndim=None, name="x"):
    """Fake-quant forward for the STE backends: the round trip, plus the clip mask if asked.

    Returns ``(dequantized, mask)``; ``mask`` is True where the STE passes the gradient
    (``|w| <= c``), or None when not asked for. A bfloat16/float16 x runs the float32 numerics
    (``widened``) and its values are rounded once to its dtype. The input is not validated here:
    backends call ``check_array`` once where it is cheap.

    Raises:
        ScaleOverflowError: a finite weight would dequantize to infinity (``check_scale_range``);
            ``name`` is what the message calls x.

    >>> fake_quant_forward(np.array([4.0, 1.0, 0.5], np.float32), QuantSpec(clip_percentile=50), with_mask=True)[1].tolist()
    [False, True, True]
    """
    if spec.grid_record.numerics is not None:
        return _block_numerics_forward(x, spec, with_mask, batch_ndim, out_ndim, name)
    wide, narrow = widened(array_ops(x), x)
    ops, blocks, codes, scale, threshold = _quantize_blocks(wide, spec, batch_ndim, out_ndim, name)
    check_scale_range(ops, scale, spec, name, narrow)
    deq = (codes * scale).reshape(x.shape)
    if narrow is not None:
        deq = ops.to_dtype(deq, x)
    if not with_mask:
        return deq, None
    return deq, (abs(blocks) <= threshold).reshape(x.shape)


def _block_numerics_forward(x, spec, with_mask, batch_ndim, out_ndim, name="x"):
    """``fake_quant_forward`` on a grid with block numerics: ggml's quantize -> dequantize bit for
    bit, in x's dtype; the mask is all True (the block search clips nothing the STE should stop)."""
    ops = array_ops(x)
    readable = ops.readable(x)
    q = block_quantized_array(x, spec, batch_ndim=batch_ndim, out_ndim=out_ndim, check=readable, name=name)
    if not readable:  # the float16 scale / min overflow check, as a device assert
        for part in (q.scale, q.offset):
            if part is not None:
                require_finite(part, ScaleOverflowError(
                    f"{name}: a block scale or min does not fit {spec.grid_record.scale_dtype}, which "
                    f"grid={spec.grid_record.name!r} stores it in: the weights are too large for this file "
                    f"format; rescale them or use another grid"))
    deq = ops.to_dtype(q.dequantize(), x).reshape(x.shape)
    if ops.dtype_name(x) == "float16":  # float16 scales times codes can pass float16's largest value
        require_finite(deq, ScaleOverflowError(
            f"{name}: on grid={spec.grid_record.name!r} a block's largest level overflows float16, so a finite weight "
            f"would dequantize to infinity: rescale the weights, or quantize a float32 copy"))
    return deq, ((abs(x) >= 0) | True) if with_mask else None  # all True (x is finite)


def fake_quant_blocks(blocks, spec, *, axis=-1, name="x"):
    """Fake-quant forward of a view in which each 1-D slice along ``axis`` is one scale block.

    The same values as ``fake_quant_forward`` on the ``batch + out + in`` layout, computed where
    the blocks lie (e.g. along a Flax kernel's own input axis, without transposing it). The
    caller builds the view: ``(in, out)`` per channel reduces ``axis=0``; groups of 32 inputs
    are the view ``(in // 32, 32, out)`` with ``axis=1``. A bfloat16/float16 view runs the
    float32 numerics and its values are rounded once to its dtype.

    Returns:
        ``(dequantized, threshold)``: the round trip in the view's shape, and the per-block
        clipping threshold ``c`` (``axis`` kept, length 1); ``|w| <= c`` is the STE's mask.

    Raises:
        ScaleOverflowError: a finite weight would dequantize to infinity (values the host can
            read; ``name`` is what the message calls the array).

    >>> deq, c = fake_quant_blocks(np.array([[0.7, 0.1], [0.04, 0.2]], np.float32), QuantSpec(bits=4), axis=0)
    >>> deq.tolist(), c.tolist()
    ([[0.699999988079071, 0.11428571492433548], [0.0, 0.20000000298023224]], [[0.699999988079071, 0.20000000298023224]])
    """
    ops = array_ops(blocks)
    wide, narrow = widened(ops, blocks)
    codes, scale, threshold = quantize_blocks(ops, wide, spec, axis, name)
    check_scale_range(ops, scale, spec, name, narrow)
    deq = codes * scale
    return (deq if narrow is None else ops.to_dtype(deq, blocks)), threshold


def clip_threshold(x, spec=None, *, batch_ndim=0, out_ndim=None, **spec_fields):
    """Per-block clipping threshold ``c`` (the max or clip_percentile of ``|x|``), shape (B, S, 1).

    Weights with ``|w| > c`` saturate; with ``clip_gradient`` the STE gives them no gradient.

    >>> clip_threshold(np.arange(1, 6, dtype=np.float32), bits=4, clip_percentile=50).ravel().tolist()
    [3.0]
    """
    spec = resolve_spec(spec, spec_fields)
    check_array(x)
    ops = array_ops(x)
    wide = widened(ops, x)[0]  # a 16-bit x's threshold is its float32 copy's, as its codes are
    blocks = wide.reshape(block_shape(x.shape, spec, batch_ndim, out_ndim))
    return block_threshold(ops, abs(blocks), spec)
