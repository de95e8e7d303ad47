"""Input checks of the numerics and their errors: float dtype, non-empty, finite, scale range."""

import math

import numpy as np

from mixle.core.array_ops import array_ops

__all__ = ["ScaleOverflowError", "check_array", "check_block_max", "not_finite_error", "require_finite"]


class ScaleOverflowError(ValueError):
    """A block scale does not fit the dtype its grid stores scales in (float16 on llama.cpp's)."""


def check_array(x, name="x", *, finite=True):
    """Validate a weight: a non-empty floating array with only finite values.

    Args:
        x: the array.
        name: what error messages call it.
        finite: also scan the values for NaN and infinity (one pass over x; see
            ``require_finite`` for values on a device). Backends that compute the per-block
            maximum of ``|x|`` anyway pass False and call ``check_block_max`` on that maximum.

    Raises:
        TypeError: not an array, or not a floating dtype.
        ValueError: empty, or containing NaN or infinity.

    >>> check_array(np.ones(3, np.float32))
    >>> check_array(np.ones(3, np.int32), "w")
    Traceback (most recent call last):
    TypeError: w has dtype int32, but quantization needs a floating dtype: cast it first, e.g. w.astype(np.float32) / w.float()
    """
    ops = array_ops(x)
    if not ops.is_float(x):
        raise TypeError(
            f"{name} has dtype {x.dtype}, but quantization needs a floating dtype: "
            f"cast it first, e.g. {name}.astype(np.float32) / {name}.float()"
        )
    if math.prod(x.shape) == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)}): there is nothing to quantize")
    if finite:
        require_finite(x, not_finite_error(x, name))


def check_block_max(block_max, x, name="x"):
    """Raise ``check_array``'s NaN/infinity error if a per-block maximum of ``|x|`` is not finite.

    A NaN or infinity anywhere in a block makes that block's maximum of ``|x|`` NaN or infinity
    (the maximum propagates NaN), so this is check_array's finiteness test at the cost of one
    value per block instead of a pass over x.

    Args:
        block_max: the per-block maxima of ``|x|`` (any shape).
        x: the array they come from (its shape goes into the message).
        name: what the message calls x.

    Raises:
        ValueError: a maximum is NaN or infinite (where the maxima live on a device, see
            ``require_finite``).

    >>> check_block_max(np.array([[[0.5]]], np.float32), np.ones(2, np.float32))
    >>> check_block_max(np.array([[[np.nan]]], np.float32), np.ones(2, np.float32), "w")
    Traceback (most recent call last):
    ValueError: w contains NaN or infinity (shape (2,)): quantization needs finite values; find where training diverged or clean the weights first
    """
    require_finite(block_max, not_finite_error(x, name))


def require_finite(x, error):
    """Raise ``error`` if ``x`` holds NaN or infinity, without ever waiting for a device.

    Values the host can read (numpy, CPU tensors run eagerly) are checked here and ``error`` is
    raised. A tensor on an accelerator (or traced by torch.compile, or fake) gets an asynchronous
    device assert instead: a RuntimeError with ``error``'s message when the device reaches it,
    and no host synchronisation. Traced jax values are not checked (jit has no assert).

    Args:
        x: the array.
        error: the exception to raise (its text is the device assert's message).

    Raises:
        error: x holds NaN or infinity (readable values).

    >>> require_finite(np.ones(2), ValueError("bad"))
    >>> require_finite(np.array([np.inf]), ValueError("bad"))
    Traceback (most recent call last):
    ValueError: bad
    """
    ops = array_ops(x)
    if not ops.readable(x):
        ops.assert_finite(x, str(error))
    elif not ops.all_finite(x):
        raise error


def not_finite_error(x, name):
    """The ValueError for an ``x`` with NaN or infinity, for callers that raise it themselves.

    Args:
        x: the array (its shape goes into the message).
        name: what the message calls it.

    >>> str(not_finite_error(np.ones((2, 3)), "weight"))
    'weight contains NaN or infinity (shape (2, 3)): quantization needs finite values; find where training diverged or clean the weights first'
    """
    return ValueError(
        f"{name} contains NaN or infinity (shape {tuple(x.shape)}): quantization needs finite "
        f"values; find where training diverged or clean the weights first"
    )
