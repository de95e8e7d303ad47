"""Fused CPU fake-quant kernels of llama.cpp's block grids, compiled from ``fused_ggml_quant.cpp``.

One pass per block over a float32 or bfloat16 CPU weight computes, bit for bit, what the numpy
numerics give (``mixle.core.numerics`` for ``q4_0`` / ``q8_0``; ``mixle.gguf.ggml_quants`` for
``q4_1``, ``q5_0``, ``q5_1``, ``mxfp4``, ``nf4``, ``q4_k``, ``q5_k``, ``q6_k``, themselves ggml's reference
quantizers): the fake-quantized weight and, when asked, its int8 codes with one multiplier
``a`` (and offset ``b``) per sub-block, ``value = code * a (+ b)``, from which a rebuild is one
cheap pass (``dequantize``). A bfloat16 weight is read exactly as float32 and its result written
rounded to nearest even, which is the float32 numerics then ``.to(torch.bfloat16)``. With an importance matrix entry the kernels run ggml's importance-weighted
searches instead (``llama-quantize --imatrix``; ``WEIGHTED``: the grids whose record has a
``weighted`` search: every grid but q8_0 and mxfp4, whose ggml quantizers ignore it, and nf4), bit for bit ``quantize_array(..., importance=)``. Built and cached like
``fused_cpu``'s kernels (their flags, see ``FLAGS``; the same private cache); off whenever
those are off (``MIXLE_FUSED_KERNELS=0``, ``fused_cpu.switched_off``, no compiler), and then the
torch numerics run instead.
"""

import ctypes
from pathlib import Path

import torch

from mixle.core.array_ops import TorchOps
from mixle.core.grids import GRIDS, DerivedTable
from mixle.torch_backend.kernels import fused_cpu
from mixle.torch_backend.kernels import kernel_cache

SOURCE = Path(__file__).with_name("fused_ggml_quant.cpp")
# fused_cpu's flags (no fused multiply-add) plus -fno-trapping-math: without it GCC keeps the
# float -> int conversions and selects of the block loops scalar (they could raise FP exceptions,
# which nothing here reads); values are unchanged (no reassociation, signed zeros and NaNs kept).
FLAGS = fused_cpu.FLAGS + ("-fno-trapping-math",)


# Grid name -> how the kernel runs it (``Grid.kernel``: its number in fused_ggml_quant.cpp's enum,
# values per multiplier, an offset, codes indexing the grid's table), read off the grid records.
KINDS = DerivedTable(lambda: {g.name: g.kernel for g in GRIDS.values() if g.kernel is not None})
# The grids whose importance-weighted search (``Grid.weighted``) the kernels run.
WEIGHTED = DerivedTable(lambda: {name: GRIDS[name].weighted for name in KINDS if GRIDS[name].weighted is not None})
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_loaded = {}  # "ggml" -> _Kernels or None, once decided
_OPS = TorchOps()


class _Kernels:
    def __init__(self, path):
        self.path = str(path)
        lib = kernel_cache.load(path)
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.fake_quant = lib.mixle_ggml_fake_quant
        self.fake_quant.argtypes = [i32, i32, p, i64, p, p, p, p, p, i32]
        self.fake_quant.restype = i64
        self.weighted = lib.mixle_ggml_fake_quant_weighted
        self.weighted.argtypes = [i32, i32, p, i64, i64, p, p, p, p, p, p, i32]
        self.weighted.restype = i64
        self.dequantize = lib.mixle_ggml_dequantize
        self.dequantize.argtypes = [i32, p, p, p, i64, i64, p, i32, i32]
        self.dequantize.restype = None


def _kernels():
    if not fused_cpu.available():  # off with the plain kernels (switch, switched_off, no compiler)
        return None
    return kernel_cache.decide_once(
        _loaded, "ggml", lambda compiler: _Kernels(fused_cpu.build_library(compiler, SOURCE, FLAGS)),
        "its fused CPU kernels of llama.cpp's grids",
        "QAT on those grids runs the same numerics as separate torch ops, which makes a training step slower")


def available():
    """True when the kernels are built and switched on.

    >>> isinstance(available(), bool)
    True
    """
    return _kernels() is not None


def applies_to(x, spec):
    """Whether the kernels take weight x on ``spec``: a grid of ``KINDS``, a contiguous float32 or
    bfloat16 CPU tensor whose rows the grid's block divides, outside torch.compile (traced code
    runs the torch numerics).

    >>> from mixle.core.spec import QuantSpec
    >>> applies_to(torch.ones(2, 32, dtype=torch.float64), QuantSpec(grid="q4_0"))
    False
    """
    kind = spec.grid_record.kernel
    if kind is None or x.dtype not in _DTYPES or x.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    if x.ndim == 0 or x.shape[-1] % spec.grid_record.block or x.layout != torch.strided or not x.is_contiguous():
        return False
    return _OPS.readable(x) and available()


def _ptr(t):
    return None if t is None else t.data_ptr()


def _io_code(x_dtype, deq_dtype):
    """The kernels' dtype code: x and deq both float32 (0) or bfloat16 (1), or float32 x written as a
    bfloat16 deq (2)."""
    return 2 if fused_cpu.converts_to_bfloat16(x_dtype, deq_dtype) else _DTYPES[x_dtype]


def fake_quant(x, spec, *, want_codes=False, out=None, importance=None):
    """One pass over x's blocks: ``(deq, codes, a, b, nonfinite, overflow)``.

    With ``importance`` (a float32 CPU tensor, one value per column of x's last axis; grids of
    ``WEIGHTED``) the blocks are ggml's importance-weighted quantizer's, bit for bit
    ``quantize_array(x, spec, importance=importance)``.

    ``deq`` is the fake-quantized x in x's dtype, written into ``out`` when given (contiguous,
    shaped like x; in x's dtype, or bfloat16 for a float32 x: its float32 values rounded to
    nearest even, what ``.to(torch.bfloat16)`` gives); ``codes`` (int8, x's shape), ``a`` and
    ``b`` (float32, one per sub-block; ``b`` None on grids without an offset) only when ``want_codes``, else None. ``nonfinite``
    counts blocks holding NaN or infinity and ``overflow`` blocks whose float16 scale or min
    overflows; where either is non-zero the other outputs are meaningless (the caller raises).
    Call ``applies_to`` first.
    """
    kind = spec.grid_record.kernel
    deq = torch.empty_like(x) if out is None else out
    io = _io_code(x.dtype, deq.dtype)
    codes = a = b = None
    if want_codes:
        codes = torch.empty(x.shape, dtype=torch.int8)
        a = torch.empty(x.numel() // kind.sub, dtype=torch.float32)
        b = torch.empty_like(a) if kind.offset else None
    overflow = ctypes.c_int64(0)
    if importance is not None:
        qw = importance.detach().to(torch.float32).contiguous()
        nonfinite = _kernels().weighted(
            kind.id, io, x.data_ptr(), x.numel(), x.shape[-1], qw.data_ptr(), deq.data_ptr(),
            _ptr(codes), _ptr(a), _ptr(b), ctypes.byref(overflow), torch.get_num_threads())
        return deq, codes, a, b, nonfinite, overflow.value
    nonfinite = _kernels().fake_quant(
        kind.id, io, x.data_ptr(), x.numel(), deq.data_ptr(), _ptr(codes), _ptr(a), _ptr(b),
        ctypes.byref(overflow), torch.get_num_threads())
    return deq, codes, a, b, nonfinite, overflow.value


def dequantize(codes, a, b, dtype, out=None, grid=None):
    """``codes * a (+ b)`` per sub-block in ``dtype`` (float32 or bfloat16; rounded once from the
    float32 value), into ``out`` when given; on a grid whose kernel codes index its table
    (``KernelKind.indexes_table``: nf4) ``table[codes] * a``. The torch ops compute the same where
    the kernels are off.

    >>> dequantize(torch.tensor([2, -1], dtype=torch.int8), torch.tensor([0.5]), None, torch.float32).tolist()
    [1.0, -0.5]
    """
    if out is None or not out.is_contiguous():
        out = torch.empty(codes.shape, dtype=dtype)
    kernels = _kernels()
    record = GRIDS.get(grid)
    table = record.table if record is not None and record.kernel is not None and record.kernel.indexes_table else None
    if kernels is None or dtype not in _DTYPES:
        values = codes.reshape(a.numel(), -1)
        values = torch.tensor(table, dtype=torch.float32)[values.long()] if table else values.float()
        values = values * a[:, None]
        if b is not None:
            values = values + b[:, None]
        return out.copy_(values.reshape(codes.shape))
    kernels.dequantize(_DTYPES[dtype], codes.data_ptr(), a.data_ptr(), _ptr(b), codes.numel(),
                       codes.numel() // a.numel(), out.data_ptr(), torch.get_num_threads(), int(table is not None))
    return out
