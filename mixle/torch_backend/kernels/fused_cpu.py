"""Fused CPU fake-quant kernels, compiled from ``fused_fake_quant.cpp`` on first use.

The kernels compute exactly ``mixle.core.numerics``'s numerics (tests compare both with numpy,
bit for bit) in one pass over each block of a float32, float64 or bfloat16 CPU tensor (a
bfloat16 one runs the float32 numerics: its scales, thresholds, codes and values are those of
its float32 copy, kept in float32, and its values are rounded once to bfloat16, as the torch
path computes them). They are built
once per machine with the system C++ compiler into a private cache directory (``MIXLE_CACHE_DIR``,
else ``~/.cache/mixle``; only libraries this user built and recorded are loaded, see
``kernel_cache``); without a compiler mixle warns once and QAT runs the same numerics as
separate torch ops. ``MIXLE_FUSED_KERNELS=0`` turns the kernels off.
"""

import contextlib
import ctypes
import re
from pathlib import Path
from typing import Optional

import torch

from mixle.core.array_ops import TorchOps
from mixle.core.numerics import block_shape, percentile_positions
from mixle.torch_backend.kernels import kernel_cache

SOURCE = Path(__file__).with_name("fused_fake_quant.cpp")
# -ffp-contract=off: no fused multiply-add, every operation rounds as numpy's does.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")
SWITCH = kernel_cache.SWITCH

_DTYPES = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16"}
_F32_TO_BF16 = "f32_bf16"  # a float32 weight's values written in bfloat16 (autocast's matmul operand)
# The dtype a weight's scales and thresholds are computed and kept in (the numerics' dtype).
_SCALE_DTYPES = {torch.float32: torch.float32, torch.float64: torch.float64, torch.bfloat16: torch.float32}
_loaded = {}  # "kernels" -> _Kernels or None, once decided
_OPS = TorchOps()


_cache_dir = kernel_cache.cache_dir


def local_headers(source):
    """The headers ``source`` includes from its own directory (``#include "name.h"``): part of its
    build key, so a changed header rebuilds the library.

    >>> [header.name for header in local_headers(SOURCE)]
    []
    """
    source = Path(source)
    names = re.findall(rb'^#include "([^"]+)"', source.read_bytes(), re.M)
    return [source.parent / name.decode() for name in names]


def build_library(compiler, source=SOURCE, flags=FLAGS):
    """Path of the verified library built from ``source`` (building it if no recorded build of this
    source, compiler command, flags and CPU checks out), or raise RuntimeError with the reason.

    A recorded build is found without running the compiler; see ``kernel_cache``.
    """
    source = Path(source)
    code = source.read_bytes() + b"".join(header.read_bytes() for header in local_headers(source))
    directory = kernel_cache.private_dir(_cache_dir())
    # Without OpenMP (e.g. Apple clang) the kernels still build, and run on one thread.
    keyed = [(variant, kernel_cache.build_key(code, compiler, variant))
             for variant in (tuple(flags) + ("-fopenmp",), tuple(flags))]
    for _, key in keyed:
        found = kernel_cache.find(directory, source.stem, key)
        if found is not None:
            return found
    error = None
    for variant, key in keyed:
        try:
            return kernel_cache.build(directory, source, compiler, variant, key)
        except RuntimeError as failure:
            error = failure
    raise error


class _Kernels:
    """ctypes bindings of one built library."""

    def __init__(self, path):
        # torch is imported first, so the library's libgomp.so.1 resolves to the copy torch has
        # loaded and both share one OpenMP thread pool.
        self.path = str(path)
        lib = kernel_cache.load(path)  # only a library this user built, re-verified on dlopen's descriptor
        p, i64, f64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
        self.fake_quant, self.dequantize, self.clip_mask_grad = {}, {}, {}
        kinds = ((self.fake_quant, "fake_quant", [p, i64, i64, i64, i64, f64, f64, f64, f64, p, p, p, p, p, p, i32], i64),
                 (self.dequantize, "dequantize", [p, p, i64, i64, p, i32], None),
                 (self.clip_mask_grad, "clip_mask_grad", [p, p, p, i64, i64, p, i32], None))
        for suffix in (*_DTYPES.values(), _F32_TO_BF16):
            for table, name, argtypes, restype in kinds:
                fn = getattr(lib, f"mixle_{name}_{suffix}", None)  # f32_bf16 has no clip kernel: the mask is float32
                if fn is not None:
                    fn.argtypes, fn.restype = argtypes, restype  # fake_quant: the blocks holding NaN or infinity
                    table[suffix] = fn


def library_path():
    """Where the built kernels live (None when off or unavailable).

    >>> library_path() is None or library_path().endswith(".so")
    True
    """
    kernels = _kernels()
    return None if kernels is None else kernels.path


def _kernels():
    return kernel_cache.decide_once(
        _loaded, "kernels", lambda compiler: _Kernels(build_library(compiler)), "its fused CPU fake-quant kernels",
        "QAT on CPU runs the same numerics as separate torch ops, which makes a training step slower "
        "(about 1.25x fp32 instead of 1.1x on an MLP)")


@contextlib.contextmanager
def switched_off():
    """Run the block with the kernels off (the torch-ops path), e.g. to compare the two paths.

    >>> with switched_off():
    ...     available()
    False
    """
    before = _loaded.get("kernels", False)
    _loaded["kernels"] = None
    try:
        yield
    finally:
        if before is False:
            del _loaded["kernels"]
        else:
            _loaded["kernels"] = before


def available():
    """True when the fused kernels are built and switched on.

    >>> isinstance(available(), bool)
    True
    """
    return _kernels() is not None


def applies_to(x, spec=None):
    """Whether the fused kernels can take tensor x (quantized with ``spec``, when given): a
    contiguous float32/float64/bfloat16 CPU tensor on a plain grid (``Grid.is_plain``: the only grids the
    kernels implement). Tensors on other devices (and fake ones) take the torch ops, and never
    make the kernels build.

    The kernels are torch custom operators (``torch.ops.mixle.*``) with fake implementations,
    so torch.compile traces them like any other op.

    >>> applies_to(torch.ones(2, dtype=torch.float16))
    False
    """
    if spec is not None and not spec.grid_record.is_plain():
        return False
    if x.dtype not in _DTYPES or x.device.type != "cpu":
        return False
    if torch.compiler.is_compiling():
        # Traced code cannot build or lock: it uses the kernels if they were decided before (QAT
        # layers decide when they are created). Nor may it read layout (dynamo's compiled
        # backward refuses that attribute); traced tensors are strided.
        return _loaded.get("kernels") is not None and x.is_contiguous()
    return x.layout == torch.strided and x.is_contiguous() and _OPS.readable(x) and _kernels() is not None


def _ptr(t):
    return None if t is None else t.data_ptr()


# The three kernels, registered as torch custom operators: outputs are preallocated by the
# Python wrappers below and written in place (declared in mutates_args), so a recycled buffer
# can take them. Traced code (torch.compile) calls them through the dispatcher; eager code calls
# the same functions directly, since a mutating custom op's dispatch costs about as much as the
# kernel on a small weight (benchmarks/custom_op_cost.py measures it).

def _fake_quant_kernel(x: torch.Tensor, given: Optional[torch.Tensor], deq: torch.Tensor, scale_out: Optional[torch.Tensor],
                   threshold: Optional[torch.Tensor], codes: Optional[torch.Tensor], width: int, lo: int, hi: int,
                   frac: float, divisor: float, code_min: float, code_max: float) -> torch.Tensor:
    overflow = ctypes.c_int64(0)
    bad = _kernels().fake_quant[_suffix(x.dtype, deq.dtype)](
        x.data_ptr(), x.numel() // width, width, lo, hi, frac, divisor, code_min, code_max, _ptr(given),
        _ptr(scale_out), _ptr(threshold), deq.data_ptr(), _ptr(codes), ctypes.byref(overflow), torch.get_num_threads())
    return torch.tensor([bad, overflow.value], dtype=torch.int64)  # blocks with NaN / infinity, overflowing blocks


_fake_quant_op = torch.library.custom_op("mixle::fused_fake_quant", _fake_quant_kernel,
                                         mutates_args=("deq", "scale_out", "threshold", "codes"))


@_fake_quant_op.register_fake
def _(x, given, deq, scale_out, threshold, codes, width, lo, hi, frac, divisor, code_min, code_max):
    return x.new_empty((2,), dtype=torch.int64)


def converts_to_bfloat16(x_dtype, out_dtype):
    """Whether the fused kernels (these and ``fused_ggml``'s) write a weight of ``x_dtype`` converted:
    False for its own dtype, True for float32 written in bfloat16 (autocast's matmul operand).

    Raises:
        ValueError: any other pair, which no kernel writes.

    >>> converts_to_bfloat16(torch.float32, torch.bfloat16)
    True
    """
    if out_dtype == x_dtype:
        return False
    if (x_dtype, out_dtype) == (torch.float32, torch.bfloat16):
        return True
    raise ValueError(f"the fused kernels write a {x_dtype} weight's values in its own dtype or, from float32, in "
                     f"bfloat16; not in {out_dtype}")


def _suffix(x_dtype, out_dtype):
    """The kernel for a weight of ``x_dtype`` whose values are written in ``out_dtype``."""
    return _F32_TO_BF16 if converts_to_bfloat16(x_dtype, out_dtype) else _DTYPES[x_dtype]


def _dequantize_kernel(codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, from_float32: bool = False) -> None:
    # from_float32 with a bfloat16 out: a float32 weight's values rounded once (as a bfloat16 weight's are)
    _kernels().dequantize[_suffix(torch.float32 if from_float32 else out.dtype, out.dtype)](
        codes.data_ptr(), scale.data_ptr(), scale.numel(), codes.numel() // scale.numel(), out.data_ptr(),
        torch.get_num_threads())


_dequantize_op = torch.library.custom_op("mixle::fused_dequantize", _dequantize_kernel, mutates_args=("out",))


@_dequantize_op.register_fake
def _(codes, scale, out, from_float32=False):
    return None


def _clip_mask_grad_kernel(grad: torch.Tensor, x: torch.Tensor, threshold: torch.Tensor, out: torch.Tensor) -> None:
    _kernels().clip_mask_grad[_DTYPES[x.dtype]](
        grad.data_ptr(), x.data_ptr(), threshold.data_ptr(), threshold.numel(), x.numel() // threshold.numel(),
        out.data_ptr(), torch.get_num_threads())


_clip_mask_grad_op = torch.library.custom_op("mixle::fused_clip_mask_grad", _clip_mask_grad_kernel,
                                             mutates_args=("out",))


@_clip_mask_grad_op.register_fake
def _(grad, x, threshold, out):
    return None


def _traced_or_direct(op, kernel):
    return op if torch.compiler.is_compiling() else kernel


def fake_quant(x, spec, *, scale=None, want_codes=False, want_threshold=False, out=None):
    """One pass over x's blocks: ``(deq, codes, scale, threshold, nonfinite, overflow)``.

    Scales and thresholds are in ``_SCALE_DTYPES[x.dtype]`` (float32 for a bfloat16 x, whose
    values are its float32 copy's, codes times scale, rounded once to bfloat16).

    ``scale`` (shape ``(B, S, 1)``, in that dtype) given: only the values/codes on those scales (a rebuild),
    threshold None. Otherwise the scales are computed, ``nonfinite`` (a 0-d int64 tensor)
    counts the blocks holding NaN or infinity and ``overflow`` (likewise) the blocks whose scale
    times the grid's largest code overflows x's dtype (``numerics.check_scale_range``'s rule; a
    finite weight would dequantize to infinity). Where either is non-zero the other outputs are
    meaningless (the caller raises). Codes and threshold not asked for are None; ``out`` (contiguous, shaped like
    x; in x's dtype, or bfloat16 for a float32 x: its values rounded to nearest even) receives deq
    instead of a new tensor. Call ``applies_to`` first.
    """
    batch, blocks_per_batch, width = block_shape(x.shape, spec)
    percentile = spec.clip_percentile
    lo = hi = -1
    frac = 0.0
    given = computed = threshold = None
    if scale is None:
        if percentile is not None and percentile != 100.0:
            lo, hi, frac = percentile_positions(width, percentile)
        scale = computed = torch.empty((batch, blocks_per_batch, 1), dtype=_SCALE_DTYPES[x.dtype])
        threshold = torch.empty_like(scale) if want_threshold else None
    else:
        given = scale.to(_SCALE_DTYPES[x.dtype]).contiguous()
    deq = torch.empty_like(x) if out is None else out
    codes = torch.empty(x.shape, dtype=torch.int8) if want_codes else None
    counts = _traced_or_direct(torch.ops.mixle.fused_fake_quant, _fake_quant_kernel)(
        x, given, deq, computed, threshold, codes, width, lo, hi, frac, float(spec.scale_divisor),
        float(spec.code_min), float(spec.code_max))
    return deq, codes, scale, threshold, counts[0], counts[1]


def dequantize(codes, scale, spec, out=None, dtype=None, weight_dtype=None):
    """``codes * scale`` per block in ``dtype`` (default: scale's; codes int8 with the weight's
    shape), into ``out`` when given (then in its dtype). A bfloat16 result takes float32 scales
    and is the float32 product rounded once, as ``fake_quant`` writes a bfloat16 weight's values
    (and, for a float32 weight, ``weight_dtype``, its values into a bfloat16 ``out``)."""
    if out is None:
        out = torch.empty(codes.shape, dtype=scale.dtype if dtype is None else dtype)
    scale = scale.to(_SCALE_DTYPES[out.dtype])
    from_float32 = weight_dtype == torch.float32 and out.dtype == torch.bfloat16
    _traced_or_direct(torch.ops.mixle.fused_dequantize, _dequantize_kernel)(codes.contiguous(), scale.contiguous(), out,
                                                                           from_float32)
    return out


def clip_mask_grad(grad, x, threshold, spec, out=None):
    """``grad * (|x| <= threshold)`` per block: the clip_gradient straight-through gradient, into
    ``out`` when given (contiguous, shaped like x; may be ``grad`` itself). grad has x's dtype;
    threshold is ``fake_quant``'s (float32 for a bfloat16 x)."""
    if out is None or not out.is_contiguous():
        out = torch.empty_like(x)
    _traced_or_direct(torch.ops.mixle.fused_clip_mask_grad, _clip_mask_grad_kernel)(grad.contiguous(), x, threshold.to(_SCALE_DTYPES[x.dtype]).contiguous(), out)
    return out
