"""Fused CPU fake-quant kernels, compiled from ``_fused_fake_quant.cpp`` on first use.

The kernels compute exactly ``mixle.core.numerics``'s numerics (tests compare both with numpy,
bit for bit) in one pass over each block of a float32 or float64 CPU tensor. They are built
once per machine with the system C++ compiler into a cache directory (``MIXLE_CACHE_DIR``, else
``~/.cache/mixle``); without a compiler mixle warns once and QAT runs the same numerics as
separate torch ops. ``MIXLE_FUSED_KERNELS=0`` turns the kernels off.
"""

import contextlib
import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from mixle.core.numerics import block_shape, percentile_positions

SOURCE = Path(__file__).with_name("fused_fake_quant.cpp")
# -ffp-contract=off: no fused multiply-add, every operation rounds as numpy's does.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")
SWITCH = "MIXLE_FUSED_KERNELS"

_DTYPES = {torch.float32: "f32", torch.float64: "f64"}
_lock = threading.Lock()
_loaded = {}  # "kernels" -> _Kernels or None, once decided


def _cache_dir():
    root = os.environ.get("MIXLE_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mixle"


def _cpu_signature():
    """What -march=native depends on: the CPU's feature flags (a shared cache may span machines)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.machine() + platform.processor()


def _build(compiler, source_path=SOURCE, flags=FLAGS):
    """Path of the library built from ``source_path`` with ``flags`` (building it if needed), or
    raise RuntimeError with the reason. Other kernel sources (``packed_linear``) share this."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(f"no C++ compiler {compiler!r} ({error})") from None
    source_path = Path(source_path)
    source = source_path.read_bytes()
    # Without OpenMP (e.g. Apple clang) the kernels still build, and run on one thread.
    targets = []
    for variant in (tuple(flags) + ("-fopenmp",), tuple(flags)):
        key = hashlib.sha256(b"\0".join([source, " ".join(variant).encode(), version.encode(),
                                         _cpu_signature().encode(), sys.platform.encode()])).hexdigest()[:20]
        targets.append((variant, _cache_dir() / f"{source_path.stem}_{key}.so"))
    for _, target in targets:
        if target.exists():
            return target
    error = None
    for variant, target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *variant, "-o", partial, str(source_path)], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode == 0:
                os.replace(partial, target)  # atomic: concurrent builders agree on the result
                return target
            error = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        except (OSError, subprocess.SubprocessError) as failure:
            error = str(failure)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    raise RuntimeError(f"{compiler} failed: {error}")


class _Kernels:
    """ctypes bindings of one built library."""

    def __init__(self, path):
        # torch is imported first, so the library's libgomp.so.1 resolves to the copy torch has
        # loaded and both share one OpenMP thread pool.
        self.path = str(path)
        lib = ctypes.CDLL(self.path)
        p, i64, f64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
        self.fake_quant, self.dequantize, self.clip_mask_grad = {}, {}, {}
        for suffix in _DTYPES.values():
            fn = getattr(lib, f"mixle_fake_quant_{suffix}")
            fn.argtypes = [p, i64, i64, i64, i64, f64, f64, f64, f64, p, p, p, p, p, i32]
            fn.restype = i64  # blocks holding NaN or infinity
            self.fake_quant[suffix] = fn
            fn = getattr(lib, f"mixle_dequantize_{suffix}")
            fn.argtypes = [p, p, i64, i64, p, i32]
            fn.restype = None
            self.dequantize[suffix] = fn
            fn = getattr(lib, f"mixle_clip_mask_grad_{suffix}")
            fn.argtypes = [p, p, p, i64, i64, p, i32]
            fn.restype = None
            self.clip_mask_grad[suffix] = fn


def library_path():
    """Where the built kernels live (None when off or unavailable).

    >>> library_path() is None or library_path().endswith(".so")
    True
    """
    kernels = _kernels()
    return None if kernels is None else kernels.path


def _kernels():
    kernels = _loaded.get("kernels", False)
    if kernels is not False:
        return kernels
    with _lock:
        if "kernels" not in _loaded:
            kernels = None
            if os.environ.get(SWITCH, "1") != "0":
                try:
                    kernels = _Kernels(_build(os.environ.get("CXX", "c++")))
                except (RuntimeError, OSError) as error:
                    warnings.warn(
                        f"mixle could not build its fused CPU fake-quant kernels ({error}); QAT on CPU "
                        f"runs the same numerics as separate torch ops, which makes a training step "
                        f"slower (about 1.25x fp32 instead of 1.1x on an MLP). Install a C++ compiler "
                        f"(e.g. `apt install g++`), or set {SWITCH}=0 to use the torch ops without "
                        f"this warning.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
            _loaded["kernels"] = kernels
    return _loaded["kernels"]


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


def applies_to(x):
    """Whether the fused kernels can take tensor x: a contiguous float32/float64 CPU tensor,
    outside torch.compile and functorch transforms (which need traceable torch ops)."""
    if torch.compiler.is_compiling():
        return False
    return (x.dtype in _DTYPES and x.device.type == "cpu" and x.layout == torch.strided
            and x.is_contiguous() and not torch._C._functorch.is_functorch_wrapped_tensor(x)
            and _kernels() is not None)


def _ptr(t):
    return None if t is None else t.data_ptr()


def fake_quant(x, spec, *, scale=None, want_codes=False, want_threshold=False, out=None):
    """One pass over x's blocks: ``(deq, codes, scale, threshold, finite)``.

    ``scale`` (shape ``(B, S, 1)``) given: only the values/codes on those scales (a rebuild),
    threshold None. Otherwise the scales are computed, and ``finite`` is False when a block holds
    NaN or infinity (the other outputs are then meaningless; the caller raises). Codes and
    threshold not asked for are None; ``out`` (contiguous, shaped like x) receives deq instead of
    a new tensor. Call ``applies_to`` first.
    """
    batch, blocks_per_batch, width = block_shape(x.shape, spec)
    percentile = spec.clip_percentile
    lo = hi = -1
    frac = 0.0
    given = computed = threshold = None
    if scale is None:
        if percentile is not None and percentile != 100.0:
            lo, hi, frac = percentile_positions(width, percentile)
        scale = computed = torch.empty((batch, blocks_per_batch, 1), dtype=x.dtype)
        threshold = torch.empty_like(scale) if want_threshold else None
    else:
        given = scale.contiguous()  # held: the kernel reads it
    deq = torch.empty_like(x) if out is None else out
    codes = torch.empty(x.shape, dtype=torch.int8) if want_codes else None
    bad = _kernels().fake_quant[_DTYPES[x.dtype]](
        x.data_ptr(), batch * blocks_per_batch, width, lo, hi, frac, float(spec.scale_divisor),
        float(spec.code_min), float(spec.code_max), _ptr(given), _ptr(computed), _ptr(threshold),
        deq.data_ptr(), _ptr(codes), torch.get_num_threads())
    return deq, codes, scale, threshold, bad == 0


def dequantize(codes, scale, spec, out=None):
    """``codes * scale`` per block, in scale's dtype (codes int8 with the weight's shape), into
    ``out`` when given."""
    batch, blocks_per_batch, width = block_shape(codes.shape, spec)
    if out is None:
        out = torch.empty(codes.shape, dtype=scale.dtype)
    codes, scale = codes.contiguous(), scale.contiguous()  # held: the kernel reads their memory
    _kernels().dequantize[_DTYPES[scale.dtype]](
        codes.data_ptr(), scale.data_ptr(), batch * blocks_per_batch, width, out.data_ptr(),
        torch.get_num_threads())
    return out


def clip_mask_grad(grad, x, threshold, spec, out=None):
    """``grad * (|x| <= threshold)`` per block: the clip_gradient straight-through gradient, into
    ``out`` when given (contiguous, shaped like x; may be ``grad`` itself)."""
    batch, blocks_per_batch, width = block_shape(x.shape, spec)
    grad, threshold = grad.contiguous(), threshold.contiguous()  # held: the kernel reads them
    if out is None or not out.is_contiguous():
        out = torch.empty_like(x)
    _kernels().clip_mask_grad[_DTYPES[x.dtype]](
        grad.data_ptr(), x.data_ptr(), threshold.data_ptr(), batch * blocks_per_batch, width,
        out.data_ptr(), torch.get_num_threads())
    return out
