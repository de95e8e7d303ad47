"""Products with converted int4/int8 weights straight from their packed codes and scales.

``QuantizedLinear`` calls the ``mixle::packed_linear`` torch operator (a custom op, so
``torch.compile`` keeps it as one node) for float32 CPU inputs. Its kernel
(``packed_matmul.cpp``, built with the system C++ compiler like ``fused_cpu``'s kernels) rebuilds
each weight exactly as ``dequantize_array`` does (one float32 product ``code * scale``) but never
materialises the whole float weight:

* for fewer rows of x than ``PANEL_BATCH`` (see there) the codes are streamed and decoded in vector registers
  (AVX-512 or AVX2, else portable C++), each decoded step multiplied with up to 8 rows of x, in one
  OpenMP region over output rows;
* for more, each weight is decoded once per 64 rows of x (32 on AVX2), a few rows
  and 512 inputs at a time into an L1-resident panel, and multiplied as outer products with x
  transposed (a register-blocked GEMM whose packing step is the decoding).

So the result differs from ``F.linear(x, dequantized_weight, bias)`` only in the order of the float
sums. Everything else (other dtypes or devices, autocast, inputs that need a gradient, no compiler,
or inside ``switched_off()``) takes that exact dequantize-then-``F.linear`` path.
``MIXLE_FUSED_KERNELS=0`` turns the kernel off with mixle's other fused kernels.
"""

import contextlib
import ctypes
from pathlib import Path
from typing import Optional

import torch

from mixle.torch_backend.kernels import fused_cpu as _fused_cpu
from mixle.torch_backend.kernels import kernel_cache

__all__ = ["available", "isa", "switched_off", "applies", "linear", "PANEL_BATCH"]

SOURCE = Path(__file__).with_name("packed_matmul.cpp")
# Intrinsics fix the vector code; -ffp-contract=off only keeps the scalar tails unfused like numpy.
FLAGS = _fused_cpu.FLAGS
# From PANEL_BATCH rows of x (PANEL_BATCH_SHORT for layers of at most SHORT_IN inputs, whose short
# rows make the register path's per-output sums dear) the decoded-panel GEMM beats decoding in
# registers, which decodes each weight again for every 4 rows of x. Crossovers measured on one
# AVX-512 core (Zen 4): 32-48 rows at 4096 inputs, 12-16 rows at 512.
PANEL_BATCH = 48
PANEL_BATCH_SHORT = 16
SHORT_IN = 1024
# Smaller weights run on one thread (~0.1 ms of int4 work): waking the other threads costs more
# than it saves, 10 us on an idle machine and up to ~20 ms on an oversubscribed one.
PARALLEL_WEIGHTS = 1 << 20

_loaded = {}  # "library" -> _Library or None, once decided
_state = {"off": 0}  # depth of switched_off() blocks


class _Library:
    """ctypes bindings of one built ``packed_matmul`` library."""

    def __init__(self, path):
        self.path = str(path)
        lib = kernel_cache.load(path)  # only a library this user built, re-verified on dlopen's descriptor
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.linear = lib.mixle_packed_linear_f32
        self.linear.argtypes = [p, i64, i64, i64, p, i32, p, i64, i64, p, p, i32]
        self.linear.restype = None
        self.linear_panels = lib.mixle_packed_linear_panels_f32
        self.linear_panels.argtypes = self.linear.argtypes
        self.linear_panels.restype = None
        lib.mixle_packed_isa.restype = ctypes.c_char_p
        self.isa = lib.mixle_packed_isa().decode()


def _load(compiler, flags=FLAGS):
    """Build (or find in the cache) and bind the library; RuntimeError/OSError when impossible."""
    return _Library(_fused_cpu.build_library(compiler, SOURCE, flags))


def _library():
    return kernel_cache.decide_once(
        _loaded, "library", _load, "its packed int4/int8 CPU kernel",
        "converted layers dequantize their whole weight on every call instead, which is several times "
        "slower than float32 at batch 1")


def _built():
    if torch.compiler.is_compiling():
        # Traced code cannot build or lock: it uses the kernel if it was decided before (an eager
        # call or ``available()``), else the exact path.
        return _loaded.get("library") is not None
    return _library() is not None


def available():
    """True when the packed kernel is built and not switched off.

    >>> isinstance(available(), bool)
    True
    """
    return not _state["off"] and _library() is not None


def isa():
    """The vector path the built kernel runs ("avx512", "avx2" or "scalar"), or None without one.

    >>> isa() in (None, "avx512", "avx2", "scalar")
    True
    """
    library = _library()
    return None if library is None else library.isa


@contextlib.contextmanager
def switched_off():
    """Run the block with converted layers on the exact dequantize-then-``F.linear`` path.

    Use it where results must equal the fake-quant forward bit for bit. A model already compiled
    with ``torch.compile`` while the kernel was on keeps it (recompile inside the block).

    >>> with switched_off():
    ...     available()
    False
    """
    _state["off"] += 1
    try:
        yield
    finally:
        _state["off"] -= 1


def block_layout(layer):
    """``(group, scales_per_row)`` of a QuantizedLinear's scales for the kernel.

    ``group`` inputs of a row share one scale; ``scales_per_row`` is 0 for one scale per tensor.

    >>> from mixle.torch_backend.layers.quantized import QuantizedLinear
    >>> from mixle.core.spec import QuantSpec
    >>> layer = QuantizedLinear(torch.zeros(6, 8, dtype=torch.int8), torch.ones(1, 12, 1), QuantSpec(bits=8, group_size=4), (6, 8))
    >>> block_layout(layer)
    (4, 2)
    """
    out_features, in_features = layer.weight_shape
    blocks = layer.scale.shape[1]
    width = out_features * in_features // blocks
    if blocks == 1:
        return in_features, 0
    if width >= in_features:
        return in_features, 1
    return width, in_features // width


def applies(x, layer):
    """Whether ``layer(x)`` (a QuantizedLinear) can run on the packed kernel.

    It takes float32 CPU inputs (and float32 scales and bias) that need no gradient, outside
    autocast and functorch transforms, when the kernel is built and not switched off.

    >>> from mixle.torch_backend.layers.quantized import QuantizedLinear
    >>> from mixle.core.spec import QuantSpec
    >>> layer = QuantizedLinear(torch.zeros(2, 4, dtype=torch.int8), torch.ones(1, 2, 1), QuantSpec(bits=8), (2, 4))
    >>> applies(torch.ones(3, 4, dtype=torch.float64), layer)
    False
    """
    if _state["off"] or not isinstance(x, torch.Tensor):
        return False
    if layer.spec.grid_record.numerics is not None:  # the kernel computes codes * scale only
        return False
    bias = layer.bias
    if (x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() == 0 or x.shape[-1] != layer.in_features
            or layer.scale.dtype != torch.float32 or layer.codes.device.type != "cpu"
            or (bias is not None and bias.dtype != torch.float32)):
        return False
    if x.layout != torch.strided or (x.requires_grad and torch.is_grad_enabled()):
        return False
    if torch.is_autocast_enabled("cpu"):
        return False
    if not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(x):
        return False
    return _built()


def linear(x, layer):
    """``layer(x)`` of a QuantizedLinear through the ``mixle::packed_linear`` op (check ``applies``).

    >>> from mixle.torch_backend.layers.quantized import QuantizedLinear
    >>> from mixle.core.spec import QuantSpec
    >>> layer = QuantizedLinear(torch.tensor([[1, -2]], dtype=torch.int8), torch.full((1, 1, 1), 0.5), QuantSpec(bits=8), (1, 2))
    >>> linear(torch.tensor([[4.0, 1.0]]), layer) if applies(torch.ones(1, 2), layer) else torch.tensor([[1.0]])
    tensor([[1.]])
    """
    group, scales_per_row = block_layout(layer)
    args = (x, layer.codes, layer.scale, layer.bias, layer.spec.bits, layer.out_features, group, scales_per_row)
    if type(x) is torch.Tensor and not torch.compiler.is_compiling():
        return _products(_library(), *args)  # the op's body without the dispatcher's ~12 us per call
    return torch.ops.mixle.packed_linear(*args)


@torch.library.custom_op("mixle::packed_linear", mutates_args=(), device_types="cpu")
def _packed_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                   bits: int, out_features: int, group: int, scales_per_row: int) -> torch.Tensor:
    library = _library()
    if library is None:
        raise RuntimeError("mixle::packed_linear needs the packed kernel, which could not be built here")
    return _products(library, x, codes, scale, bias, bits, out_features, group, scales_per_row)


def _products(library, x, codes, scale, bias, bits, out_features, group, scales_per_row):
    """The op's body on a given built library (the tests also run other builds of the kernel)."""
    in_features = x.shape[-1]
    x2 = x.reshape(-1, in_features).contiguous()
    codes, scale = codes.contiguous(), scale.contiguous()  # held: the kernel reads their memory
    bias = None if bias is None else bias.contiguous()
    rows = x2.shape[0]
    threads = torch.get_num_threads() if out_features * in_features >= PARALLEL_WEIGHTS else 1
    y = torch.empty((rows, out_features), dtype=torch.float32)
    panels = rows >= (PANEL_BATCH_SHORT if in_features <= SHORT_IN else PANEL_BATCH)
    run = library.linear_panels if panels else library.linear
    run(x2.data_ptr(), rows, in_features, out_features, codes.data_ptr(), bits, scale.data_ptr(), group,
        scales_per_row, None if bias is None else bias.data_ptr(), y.data_ptr(), threads)
    return y.reshape(*x.shape[:-1], out_features)


@_packed_linear.register_fake
def _(x, codes, scale, bias, bits, out_features, group, scales_per_row):
    return x.new_empty((*x.shape[:-1], out_features))
