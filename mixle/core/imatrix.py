"""llama.cpp's importance matrix as one record: per matrix, the summed squared inputs of each input
column and how many input rows (tokens) were summed.

``llama-imatrix`` (``tools/imatrix/imatrix.cpp`` of the llama.cpp vendored by llama-cpp-python
0.3.36) adds, for every matrix product ``W @ x`` of a ``blk.*`` weight whose batch has at least 16
rows, ``x[j] * x[j]`` of each row to a float32 sum per input column ``j`` and the row count to the
matrix's count; stacked experts keep one sum vector and one count per expert. ``llama-quantize``
then weights each column by the mean ``sum / (float)count`` (1 where the count is 0).
``Imatrix`` holds those sums and counts keyed by name (GGUF tensor names as in the file, or model
paths as ``calibrate_importance`` collects them); ``importance`` gives the means llama-quantize
quantizes with; ``check_entries`` refuses entries that do not fit a model. ``check_importance``
validates the importance one array is quantized with (one value per input column).
"""

from dataclasses import dataclass, field

import numpy as np

from mixle.core.array_ops import is_tracer
from mixle.core.c_arith import as_numpy

__all__ = ["Imatrix", "check_entries", "check_importance", "importance_rows"]


@dataclass
class Imatrix:
    """Sums of squared inputs and token counts per matrix.

    Attributes:
        sums: ``{name: float32 (n_mat, columns)}``: one row per expert (1 for a dense matrix).
        counts: ``{name: int64 (n_mat,)}``: input rows summed, per expert.
        datasets: the calibration texts' names (``imatrix.datasets``).
        chunk_count: chunks processed (``imatrix.chunk_count``).
        chunk_size: tokens per chunk (``imatrix.chunk_size``).

    >>> m = Imatrix({"blk.0.ffn_up.weight": np.array([[4.0, 0.0]], np.float32)}, {"blk.0.ffn_up.weight": np.array([2])})
    >>> m.importance()["blk.0.ffn_up.weight"].tolist()
    [2.0, 0.0]
    """

    sums: dict
    counts: dict
    datasets: tuple = ()
    chunk_count: int = 0
    chunk_size: int = 0
    legacy: bool = field(default=False, repr=False)

    def importance(self):
        """``{name: float32 (columns,) or (n_mat, columns)}``: ``sums / float32(count)`` per expert,
        1 where the count is 0, as llama-quantize loads a GGUF imatrix (a legacy file's sums are
        divided by its call count, or kept where it is 0)."""
        out = {}
        for name, sums in self.sums.items():
            sums = np.asarray(sums, np.float32)
            counts = np.asarray(self.counts[name]).astype(np.float32)[:, None]
            if self.legacy:
                mean = np.where(counts > 0, sums / np.where(counts > 0, counts, 1), sums)
            else:
                mean = np.where(counts > 0, sums / np.where(counts > 0, counts, 1), np.float32(1.0))
            out[name] = mean.astype(np.float32)[0] if mean.shape[0] == 1 else mean.astype(np.float32)
        return out


def check_entries(imatrix, shapes, *, min_tokens=1, what="imatrix"):
    """Refuse an imatrix that does not fit a model's matrices.

    Args:
        imatrix: an ``Imatrix``.
        shapes: ``{name: numpy-order shape}`` of the model's matrices under the imatrix's names
            (``(rows, columns)``, or ``(experts, rows, columns)``).
        min_tokens: the fewest input rows an entry may have summed (per expert; an expert no token
            was routed to, count 0, is allowed where others were).
        what: what errors call the imatrix (its file).

    Raises:
        ValueError: an entry for a name the model has no matrix of, a column (or expert) count
            other than the matrix's, a non-finite or negative sum, or too few tokens; the message
            names the tensor.

    >>> m = Imatrix({"a": np.ones((1, 4), np.float32)}, {"a": np.array([8])})
    >>> check_entries(m, {"a": (2, 4)}, min_tokens=4)
    """
    for name, sums in imatrix.sums.items():
        sums, counts = np.asarray(sums), np.asarray(imatrix.counts.get(name, []))
        if name not in shapes:
            known = sorted(shapes)[:4]
            raise ValueError(f"{what}: tensor {name!r} is not a matrix of this model (it has e.g. {known}): the "
                             f"importance matrix was computed for another model")
        shape = tuple(shapes[name])
        want = (shape[0] if len(shape) == 3 else 1, shape[-1])
        if sums.shape != want or counts.shape != (want[0],):
            raise ValueError(f"{what}: tensor {name!r} has sums of shape {sums.shape} and counts {counts.shape}, but "
                             f"the model's matrix {shape} needs {want} and ({want[0]},): the importance matrix was "
                             f"computed for another model")
        if not np.isfinite(sums).all() or (sums < 0).any():
            bad = np.argwhere(~np.isfinite(sums) | (sums < 0))[0]
            raise ValueError(f"{what}: tensor {name!r} has the sum {sums[tuple(bad)]!r} at {tuple(int(i) for i in bad)}:"
                             f" sums of squares are finite and non-negative")
        # an expert no token was routed to has count 0 (llama-quantize then weights it by 1): allowed
        used = counts[counts > 0] if counts.size > 1 and counts.any() else counts
        if (used < min_tokens).any():
            raise ValueError(f"{what}: tensor {name!r} was summed over {int(used.min())} input rows, fewer than "
                             f"min_tokens={min_tokens}: calibrate on more text (or lower min_tokens)")


def importance_rows(shape, batch_ndim=0, out_ndim=None):
    """``(batch, rows, columns)`` of a ``batch + out + in`` array: the columns an importance vector
    has one value for (the product of the input axes).

    >>> importance_rows((3, 8, 64), batch_ndim=1)
    (3, 8, 64)
    """
    shape = tuple(int(d) for d in shape)
    rest = shape[batch_ndim:]
    out_ndim = (1 if len(rest) >= 2 else 0) if out_ndim is None else out_ndim
    batch = int(np.prod(shape[:batch_ndim], dtype=np.int64))
    rows = int(np.prod(rest[:out_ndim], dtype=np.int64))
    return batch, rows, int(np.prod(rest[out_ndim:], dtype=np.int64))


def check_importance(importance, shape, *, batch_ndim=0, out_ndim=None, name="x"):
    """The importance of an array of ``shape``, validated, as float32 ``(batch or 1, 1, columns)``.

    Args:
        importance: one non-negative finite value per input column: shape ``(columns,)``, or the
            batch axes then ``(columns,)`` for stacked experts (numpy, torch or a list).
        shape, batch_ndim, out_ndim: the array's layout (``importance_rows``).
        name: what the error calls the array.

    Returns:
        numpy float32 ``(B, 1, columns)``, B the batch size or 1.

    Raises:
        ValueError: a wrong shape, or a negative, NaN or infinite entry (its column named).

    >>> check_importance([1.0, 2.0], (3, 2)).shape
    (1, 1, 2)
    """
    batch, _, columns = importance_rows(shape, batch_ndim, out_ndim)
    allowed = [(columns,), tuple(shape[:batch_ndim]) + (columns,)]
    traced = is_tracer(importance)  # a traced slice of an importance checked while concrete (a loop over kernels)
    values = importance if traced else np.asarray(as_numpy(importance), dtype=np.float64)
    if tuple(values.shape) not in allowed:
        shapes = " or ".join(str(a) for a in dict.fromkeys(allowed))
        raise ValueError(f"{name}: importance has shape {tuple(values.shape)}, but the array of shape {tuple(shape)} has "
                         f"{columns} input columns: pass one value per column, shape {shapes}")
    if traced:
        return values.astype(np.float32).reshape((batch if values.ndim > 1 else 1, 1, columns))
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        where = np.argwhere(bad)[0]
        raise ValueError(f"{name}: importance[{', '.join(map(str, where))}] = {float(values[tuple(where)])!r}: an importance "
                         f"must be finite and non-negative (llama.cpp's mean squared activations)")
    values = values.astype(np.float32)
    return values.reshape((batch if values.ndim > 1 else 1, 1, columns))
