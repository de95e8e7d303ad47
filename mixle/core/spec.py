"""QuantSpec: the one description of how weights are quantized, shared by every backend."""

import math
import numbers
import dataclasses
from dataclasses import dataclass

from mixle.core.grids import GRIDS, grid_named
from mixle.core.product_inputs import act_rounding_named

GRANULARITIES = ("tensor", "channel", "group")
# The widths of the plain grids (symmetric, qwix); a grid's own widths are its ``codes`` keys.
SUPPORTED_BITS = (4, 8)
WEIGHT_FORMATS = ("int", "float8_e4m3fn")
# fp8 variants that only AMD (and some TPU) hardware implements: no export path, so refused.
AMD_FP8_FORMATS = ("float8_e4m3fnuz", "float8_e5m2fnuz")
STOCHASTIC_ROUNDING = ("uniform", "low_bit_uniform")
CALIBRATIONS = ("absmax", "minmax", "rms", "fixed")
# The weight-grid options every backend honours.
WEIGHT_FIELDS = ("bits", "grid", "granularity", "group_size", "clip_percentile", "clip_gradient")
# Options only the Flax (Qwix) backend honours; every other backend refuses them when set.
QWIX_ONLY_FIELDS = ("act_bits", "weight_format", "bwd_bits", "bwd_stochastic_rounding", "calibration")
# The activation options the torch backend honours (mixle.torch_backend.layers.activations).
ACTIVATION_FIELDS = ("act_bits", "act_symmetric", "act_rounding")
SCALE_MODES = ("absmax", "learned")


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """What to quantize and how; validated on construction, immutable, hashable.

    Args:
        bits: integer width of the codes, one the grid has (4 or 8 on the plain grids). Left as
            None it is the grid's only width (``grid="q8_0"`` is 8-bit, ``"q6_k"`` 6-bit), else 4.
        grid: a name from ``mixle.core.grids.GRIDS``: ``"symmetric"`` (codes -qmax..qmax,
            scale = absmax / qmax; mixle's default), ``"qwix"`` (codes -2^(b-1)..2^(b-1)-1,
            scale = absmax / (qmax + 0.5); Qwix's grid), llama.cpp's ``"q4_0"`` / ``"q8_0"``,
            ``"q4_1"``, ``"q5_0"``, ``"q5_1"``, ``"q4_k"``, ``"q5_k"``, ``"q6_k"``, ``"mxfp4"``, or
            QLoRA's ``"nf4"`` (each fixes its bits and its blocks).
        granularity: ``"tensor"`` (one scale), ``"channel"`` (one scale per output row; the
            default) or ``"group"`` (one scale per ``group_size`` consecutive inputs of a row).
            Left as ``None`` it is ``"group"`` when ``group_size`` is given, else ``"channel"``.
        group_size: inputs per scale for ``granularity="group"``; must divide the input size.
        clip_percentile: if set, the scale comes from this percentile of ``|w|`` (computed per
            tensor, row or group) instead of the maximum; values beyond it saturate.
        clip_gradient: the straight-through estimator passes no gradient to weights clipped
            by ``clip_percentile`` (requires it).

    Flax (Qwix) only; other backends refuse them when set:

    Args:
        act_bits: also quantize the activations entering each selected matmul to 4 or 8 bits,
            dynamically with one scale per token, on the same grid as the weights (Flax and
            torch). On llama.cpp's grids (torch): ``act_bits=8`` is what its CPU path does to
            them, along each token's inputs Q8_0 blocks of 32 (``q4_0``, ``q8_0``, ``q4_1``,
            ``q5_0``, ``q5_1``, ``mxfp4``) or Q8_K blocks of 256 (the K-quants): the grid
            record's ``activation_grid``.
        weight_format: ``"int"`` (codes of ``bits`` bits) or ``"float8_e4m3fn"`` (fp8 weights,
            scale = absmax / 448; needs ``bits=8`` and ``grid="qwix"``).
        bwd_bits: quantize the incoming gradients of the backward matmuls to 4 or 8 bits.
        bwd_stochastic_rounding: ``"uniform"`` or ``"low_bit_uniform"`` rounding of those
            gradients (needs ``bwd_bits``; draws from the ``stochastic_rounding`` RNG stream).
        calibration: Qwix's weight range method instead of absmax: ``"absmax,<f>"``,
            ``"minmax[,<f>]"`` (asymmetric, with a zero point), ``"rms,<f>"`` or
            ``"fixed,<lo>,<hi>"`` (one fixed range, so ``granularity="tensor"``). Needs
            ``grid="qwix"``: the symmetric grid already is ``absmax,<(qmax+0.5)/qmax>``.
        act_symmetric: True (default) quantizes activations on the weights' grid (absmax per
            token); False uses an asymmetric per-token range with a zero point (codes
            -2^(b-1)..2^(b-1)-1, scale = (max - min) / (2^b - 1), as torchao's 8da4w). Torch
            backend only (Qwix calibrates activations by absmax); needs ``act_bits``.
        act_rounding: on llama.cpp's grids, which of its CPU builds' rounding of a product's input
            to Q8_0 blocks ``act_bits=8`` trains on (``mixle.core.product_inputs``): ``"reference"``
            (the default: ggml's C code and gguf-py, half away from zero), ``"x86"`` (AVX, AVX2
            and AVX-512 builds: ``127 / max``, ties to even) or ``"arm"`` (NEON builds: ties to
            even). Torch and Flax; needs ``act_bits``.
        act_static_scale: refused: static activation scales need a calibration pass.
        kv_cache_bits: refused: Qwix's training provider has no KV-cache seam.

    >>> QuantSpec(bits=4, group_size=32)
    QuantSpec(bits=4, grid='symmetric', granularity='group', group_size=32, clip_percentile=None, clip_gradient=False)
    """

    bits: int | None = None
    grid: str = "symmetric"
    granularity: str | None = None
    group_size: int | None = None
    clip_percentile: float | None = None
    clip_gradient: bool = False
    act_bits: int | None = None
    weight_format: str = "int"
    bwd_bits: int | None = None
    bwd_stochastic_rounding: str | None = None
    calibration: str | None = None
    act_static_scale: bool = False
    kv_cache_bits: int | None = None
    act_symmetric: bool = True
    act_rounding: str = "reference"
    scale: str = "absmax"

    def __post_init__(self):
        grid = self._check_bits()
        self._check_refused()
        calibration = self._check_calibration()
        if grid.block is not None:
            self._fix_block(grid)
        self._check_granularity(calibration)
        self._check_clipping()
        self._check_qwix_options(calibration)
        self._check_act_symmetric()
        self._check_activation_grid(grid)
        self._check_act_rounding(grid)
        self._check_scale(grid)

    def _check_bits(self):
        """Validate ``bits`` against the grid's codes (None: its only width, else 4); returns the grid."""
        grid = grid_named(self.grid)
        if self.bits is None:
            object.__setattr__(self, "bits", next(iter(grid.codes)) if len(grid.codes) == 1 else 4)
        if not _is_int(self.bits):
            raise TypeError(f"bits must be an int (4 or 8), got {self.bits!r} of type {type(self.bits).__name__}")
        object.__setattr__(self, "bits", int(self.bits))
        if self.bits not in grid.codes:
            widths = " or ".join(f"bits={b}" for b in grid.codes)
            raise ValueError(
                f"grid={self.grid!r} has no bits={self.bits} codes ({grid.summary}): use {widths} (or leave bits "
                f"unset), or another grid"
            )
        return grid

    def _check_granularity(self, calibration):
        """Fill in the default granularity and validate it with ``group_size``."""
        granularity = self.granularity
        if granularity is None:
            if calibration is not None and calibration.startswith("fixed"):
                granularity = "tensor"
            else:
                granularity = "group" if self.group_size is not None else "channel"
            object.__setattr__(self, "granularity", granularity)
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity={granularity!r} is unknown: use one of {GRANULARITIES}")
        if granularity == "group":
            if self.group_size is None:
                raise ValueError("granularity='group' needs group_size: pass e.g. group_size=32")
            if not _is_int(self.group_size):
                raise TypeError(f"group_size must be a positive int, got {self.group_size!r}")
            if self.group_size <= 0:
                raise ValueError(f"group_size={self.group_size!r} must be a positive int, e.g. 32")
            object.__setattr__(self, "group_size", int(self.group_size))
        elif self.group_size is not None:
            raise ValueError(
                f"group_size={self.group_size!r} only applies to granularity='group', "
                f"not granularity={granularity!r}: drop group_size or use granularity='group'"
            )

    def _check_clipping(self):
        """Validate ``clip_percentile`` (stored as a float) and ``clip_gradient``."""
        p = self.clip_percentile
        if p is not None:
            if not _is_real(p):
                raise TypeError(f"clip_percentile must be a number in (0, 100] or None, got {p!r}")
            if not (math.isfinite(p) and 0 < p <= 100):
                raise ValueError(
                    f"clip_percentile={p!r} is out of range: use a value in (0, 100], e.g. 99.9, "
                    f"or None for no clipping"
                )
            object.__setattr__(self, "clip_percentile", float(p))
        if not isinstance(self.clip_gradient, bool):
            raise TypeError(f"clip_gradient must be True or False, got {self.clip_gradient!r}")
        if self.clip_gradient and p is None:
            raise ValueError(
                "clip_gradient=True masks the gradient of weights clipped by clip_percentile, "
                "but clip_percentile is None: set clip_percentile (e.g. 99.9) or clip_gradient=False"
            )

    def _check_activation_grid(self, grid):
        """Refuse ``act_bits`` on block-numerics grids that name no activation grid (NF4)."""
        if self.act_bits is None or grid.numerics is None or grid.activation_grid is not None:
            return
        raise ValueError(
            f"act_bits={self.act_bits!r} with grid={grid.name!r}: the grid names no activation grid "
            f"(Grid.activation_grid): no llama.cpp product reads it, so there is no input rounding to "
            f"reproduce; leave act_bits=None"
        )

    def _check_act_rounding(self, grid):
        """Validate ``act_rounding``: a known llama.cpp build, chosen only for llama.cpp's products."""
        act_rounding_named(self.act_rounding)
        if self.act_rounding == "reference":
            return
        if self.act_bits is None:
            raise ValueError(f"act_rounding={self.act_rounding!r} chooses how llama.cpp rounds each product's input, "
                             f"but act_bits is None: set act_bits=8 too, or drop act_rounding")
        if grid.activation_grid is None:
            raise ValueError(f"act_rounding={self.act_rounding!r} with grid={grid.name!r}: only llama.cpp's grids "
                             f"have products whose input a llama.cpp build rounds; drop act_rounding")

    def _check_act_symmetric(self):
        """Validate ``act_symmetric``, which only means something with ``act_bits``."""
        if not isinstance(self.act_symmetric, bool):
            raise TypeError(f"act_symmetric must be True or False, got {self.act_symmetric!r}")
        if not self.act_symmetric and self.act_bits is None:
            raise ValueError("act_symmetric=False chooses how activations are quantized, but act_bits is None: "
                             "set act_bits=8 too, or drop act_symmetric")

    def _check_scale(self, grid):
        if self.scale not in SCALE_MODES:
            raise ValueError(f"scale={self.scale!r} is unknown: use one of {SCALE_MODES}")
        if self.scale != "learned":
            return
        if grid.block is not None:
            raise ValueError(
                f"scale='learned' with grid={grid.name!r}: that file format fixes how each block's scale is "
                f"computed ({grid.summary}), so a trained scale would not be the one llama.cpp's quantizer "
                f"writes; use grid='symmetric' or 'qwix' for learned scales"
            )
        if self.clip_percentile is not None or self.calibration is not None:
            raise ValueError(
                "scale='learned' trains the range itself, but clip_percentile/calibration also set it: drop them"
            )
        if self.weight_format != "int":
            raise ValueError(f"scale='learned' needs integer weights, not weight_format={self.weight_format!r}")

    def _fix_block(self, grid):
        """A grid with a fixed block (llama.cpp's) sets group granularity and the block size."""
        if self.granularity not in (None, "group") or self.group_size not in (None, grid.block):
            raise ValueError(
                f"grid={grid.name!r} stores blocks of {grid.block} ({grid.summary}), which conflicts with "
                f"granularity={self.granularity!r}, group_size={self.group_size!r}: leave both unset"
            )
        if (grid.scale_rule != "absmax" or grid.numerics is not None) and self.clip_percentile is not None:
            raise ValueError(
                f"clip_percentile={self.clip_percentile!r} sets the scale from a percentile, but grid="
                f"{grid.name!r} fixes its scale rule ({grid.summary}): drop clip_percentile"
            )
        object.__setattr__(self, "granularity", "group")
        object.__setattr__(self, "group_size", grid.block)

    def _check_refused(self):
        """Options with no seam in any backend: refused here, with the reason."""
        if not isinstance(self.act_static_scale, bool):
            raise TypeError(f"act_static_scale must be True or False, got {self.act_static_scale!r}")
        if self.act_static_scale:
            raise ValueError(
                "act_static_scale=True is not supported: static activation scales need a calibration "
                "pass over data to collect ranges, which mixle's QAT does not run; use dynamic "
                "per-token activation scales (act_bits=8) instead"
            )
        if self.kv_cache_bits is not None:
            raise ValueError(
                f"kv_cache_bits={self.kv_cache_bits!r} is not supported: KV-cache quantization happens "
                f"in the attention cache, which Qwix's training provider does not intercept (it only "
                f"sees dot_general, einsum, conv and ragged_dot); leave kv_cache_bits=None"
            )
        fmt = self.weight_format
        if fmt in AMD_FP8_FORMATS:
            raise ValueError(
                f"weight_format={fmt!r} is an AMD-only fp8 variant (the 'fnuz' formats): it has no "
                f"export or kernel path here; use weight_format='float8_e4m3fn'"
            )
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format={fmt!r} is unknown: use one of {WEIGHT_FORMATS}")

    def _check_calibration(self):
        """Validate ``calibration`` as ``method[,args]`` and store it normalised; returns it."""
        text = self.calibration
        if text is None:
            return None
        if not isinstance(text, str):
            raise TypeError(f"calibration must be a string such as 'absmax,0.9' or None, got {text!r}")
        method, *raw = [part.strip() for part in text.lower().split(",")]
        if method == "percentile":
            raise ValueError(
                f"calibration={text!r}: percentile is not a Qwix calibration method; use "
                f"clip_percentile={raw[0] if raw else '99.9'} instead (computed from the live weight)"
            )
        if method not in CALIBRATIONS:
            raise ValueError(f"calibration={text!r} has unknown method {method!r}: use one of {CALIBRATIONS}")
        try:
            args = [float(a) for a in raw]
        except ValueError:
            raise ValueError(
                f"calibration={text!r} has a non-numeric argument: e.g. 'absmax,0.9' or 'fixed,-2,2'"
            ) from None
        if not all(math.isfinite(a) for a in args):
            raise ValueError(f"calibration={text!r} has a non-finite argument")
        if method in ("absmax", "minmax") and (len(args) > 1 or (args and args[0] <= 0)):
            raise ValueError(f"calibration={text!r}: {method} takes at most one positive factor, e.g. '{method},0.9'")
        if method == "rms" and (len(args) != 1 or args[0] <= 0):
            raise ValueError(f"calibration={text!r}: rms needs exactly one positive factor, e.g. 'rms,3.0'")
        if method == "fixed":
            if len(args) == 1:
                args = [-args[0], args[0]]
            if len(args) != 2 or not (args[0] <= 0 <= args[1] and args[0] < args[1]):
                raise ValueError(
                    f"calibration={text!r}: fixed needs a range containing 0, e.g. 'fixed,-2,2' or 'fixed,2'"
                )
        normalised = ",".join([method] + [repr(a) for a in args])
        object.__setattr__(self, "calibration", normalised)
        return normalised

    def _check_qwix_options(self, calibration):
        for name in ("act_bits", "bwd_bits"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_int(value):
                raise TypeError(f"{name} must be an int (4 or 8) or None, got {value!r}")
            if value not in SUPPORTED_BITS:
                raise ValueError(f"{name}={value!r} is not supported: use 4, 8 or None")
            object.__setattr__(self, name, int(value))
        sr = self.bwd_stochastic_rounding
        if sr is not None:
            if sr not in STOCHASTIC_ROUNDING:
                raise ValueError(f"bwd_stochastic_rounding={sr!r} is unknown: use one of {STOCHASTIC_ROUNDING} or None")
            if self.bwd_bits is None:
                raise ValueError(
                    f"bwd_stochastic_rounding={sr!r} rounds quantized gradients, but bwd_bits is None: "
                    f"set bwd_bits=8 (or 4) too"
                )
        if self.weight_format != "int":
            if self.bits != 8 or not self.grid_record.qwix_native:
                raise ValueError(
                    f"weight_format={self.weight_format!r} stores 8-bit floats with Qwix's scale "
                    f"(absmax / 448), which mixle's integer grids do not describe: pass bits=8 and grid='qwix'"
                )
        if calibration is not None:
            if not self.grid_record.qwix_native:
                raise ValueError(
                    f"calibration={calibration!r} is Qwix's range method and needs grid='qwix'; the "
                    f"symmetric grid is itself absmax calibration with factor (qmax + 0.5) / qmax"
                )
            if self.clip_percentile is not None:
                raise ValueError(
                    f"calibration={calibration!r} and clip_percentile={self.clip_percentile!r} both set the "
                    f"weight range: keep one"
                )
            if calibration.startswith("fixed") and self.granularity != "tensor":
                raise ValueError(
                    f"calibration={calibration!r} is one range for the whole tensor, but "
                    f"granularity={self.granularity!r}: use granularity='tensor' (the default with 'fixed')"
                )
            if calibration.startswith("minmax") and self.weight_format != "int":
                raise ValueError(f"calibration={calibration!r} is asymmetric, which fp8 weights do not support")

    def __repr__(self):
        # Qwix-only options appear only when set, so plain specs print as before.
        names = [f.name for f in dataclasses.fields(self)]
        base = QuantSpec.__dataclass_fields__
        shown = [n for n in names if n not in QWIX_ONLY_FIELDS + ("act_static_scale", "kv_cache_bits", "act_symmetric",
                                                                  "act_rounding", "scale")
                 or getattr(self, n) != base[n].default]
        return "QuantSpec(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in shown) + ")"

    def qwix_only_options(self):
        """The Flax-only options set on this spec, as ``{name: value}`` (empty for plain specs).

        >>> QuantSpec(bits=8, act_bits=8).qwix_only_options()
        {'act_bits': 8}
        """
        base = QuantSpec.__dataclass_fields__
        return {n: getattr(self, n) for n in QWIX_ONLY_FIELDS if getattr(self, n) != base[n].default}

    def check_backend(self, backend, fields, does):
        """Refuse what a backend cannot honour: a field set away from its default that is not in
        ``fields``, or a grid that does not list ``backend``.

        Args:
            backend: the backend's name, e.g. ``"torch"``.
            fields: the spec fields it honours.
            does: what it quantizes, for the message (e.g. ``"fake-quantizes weights only"``).

        >>> QuantSpec(bits=8, act_bits=8).check_backend("torch", WEIGHT_FIELDS, "fake-quantizes weights only")
        Traceback (most recent call last):
        ValueError: QuantSpec.act_bits=8 is not supported by the torch backend, which fake-quantizes weights only: leave it at its default (None) for torch models
        """
        base = QuantSpec.__dataclass_fields__
        for name, field in base.items():
            value = getattr(self, name)
            if name not in fields and value != field.default:
                raise ValueError(
                    f"QuantSpec.{name}={value!r} is not supported by the {backend} backend, which {does}: "
                    f"leave it at its default ({field.default!r}) for {backend} models"
                )
        if backend not in self.grid_record.backends:
            usable = [g.name for g in GRIDS.values() if backend in g.backends]
            raise ValueError(
                f"grid={self.grid!r} ({self.grid_record.summary}) is not supported by the {backend} backend "
                f"yet: use one of {usable}"
            )

    @property
    def qmax(self):
        """Largest positive code of a signed ``bits``-bit integer: 7 for int4, 127 for int8."""
        return 2 ** (self.bits - 1) - 1

    @property
    def grid_record(self):
        """The ``mixle.core.grids.Grid`` this spec quantizes on."""
        return GRIDS[self.grid]

    @property
    def code_min(self):
        """Smallest code of the grid at these bits (e.g. -7 symmetric int4, -8 qwix int4)."""
        return self.grid_record.code_range(self.bits)[0]

    @property
    def code_max(self):
        """Largest code of the grid at these bits."""
        return self.grid_record.code_range(self.bits)[1]

    @property
    def scale_divisor(self):
        """The grid's scale divisor at these bits (absmax / divisor is the scale on plain grids)."""
        return self.grid_record.divisor[self.bits]

    def replace(self, **changes):
        """A copy with some fields changed, validated again.

        >>> QuantSpec(bits=4).replace(bits=8).bits
        8
        """
        return dataclasses.replace(self, **changes)

    def short(self):
        """A compact label such as ``int4/channel/symmetric``.

        >>> QuantSpec(bits=4, group_size=32, clip_percentile=99.5).short()
        'int4/group32/symmetric/p99.5'
        >>> QuantSpec(grid="q4_0", act_bits=8, act_rounding="x86").short()
        'int4/group32/q4_0/a8-x86'
        """
        gran = f"group{self.group_size}" if self.granularity == "group" else self.granularity
        label = f"int{self.bits}/{gran}/{self.grid}"
        if self.clip_percentile is not None:
            label += f"/p{self.clip_percentile:g}"
        if self.weight_format != "int":
            label = label.replace(f"int{self.bits}", "fp8", 1)
        if self.calibration is not None:
            label += f"/{self.calibration}"
        if self.scale == "learned":
            label += "/learned"
        if self.act_bits is not None:
            label += f"/a{self.act_bits}" + ("" if self.act_symmetric else "asym")
            label += "" if self.act_rounding == "reference" else f"-{self.act_rounding}"
        if self.bwd_bits is not None:
            label += f"/g{self.bwd_bits}" + ("sr" if self.bwd_stochastic_rounding else "")
        return label


def resolve_spec(spec, spec_fields):
    """The QuantSpec of a call that takes ``spec=None, **spec_fields``: one or the other.

    Args:
        spec: a QuantSpec, or None to build one from ``spec_fields``.
        spec_fields: QuantSpec fields given as keywords (``{"bits": 4, "group_size": 32}``).

    Raises:
        TypeError: spec is not a QuantSpec, or both spec and fields are given.

    >>> resolve_spec(None, {"bits": 8}).short()
    'int8/channel/symmetric'
    >>> resolve_spec(QuantSpec(), {"bits": 8})
    Traceback (most recent call last):
    TypeError: pass either spec=... or its fields ['bits'], not both: use spec.replace(bits=...)
    """
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

    Returns:
        ``(B, S, K)``: the batch size, the scales per batch element and the elements per scale.

    Raises:
        ValueError: the axis counts do not fit ``shape``, or group_size does not divide the
            input size.

    >>> block_shape((8, 64), QuantSpec(group_size=16))
    (1, 32, 16)
    """
    batch, rows, cols = _split_shape(tuple(shape), batch_ndim, out_ndim)
    if spec.granularity == "tensor":
        return batch, 1, rows * cols
    if spec.granularity == "channel":
        return batch, rows, cols
    if cols % spec.group_size:
        raise ValueError(_block_misfit(shape, cols, spec))
    return batch, rows * cols // spec.group_size, spec.group_size


def _block_misfit(shape, cols, spec):
    """The message for a group size (or a grid's block) that does not divide the input size."""
    start = f"group_size={spec.group_size} does not divide the input size {cols} of an array of shape {tuple(shape)}"
    grid = spec.grid_record
    if grid.block is not None:
        fits = sorted(g.name for g in GRIDS.values() if g.block is not None and cols % g.block == 0)
        return (f"{start}: grid={grid.name!r} stores blocks of {grid.block} along each row, so rows of {cols} values "
                f"cannot be stored on it; use a grid whose block divides {cols} ({fits or 'none does'}), as "
                f"llama.cpp's mixes do per tensor (mixle.gguf.mixes.tensor_types)")
    divisors = [d for d in range(1, cols + 1) if cols % d == 0]
    near = sorted(divisors, key=lambda d: abs(d - spec.group_size))[:3]
    return f"{start}: use a divisor of {cols}, e.g. {sorted(near)}, or granularity='channel'"


