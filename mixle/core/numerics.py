"""The quantization numerics, written once: scales, integer grids, clipping and round trips.

Every backend (the torch STE, PTQ, the converted int model, the Flax check) calls these
functions, so a weight quantized anywhere in mixle lands on the same grid.

Layout convention: an array is viewed as ``batch + out + in`` axes. Scales are shared by all of
``in`` (``channel``), by ``group_size`` consecutive elements of the flattened ``in`` axes
(``group``), or by the whole array per batch element (``tensor``). Internally the array is
reshaped to *blocks* of shape ``(B, S, K)`` and every reduction runs over the last axis K.
"""

import math
import sys
from dataclasses import dataclass

import numpy as np

from mixle.core.spec import QuantSpec

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
    "quantize_linear_weight",
    "quantize_conv_weight",
    "quantize_embedding_weight",
    "ScaleOverflowError",
]


class ScaleOverflowError(ValueError):
    """A block scale does not fit the dtype its grid stores scales in (float16 on llama.cpp's)."""


# ----------------------------------------------------------------------------------------------
# Array backends: numpy (and jax.numpy, which shares its API) and torch, with identical maths.


def array_kind(x):
    """'torch', 'jax' or 'numpy' for a supported array; TypeError otherwise.

    >>> array_kind(np.zeros(2, np.float32))
    'numpy'
    """
    module = type(x).__module__
    if module.startswith("torch"):
        return "torch"
    if isinstance(x, np.ndarray):
        return "numpy"
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):
        return "jax"
    raise TypeError(
        f"expected a numpy array, torch tensor or jax array, got {type(x).__name__}: "
        f"convert it with np.asarray(...) first"
    )


class _NumpyOps:
    """numpy's ops. Reductions run over ``axis`` and keep it (length 1), as every block view
    reduces one axis: the last one of the ``(B, S, K)`` view, or a kernel's own input axis
    (``fake_quant_blocks``)."""

    def __init__(self, xp=np):
        self.xp = xp

    def is_float(self, x):
        return self.xp.issubdtype(x.dtype, self.xp.floating) or x.dtype.name == "bfloat16"

    def all_finite(self, x):
        return bool(self.xp.isfinite(x).all())

    def amax(self, a, axis=-1):
        return a.max(axis=axis, keepdims=True)

    def absmax(self, a, axis=-1):
        return abs(a).max(axis=axis, keepdims=True)

    def order_stats(self, a, ks, axis=-1):
        part = np.partition(a, sorted(set(ks)), axis=axis)
        return [np.take(part, [k], axis=axis) for k in ks]

    def scalar(self, value, like):
        return self.xp.asarray(value, dtype=like.dtype)

    def divisor(self, value, like):
        return self.scalar(value, like)

    def rounded(self, x):
        """x as its own rounded value (a backend that fuses ops, as XLA does, must not fuse it
        into a later op: no FMA)."""
        return x

    def where(self, cond, a, b):
        return self.xp.where(cond, a, b)

    def round_clip(self, x, lo, hi):
        return self.xp.clip(self.xp.round(x), lo, hi)

    def divide_round_clip(self, blocks, scale, lo, hi):
        return self.round_clip(blocks / scale, lo, hi)

    def to_int8(self, x):
        return x.astype(self.xp.int8)

    def to_named(self, x, name):
        return x.astype(name)

    def signed_max(self, a, axis=-1):
        index = self.xp.expand_dims(abs(a).argmax(axis=axis), axis)  # the first largest |a|, as ggml takes it
        return self.xp.take_along_axis(a, index, axis=axis)

    def floor(self, x):
        return self.xp.floor(x)

    def trunc(self, x):
        return self.xp.trunc(x)

    def sign(self, x):
        return self.xp.sign(x)

    def clip(self, x, lo, hi):
        return self.xp.clip(x, lo, hi)

    def to_dtype(self, x, like):
        return x.astype(like.dtype)


class _JaxOps(_NumpyOps):
    """jax.numpy's ops: numpy's, plus what keeps XLA's compiled values equal to numpy's and fast.

    jax is taken from ``sys.modules`` (it is loaded wherever a jax array exists).
    """

    def __init__(self):
        self.jax = sys.modules["jax"]
        super().__init__(self.jax.numpy)

    def order_stats(self, a, ks, axis=-1):
        # Clipping asks for ranks near the top of a block (a of magnitudes >= 0). Sorting costs
        # XLA's CPU backend ~20x a matmul of the layer, and top_k works on the last axis only
        # (a kernel's input axis is often its first). The few largest values come instead from
        # the block's largest distinct values and how often each occurs (a max and a count
        # per level, along the axis as it lies), so repeats count as in a sort.
        count = a.shape[axis]
        top = count - min(ks)
        if top <= _LEVEL_RANKS:
            candidates, axis = self._top_chunks(a, top, axis % a.ndim)
            levels, seen = self._top_levels(candidates, top, axis)
            return [_rank_from_top(self.xp, levels, seen, count - 1 - k) for k in ks]
        if top <= 64:
            values = self.jax.lax.top_k(self.xp.moveaxis(a, axis, -1), top)[0]
            return [self.xp.moveaxis(values[..., count - 1 - k : count - k], -1, axis) for k in ks]
        part = self.xp.sort(a, axis=axis)
        return [self.jax.lax.slice_in_dim(part, k, k + 1, axis=axis) for k in ks]

    def _top_chunks(self, a, top, axis):
        """``(values, axis)``: the ``top`` chunks of ``_CHUNK`` consecutive values along ``axis``
        with the largest maxima (ties in any order), which hold the ``top`` largest values; or
        ``a`` itself when it is too short to gain.

        A value outside those chunks is at most the smallest of their maxima, and they hold
        ``top`` values (their maxima) at least that large, so it cannot rank higher. One pass
        over ``a`` (the chunk maxima); the levels then read only ``top * _CHUNK`` values.
        """
        count = a.shape[axis]
        if count % _CHUNK or count < 4 * top * _CHUNK:
            return a, axis
        chunks = a.reshape(a.shape[:axis] + (count // _CHUNK, _CHUNK) + a.shape[axis + 1 :])
        maxima = self.xp.moveaxis(chunks.max(axis=axis + 1), axis, -1)
        chosen = self.xp.moveaxis(self.jax.lax.top_k(maxima, top)[1], -1, axis)
        values = self.xp.take_along_axis(chunks, self.xp.expand_dims(chosen, axis + 1), axis=axis)
        return values.reshape(a.shape[:axis] + (top * _CHUNK,) + a.shape[axis + 1 :]), axis

    def _top_levels(self, a, top, axis):
        """The ``top`` largest distinct values along ``axis`` (largest first; -inf past the last)
        and how many values are at least each of them (for all but the deepest)."""
        xp = self.xp
        levels, seen, below = [], [], None
        for index in range(top):
            candidates = a if below is None else xp.where(a < below, a, -xp.inf)
            level = candidates.max(axis=axis, keepdims=True)
            if index + 1 < top:  # the deepest level is the answer when no count covers the rank
                occurrences = (a == level).sum(axis=axis, keepdims=True)
                seen.append(occurrences if not seen else seen[-1] + occurrences)
            levels.append(level)
            below = level
        return levels, seen

    def divisor(self, value, like):
        # XLA rewrites division by a constant as multiplication by its reciprocal, which is one
        # ulp off numpy half the time; a divisor behind a barrier is divided exactly.
        return self.jax.lax.optimization_barrier(self.xp.full_like(like, value))

    def rounded(self, x):
        # XLA's CPU code generator contracts a multiplication and a later addition in one fused
        # loop into an FMA (one rounding instead of two), and it drops optimization barriers
        # before fusing; a select on the value (x, or NaN where x is NaN: x itself) between
        # the two keeps the product rounded.
        return self.xp.where(x == x, x, self.xp.nan)

    def divide_round_clip(self, blocks, scale, lo, hi):
        # XLA turns a division by a broadcast scale into a multiplication by its reciprocal
        # (one ulp off for about a fifth of the elements, which moves the -absmax tie of the
        # qwix grid); a divisor broadcast behind a barrier is divided exactly (the barrier is
        # gone before fusion: nothing is materialised).
        scale = self.jax.lax.optimization_barrier(self.xp.broadcast_to(scale, blocks.shape))
        return self.round_clip(blocks / scale, lo, hi)


# Up to this many ranks from the top, jax order statistics come from distinct levels and counts.
_LEVEL_RANKS = 8
# Chunk length of _JaxOps._top_chunks.
_CHUNK = 16


def _rank_from_top(xp, levels, seen, j):
    """The (j+1)-th largest value: the first level that more than j values reach."""
    value = levels[-1]
    for level, total in zip(reversed(levels[:-1]), reversed(seen)):
        value = xp.where(total > j, level, value)
    return value


class _TorchOps:
    def __init__(self):
        import torch

        self.torch = torch

    def is_float(self, x):
        return x.is_floating_point()

    def all_finite(self, x):
        return bool(self.torch.isfinite(x).all())

    def amax(self, a, axis=-1):
        return a.amax(dim=axis, keepdim=True)

    def absmax(self, a, axis=-1):
        # max |a| as max(max a, -min a): two reads and no |a| temporary; the same value (NaN
        # propagates), except that an all-zero row may give -0.0, which _block_scale maps to 1.
        return self.torch.maximum(a.amax(dim=axis, keepdim=True), a.amin(dim=axis, keepdim=True).neg_())

    def order_stats(self, a, ks, axis=-1):
        # Exact order statistics of rows of magnitudes; `a` is a temporary and may be
        # overwritten. Clipping asks for ranks near the top of a row, so select only the few
        # largest values: kthvalue or a sort per rank pays a large constant per row on CPU,
        # which made percentile-clipped QAT steps several times slower.
        if axis % a.ndim != a.ndim - 1:
            return [v.movedim(-1, axis) for v in self.order_stats(a.movedim(axis, -1), ks)]
        count = a.shape[-1]
        top = count - min(ks)
        if top <= 2 and count >= 2 and count & (count - 1) == 0:
            first, second = self._two_largest_(a)
            values = [first if k == count - 1 else second for k in ks]
        elif top <= max(ks) + 1:
            descending = a.topk(top, dim=-1, sorted=True).values
            values = [descending[..., count - 1 - k : count - k] for k in ks]
        else:
            ascending = a.topk(max(ks) + 1, dim=-1, largest=False, sorted=True).values
            values = [ascending[..., k : k + 1] for k in ks]
        # Own copies: a view would keep the whole row buffer alive with the (cached) threshold.
        return [v.clone(memory_format=self.torch.contiguous_format) for v in values]

    def _two_largest_(self, a):
        """Largest and second largest of each row (repeats count), for a power-of-two row length.

        A pairwise tournament vectorised across rows: merging two halves, the maximum is the
        larger maximum and the runner-up the larger of the smaller maximum and both runners-up.
        Works in place in ``a`` (plus half its size), to keep the step's peak memory low.
        """
        # clamp_min_(t) is an in-place maximum that torch.compile can trace.
        minimum = self.torch.minimum
        half = a.shape[-1] // 2
        first, right = a[..., :half], a[..., half:]
        second = minimum(first, right)
        first.clamp_min_(right)
        while half > 1:
            half //= 2
            left, right = first[..., :half], first[..., half:]
            runner_up = second[..., :half]
            runner_up.clamp_min_(second[..., half:])
            runner_up.clamp_min_(minimum(left, right))
            left.clamp_min_(right)
            first, second = left, runner_up
        return first, second

    def scalar(self, value, like):
        return self.torch.tensor(value, dtype=like.dtype, device=like.device)

    def divisor(self, value, like):
        return self.scalar(value, like)

    def rounded(self, x):
        return x

    def where(self, cond, a, b):
        return self.torch.where(cond, a, b)

    def round_clip(self, x, lo, hi):
        return self.torch.round(x).clamp_(lo, hi)

    def divide_round_clip(self, blocks, scale, lo, hi):
        # One fresh tensor, rounded and clipped in place: the same values as round_clip.
        return (blocks / scale).round_().clamp_(lo, hi)

    def to_int8(self, x):
        return x.to(self.torch.int8)

    def to_named(self, x, name):
        return x.to(getattr(self.torch, name))

    def signed_max(self, a, axis=-1):
        index = a.abs().argmax(dim=axis, keepdim=True)  # the first largest |a|, as ggml takes it
        return a.gather(axis, index)

    def floor(self, x):
        return self.torch.floor(x)

    def trunc(self, x):
        return self.torch.trunc(x)

    def sign(self, x):
        return self.torch.sign(x)

    def clip(self, x, lo, hi):
        return self.torch.clamp(x, lo, hi)

    def to_dtype(self, x, like):
        return x.to(like.dtype)


def array_ops(x):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):  # also traceable by torch.compile
        return _TorchOps()
    kind = array_kind(x)
    if kind == "torch":
        return _TorchOps()
    if kind == "jax":
        return _JaxOps()
    return _NumpyOps(np)


def _is_tracer(x):
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.core.Tracer)


def check_array(x, name="x", *, finite=True):
    """Validate a weight: a non-empty floating array with only finite values.

    Args:
        x: the array.
        name: what error messages call it.
        finite: also scan the values for NaN and infinity (one pass over x). Backends that
            compute the per-block maximum of ``|x|`` anyway pass False and call
            ``check_block_max`` on that maximum instead.

    Raises:
        TypeError: not an array, or not a floating dtype.
        ValueError: empty, or containing NaN or infinity.

    >>> check_array(np.ones(3, np.float32))
    """
    ops = array_ops(x)
    if not ops.is_float(x):
        raise TypeError(
            f"{name} has dtype {x.dtype}, but quantization needs a floating dtype: "
            f"cast it first, e.g. {name}.astype(np.float32) / {name}.float()"
        )
    if math.prod(x.shape) == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)}): there is nothing to quantize")
    if finite and not _is_tracer(x) and not ops.all_finite(x):
        raise not_finite_error(x, name)


def check_block_max(block_max, x, name="x"):
    """Raise ``check_array``'s NaN/infinity error if a per-block maximum of ``|x|`` is not finite.

    A NaN or infinity anywhere in a block makes that block's maximum of ``|x|`` NaN or infinity
    (the maximum propagates NaN), so this is check_array's finiteness test at the cost of one
    value per block instead of a pass over x.

    >>> check_block_max(np.array([[[0.5]]], np.float32), np.ones(2, np.float32))
    """
    if not _is_tracer(block_max) and not array_ops(block_max).all_finite(block_max):
        raise not_finite_error(x, name)


def not_finite_error(x, name):
    return ValueError(
        f"{name} contains NaN or infinity (shape {tuple(x.shape)}): quantization needs finite "
        f"values; find where training diverged or clean the weights first"
    )


# ----------------------------------------------------------------------------------------------
# Blocks: the (B, S, K) view every reduction works on.


def _split_shape(shape, batch_ndim, out_ndim):
    if out_ndim is None:
        out_ndim = 1 if len(shape) - batch_ndim >= 2 else 0
    if batch_ndim < 0 or out_ndim < 0 or batch_ndim + out_ndim > len(shape):
        raise ValueError(
            f"an array of shape {tuple(shape)} has no room for {batch_ndim} batch and {out_ndim} "
            f"output axes: the counts must not exceed its {len(shape)} dimensions"
        )
    batch = math.prod(shape[:batch_ndim])
    rows = math.prod(shape[batch_ndim : batch_ndim + out_ndim])
    cols = math.prod(shape[batch_ndim + out_ndim :])
    return batch, rows, cols


def block_shape(shape, spec, batch_ndim=0, out_ndim=None):
    """The ``(B, S, K)`` block view of an array of ``shape``: S scales of K elements per batch.

    Args:
        shape: the array shape, laid out ``batch + out + in``.
        spec: the QuantSpec (granularity and group_size decide S and K).
        batch_ndim: leading axes that each get their own scales (stacked expert weights).
        out_ndim: output axes after the batch axes; ``None`` means 1 for arrays with at least
            two non-batch axes, else 0.

    >>> block_shape((8, 64), QuantSpec(group_size=16))
    (1, 32, 16)
    """
    batch, rows, cols = _split_shape(tuple(shape), batch_ndim, out_ndim)
    if spec.granularity == "tensor":
        return batch, 1, rows * cols
    if spec.granularity == "channel":
        return batch, rows, cols
    if cols % spec.group_size:
        divisors = [d for d in range(1, cols + 1) if cols % d == 0]
        near = sorted(divisors, key=lambda d: abs(d - spec.group_size))[:3]
        raise ValueError(
            f"group_size={spec.group_size} does not divide the input size {cols} of an array of "
            f"shape {tuple(shape)}: use a divisor of {cols}, e.g. {sorted(near)}, or "
            f"granularity='channel'"
        )
    return batch, rows * cols // spec.group_size, spec.group_size


def percentile_positions(count, percentile):
    """Order-statistic indices (lo, hi) and the weight of hi for a linear-interpolated percentile.

    The percentile of K sorted values v is ``v[lo] + (v[hi] - v[lo]) * frac`` with
    ``pos = percentile / 100 * (K - 1)``, ``lo = floor(pos)``, ``hi = min(lo + 1, K - 1)``,
    ``frac = pos - lo`` (numpy's default "linear" method, evaluated in the array's dtype).

    >>> percentile_positions(5, 50.0)
    (2, 3, 0.0)
    """
    pos = percentile / 100.0 * (count - 1)
    lo = min(int(math.floor(pos)), count - 1)
    hi = min(lo + 1, count - 1)
    return lo, hi, pos - lo


def _block_threshold(ops, magnitude, spec, axis=-1):
    """Per-block clipping threshold: the max of |w|, or its clip_percentile (may overwrite magnitude)."""
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


def _block_scale(ops, blocks, threshold, spec, axis=-1):
    grid = spec.grid_record
    top = _SCALE_TOPS[grid.scale_rule](ops, blocks, threshold, axis)
    scale = top / ops.divisor(spec.scale_divisor, top)
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
    """
    p = spec.clip_percentile
    if p is None or p == 100.0:
        threshold = ops.absmax(blocks, axis)
        return _block_scale(ops, blocks, threshold, spec, axis), threshold, threshold if with_max else None
    magnitude = abs(blocks)
    block_max = ops.amax(magnitude, axis) if with_max else None
    threshold = _block_threshold(ops, magnitude, spec, axis)  # may overwrite magnitude
    return _block_scale(ops, blocks, threshold, spec, axis), threshold, block_max


def stored_scale(ops, scale, spec):
    """The scale as stored and dequantized with: rounded through the grid's scale dtype, if any.

    Raises:
        ValueError: a scale does not fit that dtype (e.g. above float16's 65504).
    """
    dtype = spec.grid_record.scale_dtype
    if dtype is None:
        return scale
    narrow = ops.to_named(scale, dtype)
    if not _is_tracer(narrow) and not ops.all_finite(narrow):
        raise ScaleOverflowError(
            f"a block scale does not fit {dtype} (largest {float(abs(scale).max()):.6g}), which grid="
            f"{spec.grid!r} stores its scales in: the weights are too large for this file format; "
            f"rescale them or use another grid"
        )
    return ops.to_dtype(narrow, scale)


def _round_half_away(ops, scaled, lo, hi):
    # floor(|x|) + floor(2 (|x| - floor|x|)) is exact in floating point (|x| + 0.5 is not);
    # adding 0 turns a -0.0 code into 0.0, as an integer code dequantizes.
    magnitude = abs(scaled)
    whole = ops.floor(magnitude)
    codes = ops.sign(scaled) * (whole + ops.floor((magnitude - whole) * 2))
    return ops.clip(codes, lo, hi) + ops.scalar(0.0, codes)


def _round_offset_trunc(ops, scaled, lo, hi):
    offset = -lo
    codes = ops.clip(ops.trunc(scaled + ops.scalar(offset + 0.5, scaled)), 0, 2 * offset - 1)
    return codes - ops.scalar(offset, codes)


# Rounding rules (see mixle.core.grids) of the grids that multiply by the scale's reciprocal.
_RECIPROCAL_ROUNDINGS = {"half_away": _round_half_away, "offset_trunc": _round_offset_trunc}


def round_codes(ops, blocks, scale, spec):
    """Codes as floats in a fresh array: ``blocks`` rounded onto the spec's grid with ``scale``
    (the scale computed by ``block_stats``, not the stored one)."""
    rounding = spec.grid_record.rounding
    if rounding == "half_even":
        return ops.divide_round_clip(blocks, scale, spec.code_min, spec.code_max)
    inverse = ops.where(scale == 0, ops.scalar(0.0, scale), 1 / ops.where(scale == 0, ops.scalar(1.0, scale), scale))
    return _RECIPROCAL_ROUNDINGS[rounding](ops, ops.rounded(blocks * inverse), spec.code_min, spec.code_max)


def _quantize_blocks(x, spec, batch_ndim, out_ndim):
    """Core: returns (ops, blocks, rounded codes as floats, scale, threshold), all (B, S, ·)."""
    blocks = x.reshape(block_shape(x.shape, spec, batch_ndim, out_ndim))
    return _quantize_view(blocks, spec, -1)


def _quantize_view(blocks, spec, axis):
    """``_quantize_blocks`` on a view whose blocks lie along ``axis`` (scales keep it, length 1).

    Elementwise ops see the same operands in any layout, and the reductions are exact (max,
    order statistics), so every layout gives the same codes and scales.
    """
    ops = array_ops(blocks)
    scale, threshold, _ = block_stats(ops, blocks, spec, axis=axis)
    codes = round_codes(ops, blocks, scale, spec)
    return ops, blocks, codes, stored_scale(ops, scale, spec), threshold


# ----------------------------------------------------------------------------------------------
# Public numerics.


@dataclass(frozen=True, eq=False)
class QuantizedArray:
    """Integer codes and scales of one quantized array.

    Attributes:
        codes: int8 array with the original shape (int4 codes are stored one per int8 here;
            see ``pack_int4`` for two per byte).
        scale: scales with shape ``(B, S, 1)`` in the array's float dtype (see ``block_shape``).
        spec: the QuantSpec used.
        batch_ndim: leading batch axes of the original array.
        out_ndim: output axes after the batch axes.
    """

    codes: object
    scale: object
    spec: QuantSpec
    batch_ndim: int = 0
    out_ndim: int | None = None

    @property
    def shape(self):
        return tuple(self.codes.shape)

    def dequantize(self):
        """Float array ``codes * scale`` with the original shape and the scale's dtype."""
        return dequantize_array(self)


def quantize_array(x, spec=None, *, batch_ndim=0, out_ndim=None, **spec_fields):
    """Quantize an array to integer codes and per-block scales.

    Args:
        x: float numpy array, torch tensor or jax array, laid out ``batch + out + in``.
        spec: a QuantSpec; or pass its fields as keywords (``bits=4, group_size=32``).
        batch_ndim: leading axes with their own scales.
        out_ndim: output axes (default: 1 for 2-D and larger arrays, else 0).

    Returns:
        QuantizedArray with int8 codes in ``[spec.code_min, spec.code_max]``.

    >>> q = quantize_array(np.array([[0.7, -0.35], [0.0, 0.0]], np.float32), bits=4)
    >>> q.codes.tolist(), q.scale.ravel().tolist()
    ([[7, -4], [0, 0]], [0.10000000149011612, 1.0])
    """
    spec = resolve_spec(spec, spec_fields)
    check_array(x)
    ops, blocks, codes, scale, _ = _quantize_blocks(x, spec, batch_ndim, out_ndim)
    return QuantizedArray(ops.to_int8(codes).reshape(x.shape), scale, spec, batch_ndim, out_ndim)


def dequantize_array(q):
    """Float array from a QuantizedArray: ``codes * scale`` per block.

    >>> q = quantize_array(np.array([1.0, -0.5], np.float32), bits=8)
    >>> dequantize_array(q).tolist()
    [1.0, -0.5039370059967041]
    """
    ops = array_ops(q.codes)
    shape = block_shape(q.codes.shape, q.spec, q.batch_ndim, q.out_ndim)
    codes = ops.to_dtype(q.codes.reshape(shape), q.scale)
    return (codes * q.scale).reshape(q.codes.shape)


def quantize_dequantize_array(x, spec=None, *, batch_ndim=0, out_ndim=None, **spec_fields):
    """Round trip ``dequantize(quantize(x))`` in x's own dtype and array library.

    This is the fake-quant forward: every backend's fake-quantized weight equals it.

    >>> quantize_dequantize_array(np.array([0.7, 0.1, -0.2], np.float32), bits=4).tolist()
    [0.699999988079071, 0.10000000149011612, -0.20000000298023224]
    """
    spec = resolve_spec(spec, spec_fields)
    check_array(x)
    return fake_quant_forward(x, spec, batch_ndim=batch_ndim, out_ndim=out_ndim)[0]


def fake_quant_forward(x, spec, *, with_mask=False, batch_ndim=0, out_ndim=None):
    """Fake-quant forward for the STE backends: the round trip, plus the clip mask if asked.

    Returns ``(dequantized, mask)``; ``mask`` is True where the STE passes the gradient
    (``|w| <= c``), or None when not asked for. The input is not validated here: backends call
    ``check_array`` once where it is cheap.

    >>> fake_quant_forward(np.array([4.0, 1.0, 0.5], np.float32), QuantSpec(clip_percentile=50), with_mask=True)[1].tolist()
    [False, True, True]
    """
    _, blocks, codes, scale, threshold = _quantize_blocks(x, spec, batch_ndim, out_ndim)
    deq = (codes * scale).reshape(x.shape)
    if not with_mask:
        return deq, None
    return deq, (abs(blocks) <= threshold).reshape(x.shape)


def fake_quant_blocks(blocks, spec, *, axis=-1):
    """Fake-quant forward of a view in which each 1-D slice along ``axis`` is one scale block.

    The same values as ``fake_quant_forward`` on the ``batch + out + in`` layout, computed where
    the blocks lie (e.g. along a Flax kernel's own input axis, without transposing it). The
    caller builds the view: ``(in, out)`` per channel reduces ``axis=0``; groups of 32 inputs
    are the view ``(in // 32, 32, out)`` with ``axis=1``.

    Returns:
        ``(dequantized, threshold)``: the round trip in the view's shape, and the per-block
        clipping threshold ``c`` (``axis`` kept, length 1); ``|w| <= c`` is the STE's mask.

    >>> deq, c = fake_quant_blocks(np.array([[0.7, 0.1], [0.04, 0.2]], np.float32), QuantSpec(bits=4), axis=0)
    >>> deq.tolist(), c.tolist()
    ([[0.699999988079071, 0.11428571492433548], [0.0, 0.20000000298023224]], [[0.699999988079071, 0.20000000298023224]])
    """
    _, _, codes, scale, threshold = _quantize_view(blocks, spec, axis)
    return codes * scale, threshold


def clip_threshold(x, spec=None, *, batch_ndim=0, out_ndim=None, **spec_fields):
    """Per-block clipping threshold ``c`` (the max or clip_percentile of ``|x|``), shape (B, S, 1).

    Weights with ``|w| > c`` saturate; with ``clip_gradient`` the STE gives them no gradient.

    >>> clip_threshold(np.arange(1, 6, dtype=np.float32), bits=4, clip_percentile=50).ravel().tolist()
    [3.0]
    """
    spec = resolve_spec(spec, spec_fields)
    check_array(x)
    ops = array_ops(x)
    blocks = x.reshape(block_shape(x.shape, spec, batch_ndim, out_ndim))
    return _block_threshold(ops, abs(blocks), spec)


def resolve_spec(spec, spec_fields):
    if spec is None:
        return QuantSpec(**spec_fields)
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec must be a mixle QuantSpec, got {type(spec).__name__}: build one with QuantSpec(bits=4, ...)")
    if spec_fields:
        raise TypeError(
            f"pass either spec=... or its fields {sorted(spec_fields)}, not both: "
            f"use spec.replace({', '.join(f'{k}=...' for k in spec_fields)})"
        )
    return spec


# ----------------------------------------------------------------------------------------------
# Weight quantizers for the three layer kinds: thin wrappers that fix the batch + out + in layout.


def _axis_count(value, name, low, high, shape, hint):
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(
            f"{name}={value} does not fit a weight of shape {tuple(shape)} ({len(shape)} axes): "
            f"use {low}..{high}; {hint}"
        )
    return value


def quantize_linear_weight(w, spec=None, input_axis_count=1, batch_axis_count=0, **spec_fields):
    """Quantize a linear layer's weight laid out ``batch + out + in`` (torch's ``(out, in)``).

    The last ``input_axis_count`` axes are the inputs (reduced over for each scale), the leading
    ``batch_axis_count`` axes are stacked layers (e.g. experts) with their own scales, and the
    axes between are outputs: one scale per output channel (``channel``), per ``group_size``
    consecutive flattened inputs of a channel (``group``), or per batch element (``tensor``).

    Args:
        w: float numpy array, torch tensor or jax array.
        spec: a QuantSpec; or pass its fields as keywords (``bits=4, group_size=32``).
        input_axis_count: trailing input axes (2 for a ``(out, heads, head_dim)`` projection).
        batch_axis_count: leading batch axes.

    Returns:
        QuantizedArray: int8 codes shaped like ``w`` and scales shaped ``(B, S, 1)``.

    >>> w = np.array([[[0.7, -0.35], [0.0, 0.2]], [[1.4, 0.7], [0.1, 0.0]]], np.float32)
    >>> q = quantize_linear_weight(w, bits=4, batch_axis_count=1)  # 2 experts of (out=2, in=2)
    >>> q.codes.tolist(), q.scale.shape
    ([[[7, -4], [0, 7]], [[7, 4], [7, 0]]], (2, 2, 1))
    """
    array_kind(w)  # a clear TypeError for lists and other non-arrays
    ndim = len(w.shape)
    _axis_count(batch_axis_count, "batch_axis_count", 0, max(ndim - 2, 0), w.shape,
                "a linear weight needs at least one output and one input axis after the batch axes")
    _axis_count(input_axis_count, "input_axis_count", 1, max(ndim - batch_axis_count - 1, 1), w.shape,
                "a linear weight needs at least one output axis before the input axes")
    if ndim - batch_axis_count - input_axis_count < 1:
        raise ValueError(
            f"a weight of shape {tuple(w.shape)} has no output axis left after {batch_axis_count} batch "
            f"and {input_axis_count} input axes: a 1-D vector is not a linear weight (use quantize_array)"
        )
    return quantize_array(w, spec, batch_ndim=batch_axis_count,
                          out_ndim=ndim - batch_axis_count - input_axis_count, **spec_fields)


def quantize_conv_weight(w, spec=None, output_axis_count=1, **spec_fields):
    """Quantize a convolution weight ``(out, in / groups, *kernel)``: scales per output channel.

    The first ``output_axis_count`` axes are the (structured) output channels; the remaining
    axes, input channels and kernel taps, are flattened and reduced over for each scale, so
    ``group_size`` groups run along ``in * kernel`` of one output channel.

    Args:
        w: float numpy array, torch tensor or jax array.
        spec: a QuantSpec; or pass its fields as keywords.
        output_axis_count: leading output axes (2 for a weight stored as ``(groups, out, ...)``).

    Returns:
        QuantizedArray with codes shaped like ``w`` and scales ``(1, S, 1)``.

    >>> w = np.zeros((4, 3, 2, 2), np.float32); w[1, 0, 0, 0] = 0.7  # Conv2d(3, 4, 2)
    >>> q = quantize_conv_weight(w, bits=4)
    >>> q.scale.ravel().tolist(), int(q.codes[1, 0, 0, 0])
    ([1.0, 0.10000000149011612, 1.0, 1.0], 7)
    """
    return _quantize_leading_axes(w, spec, spec_fields, output_axis_count, "output_axis_count",
                                  "a conv weight", "(out, in, *kernel)", "one output axis and one input/kernel axis")


def quantize_embedding_weight(w, spec=None, vocabulary_axis_count=1, **spec_fields):
    """Quantize an embedding table ``(vocab, dim)``: one scale per vocabulary row.

    The first ``vocabulary_axis_count`` axes index rows (tokens); the remaining axes are the
    embedding vector, reduced over for each scale (``group_size`` groups run along it). This is
    the same layout as a ``(vocab, dim)`` output head, so a tied table gets the head's codes.

    Args:
        w: float numpy array, torch tensor or jax array.
        spec: a QuantSpec; or pass its fields as keywords.
        vocabulary_axis_count: leading row axes (2 for ``(tables, vocab, dim)``).

    Returns:
        QuantizedArray with codes shaped like ``w`` and scales ``(1, rows, 1)`` (per channel).

    >>> q = quantize_embedding_weight(np.array([[0.7, 0.1], [-0.2, 0.4]], np.float32), bits=4)
    >>> q.codes.tolist(), q.scale.shape
    ([[7, 1], [-4, 7]], (1, 2, 1))
    """
    return _quantize_leading_axes(w, spec, spec_fields, vocabulary_axis_count, "vocabulary_axis_count",
                                  "an embedding table", "(vocab, dim)", "one row axis and one vector axis")


def _quantize_leading_axes(w, spec, spec_fields, count, argument, what, layout, needs):
    """quantize_array with scales per index of the first ``count`` axes (conv and embedding)."""
    array_kind(w)  # a clear TypeError for lists and other non-arrays
    ndim = len(w.shape)
    _axis_count(count, argument, 1, max(ndim - 1, 1), w.shape, f"{what} needs at least {needs}")
    if ndim < 2:
        raise ValueError(f"{what} has at least 2 axes {layout}, got shape {tuple(w.shape)}")
    return quantize_array(w, spec, batch_ndim=0, out_ndim=count, **spec_fields)
