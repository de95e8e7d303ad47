"""A stored quantized array as one record, and the one validation of what a file or layer holds.

``QuantizedArray`` holds what a grid stores for one array: integer ``codes``, float ``scale`` per
block, and where the grid has them (``mixle.core.grids.Grid``) a per-block ``offset`` (a float
min or an integer zero point) and a second level of integer ``sub_scales`` / ``sub_offsets``
under the float super-block scale and min. It dequantizes as

* one level: ``w = code * scale`` (``+ offset`` for a min; ``scale * (code - offset)`` for a
  zero point);
* two levels: ``w = (scale * sub_scale) * code - offset * sub_offset`` per sub-block (ggml's
  ``d * sc * q - dmin * m``).

Shapes, for an array viewed as ``(B, S, K)`` blocks (``mixle.core.numerics.block_shape``):
``scale`` and ``offset`` are ``(B, S, 1)``; ``sub_scales`` and ``sub_offsets`` are
``(B, S, K / sub_block)``. In files (``stored_layout``) 4-bit codes are packed two per byte
(``mixle.core.packing``), other codes stored as int8 (uint8 for unsigned 8-bit grids), sub-scales
as int8 / uint8.

On a lookup grid (``Grid.table``: MXFP4, NF4) a code indexes the table: ``w = table[code] *
scale``. A grid with block numerics (``Grid.numerics``: llama.cpp's Q4_1 ... Q6_K, MXFP4, NF4) is
quantized by its block numerics (``mixle.gguf.ggml_quants``; ``block_quantized_array``); its record holds that block
type's fields (``BlockType.parts``): the codes (shifted to the grid's range), the float16 (or E8M0,
or float32) scales and mins as float32 values, the integer sub-block scales and mins; and
``dequantize`` equals ggml's ``dequantize_row_*`` bit for bit. ``block_fields`` gives them back in
ggml's dtypes, as the block type packs them.

``check_stored`` is the one validation every loader and exporter of both backends calls: shapes
and dtypes, codes on the grid, pad nibbles of packed int4, finite scales with the sign and zero
rules of the grid and representable in its scale dtype, no scale whose largest level dequantizes
to infinity, offsets and sub-scale ranges. It reads numpy, jax and torch arrays and imports
neither torch nor jax.
"""

import math
import sys
from dataclasses import KW_ONLY, dataclass

import numpy as np

from mixle.core.array_ops import array_ops
from mixle.core.checks import ScaleOverflowError
from mixle.core.c_arith import as_numpy, c_ops
from mixle.core.grids import run_weighted
from mixle.core.imatrix import check_importance, importance_rows
from mixle.core.scale_codecs import AS_FLOAT32, scale_codec
from mixle.core.packing import pack_int4, packed_int4_nbytes, unpack_int4
from mixle.core.spec import QuantSpec, block_shape

__all__ = ["QuantizedArray", "block_shape", "check_stored", "stored_layout", "STORED_PARTS", "block_type_of",
           "block_quantized_array", "check_dequantized_range"]

# Every part a stored array may have, in the order files list them.
STORED_PARTS = ("codes", "scale", "offset", "sub_scales", "sub_offsets")
_WORDS = {"codes": "codes", "scale": "scales", "offset": "offsets", "sub_scales": "sub-scales",
          "sub_offsets": "sub-offsets"}


@dataclass(frozen=True, eq=False)
class QuantizedArray:
    """Integer codes, scales and (where the grid has them) offsets and sub-scales of one array.

    Attributes:
        codes: integer codes with the original shape, one per element (int4 codes are held one
            per int8 here; see ``stored`` for two per byte).
        scale: scales with shape ``(B, S, 1)`` in the array's float dtype (see ``block_shape``);
            on a two-level grid the super-block scales; float32 on block-numerics grids (ggml
            computes in float32), holding float16 (or E8M0) values where the grid stores those.
        spec: the QuantSpec used.
        batch_ndim: leading batch axes of the original array.
        out_ndim: output axes after the batch axes.
        offset: ``(B, S, 1)`` float mins or integer zero points, on grids with ``offset``.
        sub_scales: ``(B, S, n)`` integer sub-block scales, on two-level grids.
        sub_offsets: ``(B, S, n)`` integer sub-block mins, on two-level grids with a min.

    >>> q = QuantizedArray(np.array([[2, -1]], np.int8), np.full((1, 1, 1), 0.5, np.float32), QuantSpec(bits=4))
    >>> q.dequantize().tolist()
    [[1.0, -0.5]]
    """

    codes: object
    scale: object
    spec: QuantSpec
    batch_ndim: int = 0
    out_ndim: int | None = None
    _: KW_ONLY
    offset: object = None
    sub_scales: object = None
    sub_offsets: object = None

    @property
    def shape(self):
        """The original array's shape (the codes')."""
        return tuple(self.codes.shape)

    def parts(self):
        """``{part: array}`` of the parts the record holds (codes unpacked).

        >>> sorted(QuantizedArray(np.zeros(2, np.int8), np.ones((1, 1, 1)), QuantSpec()).parts())
        ['codes', 'scale']
        """
        return {name: getattr(self, name) for name in STORED_PARTS if getattr(self, name) is not None}

    def dequantize(self):
        """Float array with the original shape and the scale's dtype (see the module docstring).

        >>> QuantizedArray(np.array([1, 0], np.int8), np.ones((1, 1, 1), np.float32), QuantSpec(bits=8)).dequantize()
        array([1., 0.], dtype=float32)
        """
        grid = self.spec.grid_record
        missing = [p for p in _grid_parts(grid) if getattr(self, p) is None]
        if missing:
            raise ValueError(f"grid {grid.name!r} dequantizes with {missing} too: pass them to QuantizedArray")
        ops = array_ops(self.codes)
        batch, count, size = block_shape(self.codes.shape, self.spec, self.batch_ndim, self.out_ndim)
        codes = self.codes.reshape((batch, count, size))
        if grid.table is not None:  # a lookup grid: the code indexes the table's float32 values
            o = c_ops(codes)
            codes = o.const(grid.table, "float32")[o.to_named(codes, "int64")]
        codes = ops.to_dtype(codes, self.scale)
        if not grid.two_level:
            if grid.offset == "zero_point":
                codes = codes - ops.to_dtype(self.offset, self.scale)
            values = codes * self.scale
            if grid.offset == "min":  # ggml's x*d + m: two roundings (no FMA under XLA)
                values = ops.rounded(values) + self.offset
            return values.reshape(self.codes.shape)
        subs = size // grid.sub_block
        codes = codes.reshape((batch, count, subs, grid.sub_block))
        scale = (self.scale * ops.to_dtype(self.sub_scales, self.scale)).reshape((batch, count, subs, 1))
        values = scale * codes
        if grid.offset == "min":
            mins = ops.rounded(self.offset * ops.to_dtype(self.sub_offsets, self.scale)).reshape(scale.shape)
            values = ops.rounded(values) - mins
        return values.reshape(self.codes.shape)

    def block_fields(self):
        """The fields of the grid's block type (``Grid.block_type``), numpy, in ggml's dtypes,
        shaped ``(B, S, ...)`` as ``BLOCK_TYPES[...].pack`` takes them.

        >>> q = block_quantized_array(np.linspace(-1, 2, 32, dtype=np.float32), QuantSpec(grid="q5_0"))
        >>> f = q.block_fields()
        >>> f.codes[0, 0, [0, -1]].tolist(), f.d.dtype.name
        ([24, 0], 'float16')
        """
        grid = self.spec.grid_record
        block_type = block_type_of(grid)
        batch, count, size = block_shape(self.codes.shape, self.spec, self.batch_ndim, self.out_ndim)
        values = {}
        for part, field in block_type.parts:
            value = as_numpy(getattr(self, part))
            if part == "codes":
                value = (value.astype(np.int16) - block_type.code_shift).astype(np.uint8).reshape(batch, count, size)
            elif part in ("scale", "offset"):
                value = scale_codec(grid.scale_dtype, AS_FLOAT32).encode(value.reshape(batch, count))
            elif grid.sub_scale_dtype is not None:  # float sub-scales, in their codec's field
                value = scale_codec(grid.sub_scale_dtype).encode(value.reshape(batch, count, -1))
            else:
                value = value.reshape(batch, count, -1).astype(np.int8 if grid.sub_scale_signed else np.uint8)
            values[field] = value
        return block_type.fields(**values)

    def check(self, name="array"):
        """Validate the record as ``check_stored`` does (codes one per element).

        >>> QuantizedArray(np.array([[9, 0]], np.int8), np.ones((1, 1, 1)), QuantSpec(bits=4)).check("w")
        Traceback (most recent call last):
        ValueError: w: codes span [0, 9], outside the int4/channel/symmetric grid [-7, 7]: the data is corrupt or was written with another spec
        """
        check_stored(self.codes, self.scale, self.spec, self.shape, offset=self.offset, sub_scales=self.sub_scales,
                     sub_offsets=self.sub_offsets, batch_ndim=self.batch_ndim, out_ndim=self.out_ndim, packed=False,
                     name=name)
        return self

    def stored(self):
        """``{part: array}`` as files store them: 4-bit codes packed two per byte, the rest as held.

        >>> q = QuantizedArray(np.array([[1, -1, 7]], np.int8), np.ones((1, 1, 1), np.float32), QuantSpec(bits=4))
        >>> q.stored()["codes"].tolist()
        [241, 7]
        """
        parts = self.parts()
        if self.spec.bits == 4:
            parts["codes"] = pack_int4(self.codes, signed=self.spec.code_min < 0)
        return parts

    @classmethod
    def from_stored(cls, parts, spec, shape, *, name="array", batch_ndim=0, out_ndim=1):
        """The record of ``parts`` as ``stored`` writes them, validated first (``check_stored``).

        >>> q = QuantizedArray.from_stored({"codes": np.array([241, 7], np.uint8),
        ...                                 "scale": np.ones((1, 1, 1), np.float32)}, QuantSpec(bits=4), (1, 3))
        >>> q.codes.tolist()
        [[1, -1, 7]]
        """
        unknown = sorted(set(parts) - set(STORED_PARTS))
        if unknown:
            raise ValueError(f"{name}: {unknown} are not parts of a stored array (those are {list(STORED_PARTS)})")
        check_stored(parts.get("codes"), parts.get("scale"), spec, shape, offset=parts.get("offset"),
                     sub_scales=parts.get("sub_scales"), sub_offsets=parts.get("sub_offsets"),
                     batch_ndim=batch_ndim, out_ndim=out_ndim, name=name)
        codes = parts["codes"]
        if spec.bits == 4:
            codes = unpack_int4(codes, tuple(shape), signed=spec.code_min < 0)
        extra = {p: parts.get(p) for p in ("offset", "sub_scales", "sub_offsets")}
        return cls(codes, parts["scale"], spec, batch_ndim, out_ndim, **extra)


def _grid_parts(grid):
    """The parts beyond codes and scale that ``grid`` stores."""
    parts = [] if grid.offset is None else ["offset"]
    if grid.two_level:
        parts.append("sub_scales")
        if grid.offset == "min":
            parts.append("sub_offsets")
    return parts


def block_type_of(grid):
    """The block numerics (``mixle.core.grids.BlockType``) a grid record holds; ValueError for
    a grid without block numerics.

    >>> block_type_of(QuantSpec(grid="q4_k").grid_record).bytes_per_block
    144
    """
    if grid.block_type is None:
        raise ValueError(f"grid {grid.name!r} has no block numerics (Grid.numerics): it is quantized by "
                         f"mixle.core.numerics' own block rules")
    return grid.block_type


def _weighted_fields(x, grid, importance, batch_ndim, out_ndim):
    """The fields of ggml's importance-weighted quantizer of x, laid out as the reference's."""
    batch, rows, cols = importance_rows(tuple(x.shape), batch_ndim, out_ndim)
    if grid.weighted is None:
        raise ValueError(f"grid {grid.name!r} has no importance-weighted quantizer in ggml")
    fields = run_weighted(grid.weighted, x.reshape((batch, rows, cols)), importance)
    return type(fields)(*(f.reshape((batch, -1) + tuple(f.shape[3:])) for f in fields))


def block_quantized_array(x, spec, *, batch_ndim=0, out_ndim=None, check=True, name="x", importance=None):
    """The QuantizedArray of x on a grid with block numerics, bit for bit as ggml quantizes it.

    Args:
        x: float numpy array or torch tensor (computed in float32, as ggml does), ``batch + out + in``.
        spec: a QuantSpec whose grid has ``numerics`` (e.g. ``QuantSpec(grid="q4_k")``).
        batch_ndim, out_ndim: the layout (``block_shape``); the blocks run along each row.
        check: refuse a float16 scale or min that overflows (huge weights); callers that check
            ``scale`` and ``offset`` asynchronously themselves pass False.
        name: what the error calls x.
        importance: one weight per input column (``mixle.core.imatrix.check_importance``
            checks it), or None: with it, the blocks are ggml's importance-weighted quantizer's
            (``llama-quantize --imatrix``), on ``q4_0`` too (``mixle.gguf.ggml_weighted``).

    Returns:
        QuantizedArray in x's library with float32 scales (see the module docstring).

    Raises:
        ValueError: rows whose length the block does not divide.
        ScaleOverflowError: a scale or min does not fit float16.

    >>> q = block_quantized_array(np.linspace(-1, 1, 256, dtype=np.float32), QuantSpec(grid="q4_k"))
    >>> q.sub_scales.shape, q.sub_scales[0, 0].tolist()
    ((1, 1, 8), [15, 15, 15, 15, 15, 31, 48, 63])
    """
    grid = spec.grid_record
    own = grid.weighted if importance is not None and grid.weighted is not None else None
    if own is not None and own.parts is not None:
        block_parts, code_shift = own.parts, own.code_shift
    else:
        block_parts, code_shift = block_type_of(grid).parts, block_type_of(grid).code_shift
    if importance is not None:
        importance = check_importance(importance, tuple(x.shape), batch_ndim=batch_ndim, out_ndim=out_ndim, name=name)
        fields = _weighted_fields(x, grid, importance, batch_ndim, out_ndim)
    else:
        batch, count, size = block_shape(tuple(x.shape), spec, batch_ndim, out_ndim)
        fields = block_type_of(grid).quantize(x.reshape((batch, count * size)))
    o = c_ops(fields.codes)
    parts = {}
    for part, field in block_parts:
        value = getattr(fields, field)
        if part == "codes":
            value = o.to_named(o.to_named(value, "int32") + code_shift, "int8").reshape(tuple(x.shape))
        elif part in ("scale", "offset"):
            value = scale_codec(grid.scale_dtype, AS_FLOAT32).decode(o, value)[..., None]
        elif grid.sub_scale_dtype is not None:  # float sub-scales: their float32 values
            value = scale_codec(grid.sub_scale_dtype).decode(o, value)
        parts[part] = value
    if check:
        for part in ("scale", "offset"):
            ops = array_ops(parts[part]) if part in parts else None  # traced jax values cannot be read
            if ops is not None and ops.readable(parts[part]) and not ops.all_finite(parts[part]):
                raise ScaleOverflowError(
                    f"{name}: a block {_WORDS[part][:-1]} does not fit {grid.scale_dtype}, which grid={grid.name!r} "
                    f"stores it in (the weights reach {float(abs(x).max()):.6g}): the weights are too large for this "
                    f"file format; rescale them or use another grid")
    codes, scale = parts.pop("codes"), parts.pop("scale")
    return QuantizedArray(codes, scale, spec, batch_ndim, out_ndim, **parts)


# The smallest magnitude a 16-bit float rounds to infinity: its largest value plus half a step.
_ROUNDS_TO_INFINITY = {"float16": 65520.0, "bfloat16": 2.0 ** 127 * (2 - 2.0 ** -8)}


def check_dequantized_range(scale, spec, name="x", dtype=None):
    """Refuse scales whose largest level dequantizes to infinity (``Grid.largest_level`` times the
    scale overflowing its dtype: e.g. code -8 of ``grid="qwix"`` near float32's maximum), or
    rounds to infinity in ``dtype``, the 16-bit dtype the values are then written in.

    Grids that store scales as float16 or E8M0 cannot overflow float32 and are checked only for a
    16-bit ``dtype``.

    Args:
        scale: the scales (any shape; numpy, torch or jax).
        spec: the QuantSpec.
        name: what the error calls the array.
        dtype: ``"bfloat16"`` or ``"float16"`` for values rounded to that dtype (a 16-bit weight's,
            whose numerics run in float32), else None (the scales' own dtype).

    Raises:
        ScaleOverflowError: a dequantized level would be infinite; names ``name`` and the fix.

    >>> big = np.float32(3.3e38)
    >>> check_dequantized_range(np.array([big / np.float32(7.5)]), QuantSpec(grid="qwix"), "w")
    Traceback (most recent call last):
    mixle.core.checks.ScaleOverflowError: w: on int4/channel/qwix the block scale 4.4e+37 times the grid's largest level 8 overflows float32 (the block's weights reach about 3.3e+38), so a finite weight would dequantize to infinity: rescale the weights (e.g. halve them and double what they feed), or use a grid whose largest code is its divisor (grid='symmetric' at bits=4)
    """
    grid = spec.grid_record
    limit = _ROUNDS_TO_INFINITY.get(dtype)
    if grid.scale_dtype is not None and limit is None:
        return
    largest = grid.largest_level(spec.bits)
    array = _view(scale)[0]
    with np.errstate(over="ignore", invalid="ignore"):
        top = np.abs(array) * array.dtype.type(largest)
        bad = ~np.isfinite(top) if limit is None else ~(top < limit)
    if not bad.any():
        return
    worst = float(np.abs(array[bad]).max())
    divisor = abs(spec.scale_divisor)
    raise ScaleOverflowError(
        f"{name}: on {spec.short()} the block scale {worst:.2g} times the grid's largest level {largest:g} overflows "
        f"{dtype if limit is not None else array.dtype} (the block's weights reach about {worst * divisor:.2g}), so a "
        f"finite weight would dequantize to infinity: rescale the weights (e.g. halve them and double what they "
        f"feed), or use a grid whose largest code is its divisor (grid='symmetric' at bits=4)")


def _int_dtype(low, high):
    return "int8" if -128 <= low and high <= 127 else "uint8"


def stored_layout(spec, shape, *, batch_ndim=0, out_ndim=1, packed=True):
    """``{part: (dtype, shape)}`` of what an array of ``shape`` on ``spec`` stores.

    ``dtype`` is a numpy dtype name, or ``"float"`` for any floating dtype. ``packed=False``
    describes the record's codes (one int8 per element) instead of the file's.

    Raises:
        ValueError: the spec's blocks do not fit ``shape`` (e.g. a group size not dividing it).

    >>> stored_layout(QuantSpec(bits=4, group_size=2), (3, 4))
    {'codes': ('uint8', (6,)), 'scale': ('float', (1, 6, 1))}
    """
    grid = spec.grid_record
    low, high = spec.code_min, spec.code_max
    if packed and spec.bits == 4:
        layout = {"codes": ("uint8", (packed_int4_nbytes(math.prod(shape)),))}
    else:
        layout = {"codes": (_int_dtype(low, high), tuple(shape))}
    batch, count, size = block_shape(tuple(shape), spec, batch_ndim, out_ndim)
    layout["scale"] = ("float", (batch, count, 1))
    if grid.offset is not None:
        layout["offset"] = ("float" if grid.offset == "min" else _int_dtype(low, high), (batch, count, 1))
    for part in _grid_parts(grid):
        if part != "offset":
            dtype = "float" if grid.sub_scale_dtype is not None else "int8" if grid.sub_scale_signed else "uint8"
            layout[part] = (dtype, (batch, count, size // grid.sub_block))
    return layout


# ----------------------------------------------------------------------------------------------
# The validation.


def _view(x):
    """``(numpy array, dtype label, label prefix)`` of a numpy, jax or torch array (no copy on CPU)."""
    if type(x).__module__.startswith("torch"):
        tensor = x.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            tensor = tensor.float()  # exact; numpy has no bfloat16
        return tensor.numpy(), str(x.dtype), "torch."
    array = np.asarray(x)
    return array, str(array.dtype), ""


def _narrow_is_exact(x, dtype):
    """Whether every value of ``x`` is a value of the scale codec ``dtype`` names."""
    codec = scale_codec(dtype)
    if codec.dtype is not None and type(x).__module__.startswith("torch"):
        torch = sys.modules["torch"]
        return bool(torch.equal(x.to(getattr(torch, codec.dtype)).to(x.dtype), x))
    return not _narrow_bad(_view(x)[0], dtype).any()


def _narrow_bad(array, dtype):
    """Where the values of a numpy ``array`` are not values of the scale codec ``dtype`` names."""
    return scale_codec(dtype).inexact(array)


def _first(bad, values, part):
    """``part[index] = value`` of the first True of ``bad``."""
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    return f"{part}{list(index)} = {values[index].item()!r}"


def _check_dtype_shape(array, label, prefix, want, part, spec, shape, name):
    dtype, want_shape = want
    ok_dtype = array.dtype.kind == "f" if dtype == "float" else array.dtype == np.dtype(dtype)
    if ok_dtype and tuple(array.shape) == want_shape:
        return
    if part == "codes":
        raise ValueError(f"{name}: bits={spec.bits} for a weight of shape {list(shape)} needs {prefix}{dtype} codes "
                         f"of shape {list(want_shape)}, got {label} of shape {list(array.shape)}")
    what = "floats" if dtype == "float" else f"{prefix}{dtype}"
    raise ValueError(f"{name}: {spec.short()} {_WORDS[part]} of a {list(shape)} weight are {what} of shape "
                     f"{list(want_shape)}, got {label} of shape {list(array.shape)}")


def _check_codes(codes, want, spec, shape, packed, name):
    array, label, prefix = _view(codes)
    _check_dtype_shape(array, label, prefix, want, "codes", spec, shape, name)
    values = unpack_int4(array, tuple(shape), signed=spec.code_min < 0) if packed else array
    low, high = int(values.min()), int(values.max())
    if low < spec.code_min or high > spec.code_max:
        raise ValueError(
            f"{name}: codes span [{low}, {high}], outside the {spec.short()} grid "
            f"[{spec.code_min}, {spec.code_max}]: the data is corrupt or was written with another spec"
        )
    count = math.prod(shape)
    if packed and count % 2 and int(array[-1]) >> 4:
        raise ValueError(f"{name}: the pad nibble after the last of {count} int4 codes is not zero: the data is corrupt")


def _scale_problem(scale, array, spec):
    """What the grid requires of its scales that ``scale`` violates, as ``(requirement, where)``."""
    # A signed-max scale carries the sign of its block's extreme value; zero_scale=None keeps an
    # all-zero block's scale 0.
    grid = spec.grid_record
    signed = grid.scale_rule == "signed_max"
    magnitude = abs(array) if signed else array
    if grid.zero_scale is None:
        sign_ok, wanted = magnitude >= 0, "finite" if signed else "finite and non-negative"
    else:
        sign_ok, wanted = magnitude > 0, "finite and non-zero" if signed else "finite and positive"
    bad = ~(np.isfinite(array) & sign_ok)
    if bad.any():
        return wanted, _first(bad, array, "scale")
    dtype = grid.scale_dtype
    if dtype is not None and not _narrow_is_exact(scale, dtype):
        where = _first(_narrow_bad(array, dtype), array, "scale")
        largest = scale_codec(dtype).largest
        if largest is not None and np.abs(array).max() > largest:
            where += f", above {dtype}'s largest {largest:g}"
        return f"{wanted} {dtype} values (the grid stores them in {dtype})", where
    try:
        check_dequantized_range(array, spec)
    except ScaleOverflowError:
        largest = grid.largest_level(spec.bits)
        with np.errstate(over="ignore"):
            bad = ~np.isfinite(np.abs(array) * array.dtype.type(largest))
        return (f"{wanted} and small enough that the largest level ({largest:g}) times them is finite (else a "
                f"weight dequantizes to infinity)", _first(bad, array, "scale"))
    return None


def _check_float_part(part, value, want, spec, shape, name):
    array, label, prefix = _view(value)
    _check_dtype_shape(array, label, prefix, want, part, spec, shape, name)
    grid = spec.grid_record
    if part == "scale":
        problem = _scale_problem(value, array, spec)
    elif not np.isfinite(array).all():
        problem = "finite", _first(~np.isfinite(array), array, part)
    elif (dtype := grid.scale_dtype if part == "offset" else grid.sub_scale_dtype) is not None \
            and not _narrow_is_exact(value, dtype):
        problem = f"finite {dtype} values (the grid stores them in {dtype})", _first(_narrow_bad(array, dtype), array, part)
    else:
        problem = None
    if problem:
        raise ValueError(f"{name}: {spec.short()} {_WORDS[part]} must be {problem[0]}; the data is corrupt: {problem[1]} "
                         f"(save the array again from the model)")


def _check_int_part(part, value, want, spec, shape, name):
    array, label, prefix = _view(value)
    _check_dtype_shape(array, label, prefix, want, part, spec, shape, name)
    grid = spec.grid_record
    low, high = (spec.code_min, spec.code_max) if part == "offset" else grid.sub_scale_range()
    bad = (array < low) | (array > high)
    if bad.any():
        what = "zero points" if part == "offset" else f"{grid.sub_scale_bits}-bit {_WORDS[part]}"
        raise ValueError(f"{name}: {spec.short()} {what} lie in [{low}, {high}], got {_first(bad, array, part)}: "
                         f"the data is corrupt or was written for another grid")


def check_stored(codes, scale, spec, shape, *, offset=None, sub_scales=None, sub_offsets=None, batch_ndim=0,
                 out_ndim=1, packed=True, name="tensor", tensor_names=None):
    """Validate one stored quantized array before it is used (see the module docstring).

    Args:
        codes: the codes as files store them (``packed=False``: one int8 per element).
        scale: float scales ``(B, S, 1)``.
        spec: the QuantSpec they were made with; its grid says which other parts must be there.
        shape: the array's shape (a 2-D weight ``(rows, cols)`` by default).
        offset, sub_scales, sub_offsets: the grid's other parts (None where it has none).
        batch_ndim, out_ndim: the array's layout (``block_shape``).
        packed: whether 4-bit codes are packed two per byte.
        name: what the messages call the array (e.g. ``"model.safetensors: layer 'fc1'"``).
        tensor_names: optional ``{part: file tensor name}``, named too in the messages.

    Raises:
        ValueError: anything disagrees; the message names ``name``, the value and the fix.

    >>> check_stored(np.array([[7, -7]], np.int8), np.ones((1, 1, 1), np.float32), QuantSpec(bits=8), (1, 2))
    >>> check_stored(np.array([[7, -7]], np.int8), -np.ones((1, 1, 1), np.float32), QuantSpec(bits=8), (1, 2),
    ...              name="fc")
    Traceback (most recent call last):
    ValueError: fc: int8/channel/symmetric scales must be finite and positive; the data is corrupt: scale[0, 0, 0] = -1.0 (save the array again from the model)
    """
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{name}: spec must be a mixle QuantSpec, got {type(spec).__name__}")
    shape = tuple(int(d) for d in shape)
    if not shape or min(shape) < 1:
        raise ValueError(f"{name}: the array's shape must have positive sizes, got {list(shape)}")
    try:
        layout = stored_layout(spec, shape, batch_ndim=batch_ndim, out_ndim=out_ndim, packed=packed)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    given = {"codes": codes, "scale": scale, "offset": offset, "sub_scales": sub_scales, "sub_offsets": sub_offsets}
    names = {part: f"{name}, tensor {tensor!r}" for part, tensor in (tensor_names or {}).items()}
    for part, value in given.items():
        if (value is None) != (part not in layout):
            grid = spec.grid_record
            if value is None:
                raise ValueError(f"{name}: grid {grid.name!r} stores {_WORDS[part]} too, none was given: "
                                 f"the file is incomplete or was written for another grid")
            raise ValueError(f"{names.get(part, name)}: grid {grid.name!r} stores no {_WORDS[part]}: drop them, or "
                             f"use the grid they were made for")
    _check_codes(codes, layout["codes"], spec, shape, packed and spec.bits == 4, names.get("codes", name))
    for part in STORED_PARTS[1:]:
        if part in layout:
            check = _check_float_part if layout[part][0] == "float" else _check_int_part
            check(part, given[part], layout[part], spec, shape, names.get(part, name))
