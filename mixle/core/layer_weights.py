"""Weight quantizers for the three layer kinds: thin wrappers that fix the batch + out + in layout.

Each one checks the axis counts of its layer kind and calls ``mixle.core.numerics.quantize_array``
with the matching ``batch_ndim`` and ``out_ndim``.
"""

import numpy as np

from mixle.core.array_ops import array_kind
from mixle.core.numerics import quantize_array

__all__ = ["quantize_linear_weight", "quantize_conv_weight", "quantize_embedding_weight"]


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
