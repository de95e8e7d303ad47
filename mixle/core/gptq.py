"""GPTQ's numerics (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"), framework-free, onto mixle's own integer grids.

mixle's own implementation: torchao 0.18's ``torchao.prototype.gptq.GPTQConfig`` runs on CUDA only
and quantizes onto torchao's int4 grid (asymmetric, with zero points) or its int8 rows, not onto
mixle's grids and scale rules, so its codes could not be mixle's ``QuantizedLinear`` codes.

A linear layer ``y = x W^T`` (``W`` of shape ``(out, in)``) is quantized one input column at a
time, left to right. After column ``j`` is rounded, the error it leaves is spread over the columns
not yet quantized through the inverse of the layer's Hessian ``H = X^T X`` (the calibration
inputs' Gram matrix; GPTQ's ``2 X^T X / n`` gives the same codes, since the update is invariant to
H's scale), so that the layer's output error ``||X W^T - X Q^T||`` stays small:

* inputs that are always zero (``H[j, j] == 0``) get weight 0 and ``H[j, j] = 1``;
* ``H += damp * mean(diag H) * I`` (``damp``: GPTQ's "percdamp", 0.01);
* ``U``: the upper Cholesky factor of ``H^-1`` (``H^-1 = U^T U``);
* column ``j``: ``q = dequantized code of w_j``, ``e = (w_j - q) / U[j, j]``,
  ``w_k -= e * U[j, k]`` for every ``k > j``;
* lazy batches: the updates inside a batch of ``block_size`` columns are applied to that batch
  only; the columns after it get the batch's errors in one product at its end (the same values,
  summed in another order).

Scales come from the grid's own rule (``mixle.core.numerics.block_stats``: absmax / qmax on
``symmetric``, signed max / -8 on ``q4_0``, ...) applied, in the weight's dtype, to the
error-compensated weights of a group when its first column is reached (``granularity="group"``),
or to the whole row (``"channel"``) or matrix (``"tensor"``) before the first column; each column
is rounded with its group's scale by the grid's rounding (``round_codes``) and dequantized with
the stored scale (``stored_scale``: float16 on llama.cpp's grids). The codes and scales are thus
on exactly the grid ``quantize_array`` uses; only their values differ from round-to-nearest.
The error compensation runs in float64.

Grids with block numerics (llama.cpp's K-quants, ``q4_1``, ``q5_*``, ``mxfp4``, ``nf4``: a
least-squares or table search per block) and learned scales are refused.
"""

import numpy as np

from mixle.core.array_ops import array_ops
from mixle.core.numerics import QuantizedArray, block_shape, block_stats, round_codes, stored_scale
from mixle.core.spec import QuantSpec  # noqa: F401  (the doctests use it)
from mixle.core.stored import check_dequantized_range

__all__ = ["gptq_quantize_weight", "check_gptq_spec", "check_gptq_options", "DEFAULT_DAMP", "DEFAULT_BLOCK_SIZE"]

DEFAULT_DAMP = 0.01
DEFAULT_BLOCK_SIZE = 128


def check_gptq_spec(spec, name="gptq_quantize"):
    """Refuse a QuantSpec GPTQ cannot honour (with the reason); returns it.

    >>> check_gptq_spec(QuantSpec(bits=4, group_size=32)).short()
    'int4/group32/symmetric'
    >>> check_gptq_spec(QuantSpec(grid="q4_k"))
    Traceback (most recent call last):
    ValueError: gptq_quantize cannot quantize onto grid='q4_k': its block numerics (a search per block of 256 values) choose scales and codes together, which GPTQ's column-by-column rounding cannot follow; use grid='symmetric', 'qwix', 'q4_0' or 'q8_0'
    """
    grid = spec.grid_record
    if grid.numerics is not None:
        raise ValueError(f"{name} cannot quantize onto grid={spec.grid!r}: its block numerics (a search per block "
                         f"of {grid.block} values) choose scales and codes together, which GPTQ's column-by-column "
                         f"rounding cannot follow; use grid='symmetric', 'qwix', 'q4_0' or 'q8_0'")
    if spec.scale == "learned" or spec.weight_format != "int":
        what = "scale='learned'" if spec.scale == "learned" else f"weight_format={spec.weight_format!r}"
        raise ValueError(f"{name} cannot honour {what}: GPTQ rounds onto integer codes with scales from the "
                         f"grid's rule; learned scales come from training (apply_qat), fp8 has no integer grid")
    if spec.act_bits is not None:
        raise ValueError(f"{name} cannot honour act_bits={spec.act_bits!r}: GPTQ compensates for the float "
                         f"calibration inputs, not the quantized ones the layer would see; quantize the "
                         f"activations with quantize_model instead, or leave act_bits out")
    return spec


def check_gptq_options(damp, block_size, name="gptq_quantize"):
    """Refuse a ``damp`` outside (0, 10) or a ``block_size`` that is no positive int.

    >>> check_gptq_options(0.0, 128)
    Traceback (most recent call last):
    ValueError: gptq_quantize: damp=0.0 must be a number in (0, 10), e.g. 0.01 (the fraction of mean(diag H) added to H's diagonal)
    """
    if not (isinstance(damp, (int, float)) and not isinstance(damp, bool) and 0 < damp < 10):
        raise ValueError(f"{name}: damp={damp!r} must be a number in (0, 10), e.g. 0.01 (the fraction of "
                         f"mean(diag H) added to H's diagonal)")
    if not (isinstance(block_size, int) and not isinstance(block_size, bool) and block_size >= 1):
        raise ValueError(f"{name}: block_size={block_size!r} must be a positive int, e.g. 128")


def _checked_inputs(weight, hessian, name):
    """``(weight, float64 hessian copy)`` after checking dtypes, shapes and finiteness."""
    weight = np.asarray(weight)
    if weight.ndim != 2 or weight.dtype not in (np.float32, np.float64) or weight.size == 0:
        raise ValueError(f"{name}: weight must be a non-empty 2-D float32/float64 array (out, in), got "
                         f"{weight.dtype} of shape {weight.shape}")
    hessian = np.array(hessian, dtype=np.float64)
    cols = weight.shape[1]
    if hessian.shape != (cols, cols):
        raise ValueError(f"{name}: the Hessian must be ({cols}, {cols}) for a weight of shape {weight.shape}, "
                         f"got {hessian.shape}")
    if not (np.isfinite(weight).all() and np.isfinite(hessian).all()):
        raise ValueError(f"{name}: the weight or its Hessian holds NaN or infinity: check the calibration inputs")
    return weight, hessian


def _inverse_factor(hessian, damp, name):
    """The upper Cholesky factor ``U`` of ``(H + damp * mean(diag H) I)^-1`` (``H^-1 = U^T U``)."""
    diag = np.arange(hessian.shape[0])
    hessian[diag, diag] += damp * np.mean(np.diag(hessian))
    try:
        lower_inv = np.linalg.inv(np.linalg.cholesky(hessian))
        return np.linalg.cholesky(lower_inv.T @ lower_inv).T
    except np.linalg.LinAlgError:
        raise ValueError(f"{name}: the damped Hessian is not positive definite: raise damp (now {damp})") from None


def _group_columns(spec, cols):
    return spec.group_size if spec.granularity == "group" else cols


def _start_scale(ops, columns, spec, dtype):
    """``(scale codes are computed with, stored scale)`` of the columns a group (row, matrix) starts with."""
    rows = columns.astype(dtype)
    blocks = rows.reshape(1, 1, -1) if spec.granularity == "tensor" else rows.reshape(1, rows.shape[0], -1)
    scale, _, _ = block_stats(ops, blocks, spec)
    scale = scale.reshape(-1)
    return scale, stored_scale(ops, scale, spec)


def _quantize_batch(work, factor, start, stop, state, spec, dtype):
    """Quantize columns ``start:stop`` of ``work`` in place; returns the batch's scaled errors."""
    ops, group = state["ops"], state["group"]
    batch = work[:, start:stop]
    errors = np.zeros_like(batch)
    for i in range(stop - start):
        column = start + i
        if spec.granularity == "group" and column % group == 0:
            state["scale"], state["stored"] = _start_scale(ops, batch[:, i:i + group], spec, dtype)
            state["scales"].append(state["stored"])
        codes = round_codes(ops, batch[:, i].astype(dtype), state["scale"], spec)
        state["codes"][:, column] = codes
        error = (batch[:, i] - (codes * state["stored"]).astype(np.float64)) / factor[column, column]
        batch[:, i:] -= np.outer(error, factor[column, column:stop])
        errors[:, i] = error
    return errors


def gptq_quantize_weight(weight, hessian, spec, *, damp=DEFAULT_DAMP, block_size=DEFAULT_BLOCK_SIZE, name="weight"):
    """GPTQ-quantize one linear weight onto ``spec``'s grid, given its calibration Hessian.

    Args:
        weight: float32 (or float64) numpy array ``(out, in)``; scales are computed in its dtype.
        hessian: ``X^T X`` of the layer's calibration inputs ``X`` (rows = tokens), ``(in, in)``.
        spec: a QuantSpec on a grid without block numerics (``check_gptq_spec``).
        damp: the fraction of ``mean(diag H)`` added to H's diagonal.
        block_size: columns per lazy batch (rounded up to a multiple of the group size).
        name: what errors call the weight.

    Returns:
        ``QuantizedArray`` with int8 codes ``(out, in)`` and scales laid out as ``quantize_array``'s.

    Raises:
        ValueError: the spec is refused, the shapes disagree, non-finite values, or the damped
            Hessian is not positive definite.

    >>> w = np.array([[0.7, -0.35, 0.2, 0.1]], np.float32)
    >>> q = gptq_quantize_weight(w, np.eye(4), QuantSpec(bits=4))  # uncorrelated inputs: round to nearest
    >>> q.codes.tolist(), q.scale.ravel().tolist()
    ([[7, -4, 2, 1]], [0.10000000149011612])
    """
    check_gptq_spec(spec, name)
    check_gptq_options(damp, block_size, name)
    weight, hessian = _checked_inputs(weight, hessian, name)
    out, cols = weight.shape
    block_shape(weight.shape, spec)  # a group size that does not divide the inputs fails here
    dead = np.diag(hessian) == 0
    hessian[dead, dead] = 1.0
    work = weight.astype(np.float64)
    work[:, dead] = 0.0
    factor = _inverse_factor(hessian, float(damp), name)
    group = _group_columns(spec, cols)
    step = -(-block_size // group) * group if spec.granularity == "group" else block_size
    state = {"ops": array_ops(weight), "group": group, "codes": np.zeros((out, cols), weight.dtype), "scales": []}
    if spec.granularity != "group":  # one scale per row (matrix), from the weights before any update
        state["scale"], state["stored"] = _start_scale(state["ops"], work, spec, weight.dtype)
        state["scales"].append(state["stored"])
    for start in range(0, cols, step):
        stop = min(start + step, cols)
        errors = _quantize_batch(work, factor, start, stop, state, spec, weight.dtype)
        work[:, stop:] -= errors @ factor[start:stop, stop:]
    scale = np.stack(state["scales"], axis=1).reshape(block_shape(weight.shape, spec)[:2] + (1,))
    check_dequantized_range(scale, spec, name)
    return QuantizedArray(state["codes"].astype(np.int8), scale.astype(weight.dtype), spec, 0, 1)

