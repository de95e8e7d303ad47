"""Array-library adapters: the same block maths on numpy, jax.numpy and torch arrays.

``array_ops(x)`` gives the adapter of x's library; the numerics (``mixle.core.numerics``) call
only its methods, so one implementation serves every backend with identical values. Importing
this module imports neither torch nor jax: an adapter takes its library when it is made for an
array of it.

Every adapter has the same methods. Reductions (``amax``, ``absmax``, ``order_stats``,
``signed_max``) run over one ``axis`` and keep it with length 1; elementwise methods take and
return arrays of the adapter's library. The methods ending in ``_`` (``add_``, ``floor_``, ...)
may write their result into their first argument, which must be the caller's own temporary:
torch does (a fresh multi-megabyte tensor per step costs more in page faults than the
arithmetic), numpy and jax return a new array.
"""

import sys

import numpy as np

__all__ = ["NumpyOps", "JaxOps", "TorchOps", "array_ops", "array_kind", "is_tracer"]


def array_kind(x):
    """'torch', 'jax' or 'numpy' for a supported array; TypeError otherwise.

    >>> array_kind(np.zeros(2, np.float32))
    'numpy'
    """
    module = type(x).__module__
    if module.startswith("torch"):
        return "torch"
    if isinstance(x, np.ndarray):
        return "numpy"
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):
        return "jax"
    raise TypeError(
        f"expected a numpy array, torch tensor or jax array, got {type(x).__name__}: "
        f"convert it with np.asarray(...) first"
    )


class NumpyOps:
    """numpy's ops. Reductions run over ``axis`` and keep it (length 1), as every block view
    reduces one axis: the last one of the ``(B, S, K)`` view, or a kernel's own input axis
    (``fake_quant_blocks``).

    Args:
        xp: the numpy-like module the methods call (``jax.numpy`` for ``JaxOps``).

    >>> NumpyOps().order_stats(np.array([[3.0, 1.0, 2.0]]), [0, 2])
    [array([[1.]]), array([[3.]])]
    """

    def __init__(self, xp=np):
        self.xp = xp

    def is_float(self, x):
        return self.xp.issubdtype(x.dtype, self.xp.floating) or x.dtype.name == "bfloat16"

    def dtype_name(self, x):
        """x's dtype as numpy names it: ``"float32"``, ``"bfloat16"``, ..."""
        return x.dtype.name

    def all_finite(self, x):
        return bool(self.xp.isfinite(x).all())

    def readable(self, x):
        """Whether x's values can be read here, now (not a jax tracer under ``jit``)."""
        return not is_tracer(x)

    def assert_finite(self, x, message):
        """The check of values that cannot be read (``readable`` False): none for numpy and jax,
        which have no asynchronous assert; traced jax code skips the check."""

    def amax(self, a, axis=-1):
        return a.max(axis=axis, keepdims=True)

    def absmax(self, a, axis=-1):
        return abs(a).max(axis=axis, keepdims=True)

    def order_stats(self, a, ks, axis=-1):
        part = np.partition(a, sorted(set(ks)), axis=axis)
        return [np.take(part, [k], axis=axis) for k in ks]

    def scalar(self, value, like):
        return self.xp.asarray(value, dtype=like.dtype)

    def divisor(self, value, like):
        return self.scalar(value, like)

    def rounded(self, x):
        """x as its own rounded value (a backend that fuses ops, as XLA does, must not fuse it
        into a later op: no FMA)."""
        return x

    def where(self, cond, a, b):
        return self.xp.where(cond, a, b)

    def round_clip(self, x, lo, hi):
        return self.xp.clip(self.xp.round(x), lo, hi)

    def divide(self, a, b):
        """``a / b`` rounded once to the nearest float (IEEE), as numpy divides."""
        return a / b

    def divide_round_clip(self, blocks, scale, lo, hi):
        return self.round_clip(self.divide(blocks, scale), lo, hi)

    def to_int8(self, x):
        return x.astype(self.xp.int8)

    def to_named(self, x, name):
        return x.astype(name)

    def signed_max(self, a, axis=-1):
        index = self.xp.expand_dims(abs(a).argmax(axis=axis), axis)  # the first largest |a|, as ggml takes it
        return self.xp.take_along_axis(a, index, axis=axis)

    def floor(self, x):
        return self.xp.floor(x)

    def trunc(self, x):
        return self.xp.trunc(x)

    def sign(self, x):
        return self.xp.sign(x)

    def clip(self, x, lo, hi):
        return self.xp.clip(x, lo, hi)

    def to_dtype(self, x, like):
        return x.astype(like.dtype)

    def add_(self, x, y):
        return x + (self.scalar(y, x) if isinstance(y, (int, float)) else y)

    def sub_(self, x, y):
        return x - y

    def mul_(self, x, y):
        return x * y

    def floor_(self, x):
        return self.floor(x)

    def sign_(self, x):
        return self.sign(x)

    def clip_(self, x, lo, hi):
        return self.clip(x, lo, hi)


class JaxOps(NumpyOps):
    """jax.numpy's ops: numpy's, plus what keeps XLA's compiled values equal to numpy's and fast.

    jax is taken from ``sys.modules`` (it is loaded wherever a jax array exists).
    """

    def __init__(self):
        self.jax = sys.modules["jax"]
        super().__init__(self.jax.numpy)

    def all_finite(self, x):
        # Called on concrete arrays only (``readable``): numpy reads them, no program compiled per shape.
        return bool(np.isfinite(np.asarray(x)).all())

    def order_stats(self, a, ks, axis=-1):
        # Clipping asks for ranks near the top of a block (a of magnitudes >= 0). Sorting costs
        # XLA's CPU backend ~20x a matmul of the layer, and top_k works on the last axis only
        # (a kernel's input axis is often its first). The few largest values come instead from
        # the block's largest distinct values and how often each occurs (a max and a count
        # per level, along the axis as it lies), so repeats count as in a sort.
        count = a.shape[axis]
        top = count - min(ks)
        if top <= _LEVEL_RANKS:
            candidates, axis = self._top_chunks(a, top, axis % a.ndim)
            levels, seen = self._top_levels(candidates, top, axis)
            return [_rank_from_top(self.xp, levels, seen, count - 1 - k) for k in ks]
        if top <= 64:
            values = self.jax.lax.top_k(self.xp.moveaxis(a, axis, -1), top)[0]
            return [self.xp.moveaxis(values[..., count - 1 - k : count - k], -1, axis) for k in ks]
        part = self.xp.sort(a, axis=axis)
        return [self.jax.lax.slice_in_dim(part, k, k + 1, axis=axis) for k in ks]

    def _top_chunks(self, a, top, axis):
        """``(values, axis)``: the ``top`` chunks of ``_CHUNK`` consecutive values along ``axis``
        with the largest maxima (ties in any order), which hold the ``top`` largest values; or
        ``a`` itself when it is too short to gain.

        A value outside those chunks is at most the smallest of their maxima, and they hold
        ``top`` values (their maxima) at least that large, so it cannot rank higher. One pass
        over ``a`` (the chunk maxima); the levels then read only ``top * _CHUNK`` values.
        """
        count = a.shape[axis]
        if count % _CHUNK or count < 4 * top * _CHUNK:
            return a, axis
        chunks = a.reshape(a.shape[:axis] + (count // _CHUNK, _CHUNK) + a.shape[axis + 1 :])
        maxima = self.xp.moveaxis(chunks.max(axis=axis + 1), axis, -1)
        chosen = self.xp.moveaxis(self.jax.lax.top_k(maxima, top)[1], -1, axis)
        values = self.xp.take_along_axis(chunks, self.xp.expand_dims(chosen, axis + 1), axis=axis)
        return values.reshape(a.shape[:axis] + (top * _CHUNK,) + a.shape[axis + 1 :]), axis

    def _top_levels(self, a, top, axis):
        """The ``top`` largest distinct values along ``axis`` (largest first; -inf past the last)
        and how many values are at least each of them (for all but the deepest)."""
        xp = self.xp
        levels, seen, below = [], [], None
        for index in range(top):
            candidates = a if below is None else xp.where(a < below, a, -xp.inf)
            level = candidates.max(axis=axis, keepdims=True)
            if index + 1 < top:  # the deepest level is the answer when no count covers the rank
                occurrences = (a == level).sum(axis=axis, keepdims=True)
                seen.append(occurrences if not seen else seen[-1] + occurrences)
            levels.append(level)
            below = level
        return levels, seen

    def divisor(self, value, like):
        # XLA rewrites division by a constant as multiplication by its reciprocal; a divisor
        # behind a barrier is divided (and then corrected by ``divide``) as any other.
        return self.jax.lax.optimization_barrier(self.xp.full_like(like, value))

    def rounded(self, x):
        # XLA's CPU code generator contracts a multiplication and a later addition in one fused
        # loop into an FMA (one rounding instead of two), and it drops optimization barriers
        # before fusing; a select on the value (x, or NaN where x is NaN: x itself) between
        # the two keeps the product rounded.
        return self.xp.where(x == x, x, self.xp.nan)

    def divide(self, a, b):
        """``a / b`` rounded once to the nearest float32, on every XLA backend.

        The TPU divides (and takes reciprocals) with an approximation that misses the nearest
        float by one or two ulps for a third of the quotients, and XLA rewrites a division by a
        broadcast value as a multiplication by its reciprocal; products and sums are IEEE
        everywhere. So the quotient ``q`` any backend gives is corrected with products and sums
        only: ``a - q * b`` is computed exactly (Dekker's product, with halves cut by bit masks
        so no rewrite or FMA can change them), and ``q`` steps to its neighbour on the side of
        the true quotient while that neighbour's remainder is smaller (a quotient of floats is
        never a tie, so the smallest remainder is the nearest float). Exact wherever the
        products do not underflow (|a| above ~1e-30 in float32) and ``q`` is within
        ``_DIVISION_STEPS`` ulps of the quotient.
        """
        xp, lax = self.xp, self.jax.lax
        if a.dtype != xp.float32 or (hasattr(b, "dtype") and b.dtype != xp.float32):
            return a / b
        a, b = xp.broadcast_arrays(a, xp.asarray(b, xp.float32))
        # XLA fuses a chain of products and selects into every consumer and repeats it there (a
        # block's scale, read by each weight of the block: 10x the fake-quant's time on CPU); the
        # branch of a conditional is not fused into its users. The predicate is data (a NaN makes
        # every quotient NaN anyway), so XLA cannot fold the conditional away.
        return lax.cond(xp.isnan(a).any(), lambda a, b: a / b, self._corrected_quotient, a, b)

    def _corrected_quotient(self, a, b):
        xp, lax = self.xp, self.jax.lax
        q = lax.optimization_barrier(self.quotient(a, b))  # no rewrite of q * b back into a
        finite = xp.isfinite(q) & (q != 0)
        remainder = self._remainder(a, b, q)
        for _ in range(_DIVISION_STEPS):
            toward = xp.where((remainder > 0) == (b > 0), xp.inf, -xp.inf).astype(xp.float32)
            neighbour = xp.nextafter(q, toward)
            # a - neighbour * b = remainder - gap * b, every step exact: the gap is a power of two
            # (Sterbenz), so is its product with b, and the difference is a representable remainder
            # (so a fused multiply-add gives the same value: no rounding barrier needed).
            neighbour_remainder = remainder - (neighbour - q) * b
            better = finite & (abs(neighbour_remainder) < abs(remainder))
            q = xp.where(better, neighbour, q)
            remainder = xp.where(better, neighbour_remainder, remainder)
        return q

    def to_named(self, x, name):
        # XLA may skip a float32 -> 16-bit -> float32 round trip inside one program (excess
        # precision: the TPU keeps the float32 values), so a 16-bit rounding is done with
        # integer and exact float ops; the cast then only changes the storage.
        if name not in _NARROW or x.dtype != self.xp.float32:
            return x.astype(name)
        return self.narrow_rounded(x, name).astype(name)

    def narrow_rounded(self, x, name):
        """float32 ``x`` rounded to the nearest ``name`` (float16 / bfloat16) value, ties to even,
        still in float32: overflow to infinity, float16's subnormals on their 2**-24 grid."""
        xp, lax = self.xp, self.jax.lax
        explicit, smallest_normal, largest = _NARROW[name]
        drop = 23 - explicit
        bits = lax.bitcast_convert_type(x, xp.uint32)
        half = xp.uint32((1 << (drop - 1)) - 1) + ((bits >> drop) & xp.uint32(1))
        normal = lax.bitcast_convert_type((bits + half) & xp.uint32((0xFFFFFFFF >> drop) << drop), xp.float32)
        normal = xp.where(abs(normal) > largest, xp.copysign(xp.float32(xp.inf), x), normal)
        if not smallest_normal:
            return xp.where(xp.isnan(x) | xp.isinf(x), x, normal)
        step = smallest_normal * 2.0**-explicit  # the subnormals' spacing, a power of 2: exact products
        tiny = xp.round(x * xp.float32(1 / step)) * xp.float32(step)
        rounded = xp.where(abs(x) < smallest_normal, tiny, normal)
        return xp.where(xp.isnan(x) | xp.isinf(x), x, rounded)

    def quotient(self, a, b):
        """The backend's own ``a / b`` that ``divide`` corrects (tests replace it with the TPU's
        kinds of error)."""
        return a / b

    def exact_sqrt(self, x):
        """float32 ``sqrt(x)`` rounded once to the nearest float, on every XLA backend.

        The backend's root ``s`` (which an accelerator may approximate) steps to a neighbour while
        the exact root lies past the midpoint between them: ``x > (s + u/2)**2`` is ``r - s*u >
        u*u/4`` with ``r = x - s*s`` exact (``_remainder``) and ``u`` the power-of-two gap to the
        neighbour, so every term is exact (a root is never a tie).
        """
        xp, lax = self.xp, self.jax.lax
        s = lax.optimization_barrier(xp.sqrt(x))
        valid = xp.isfinite(s) & (x > 0)
        quarter = xp.float32(0.25)
        for _ in range(_DIVISION_STEPS):
            up, down = xp.nextafter(s, xp.float32(xp.inf)), xp.nextafter(s, xp.float32(0))
            u, d = self.rounded(up - s), self.rounded(s - down)
            r = self._remainder(x, s, s)
            above = self.rounded(r - self.rounded(s * u)) > self.rounded(u * u) * quarter
            below = self.rounded(r + self.rounded(s * d)) < self.rounded(d * d) * quarter
            s = xp.where(valid & above, up, xp.where(valid & below, down, s))
        return s

    def _remainder(self, a, b, q):
        """``a - q * b`` exactly (representable when q is within an ulp of ``a / b``)."""
        xp = self.xp
        product = self.rounded(q * b)
        q_hi, q_lo = self._halves(q)
        b_hi, b_lo = self._halves(b)
        # q * b == product + error exactly: every partial product below has at most 24 bits.
        error = self.rounded(self.rounded(q_hi * b_hi) - product)
        error = self.rounded(error + self.rounded(q_hi * b_lo))
        error = self.rounded(error + self.rounded(q_lo * b_hi))
        error = error + self.rounded(q_lo * b_lo)
        return self.rounded(a - product) - error

    def _halves(self, x):
        """``(hi, lo)`` with ``hi + lo == x``, each of at most 12 significant bits."""
        xp, lax = self.xp, self.jax.lax
        bits = lax.bitcast_convert_type(x, xp.uint32)
        hi = lax.bitcast_convert_type(bits & xp.uint32(0xFFFFF000), xp.float32)
        return hi, self.rounded(x - hi)

    def divide_round_clip(self, blocks, scale, lo, hi):
        """``clip(round_half_even(blocks / scale), lo, hi)`` with numpy's correctly rounded quotient.

        ``f = floor(blocks * (1 / scale))`` (a few ulps off on any backend) puts the quotient
        within an ulp or two of ``[f, f + 1]``, so its nearest integer is ``f`` or ``f + 1``: the
        side of ``h = f + 0.5`` it lies on, which is the sign of ``r = blocks - h * scale``. ``h``
        (|h| < 2**11) and the halves of ``scale`` have at most 12 significant bits each, so both
        partial products are exact; a difference is exact where ``r`` is small (Sterbenz) and
        otherwise keeps its sign. numpy's quotient is ``h`` itself, a tie rounded to even, when
        ``|r|`` is under half the float spacing at ``h`` times the scale (the spacing just below
        0.5 is half as wide, but there both answers are 0; a quotient of floats is never exactly
        halfway between two floats). About 20 operations a weight; the remainder's products are
        exact, so a fused multiply-add computes the same remainder.
        """
        xp, lax = self.xp, self.jax.lax
        if blocks.dtype != xp.float32 or max(abs(lo), abs(hi)) >= 2**11 - 1:
            return self.round_clip(self.divide(blocks, scale), lo, hi)
        scale = xp.asarray(scale, xp.float32)
        # per block, before the broadcast: the halves, the sign, and half an ulp of 1 times |scale|
        scale_hi, scale_lo = self._halves(scale)
        negative = scale < 0
        half_ulp = abs(scale) * xp.float32(2.0**-24)
        floor = xp.floor(blocks * self.quotient(xp.ones_like(scale), scale))
        h = floor + 0.5
        r = (blocks - h * scale_hi) - h * scale_lo
        power = lax.bitcast_convert_type(lax.bitcast_convert_type(h, xp.uint32) & xp.uint32(0x7F800000), xp.float32)
        tie = abs(r) < power * half_ulp
        odd = floor - 2 * xp.floor(floor * 0.5)
        step = xp.where(tie, odd, ((r > 0) != negative).astype(xp.float32))
        return xp.clip(floor + step, lo, hi)


# Ulps between a backend's quotient and the nearest float that JaxOps.divide corrects (the TPU v5e
# was seen two ulps off).
_DIVISION_STEPS = 3
# 16-bit floats as (explicit mantissa bits, smallest normal, largest finite) for JaxOps.to_named.
# bfloat16 is float32's top half: its rounding of the bits is right for subnormals too.
_NARROW = {"float16": (10, 2.0**-14, 65504.0), "bfloat16": (7, 0.0, 3.3895313892515355e38)}
# Up to this many ranks from the top, jax order statistics come from distinct levels and counts.
_LEVEL_RANKS = 8
# Chunk length of JaxOps._top_chunks.
_CHUNK = 16


def _rank_from_top(xp, levels, seen, j):
    """The (j+1)-th largest value: the first level that more than j values reach."""
    value = levels[-1]
    for level, total in zip(reversed(levels[:-1]), reversed(seen)):
        value = xp.where(total > j, level, value)
    return value


class TorchOps:
    """torch's ops: numpy's values, with in-place temporaries and top-k selection for speed.

    Nothing here waits for a device: scalars are Python numbers or filled on the tensor's device
    (``torch.tensor(value, device=...)`` would be a blocking host-to-device copy), and values are
    read on the host only where ``readable`` says they live there; elsewhere checks are
    asynchronous device asserts. torch is imported on construction (a lookup once any tensor exists).
    """

    def __init__(self):
        import torch

        self.torch = torch

    def is_float(self, x):
        return x.is_floating_point()

    def dtype_name(self, x):
        return str(x.dtype).removeprefix("torch.")

    def all_finite(self, x):
        return bool(self.torch.isfinite(x).all())

    def readable(self, x):
        """Whether x's values can be read on the host without waiting for a device: a CPU tensor
        run eagerly (not traced by torch.compile, not a fake tensor nor a functorch wrapper)."""
        torch = self.torch
        if x.device.type != "cpu" or torch.compiler.is_compiling():
            return False
        fake = sys.modules.get("torch._subclasses.fake_tensor")
        if fake is not None and isinstance(x, fake.FakeTensor):
            return False
        return not torch._C._functorch.is_functorch_wrapped_tensor(x)

    def assert_finite(self, x, message):
        """An asynchronous device assert that x holds no NaN or infinity (a RuntimeError with
        ``message`` once the device gets there; raised by the op itself on CPU)."""
        self.torch._assert_async(self.torch.isfinite(x).all(), message)

    def amax(self, a, axis=-1):
        return a.amax(dim=axis, keepdim=True)

    def absmax(self, a, axis=-1):
        # max |a| as max(max a, -min a): two reads and no |a| temporary; the same value (NaN
        # propagates), except that an all-zero row may give -0.0, which numerics' block_scale maps to 1.
        return self.torch.maximum(a.amax(dim=axis, keepdim=True), a.amin(dim=axis, keepdim=True).neg_())

    def order_stats(self, a, ks, axis=-1):
        # Exact order statistics of rows of magnitudes; `a` is a temporary and may be
        # overwritten. Clipping asks for ranks near the top of a row, so select only the few
        # largest values: kthvalue or a sort per rank pays a large constant per row on CPU,
        # which made percentile-clipped QAT steps several times slower.
        if axis % a.ndim != a.ndim - 1:
            return [v.movedim(-1, axis) for v in self.order_stats(a.movedim(axis, -1), ks)]
        count = a.shape[-1]
        top = count - min(ks)
        if top <= 2 and count >= 2 and count & (count - 1) == 0:
            first, second = self._two_largest_(a)
            values = [first if k == count - 1 else second for k in ks]
        elif top <= max(ks) + 1:
            descending = a.topk(top, dim=-1, sorted=True).values
            values = [descending[..., count - 1 - k : count - k] for k in ks]
        else:
            ascending = a.topk(max(ks) + 1, dim=-1, largest=False, sorted=True).values
            values = [ascending[..., k : k + 1] for k in ks]
        # Own copies: a view would keep the whole row buffer alive with the (cached) threshold.
        return [v.clone(memory_format=self.torch.contiguous_format) for v in values]

    def _two_largest_(self, a):
        """Largest and second largest of each row (repeats count), for a power-of-two row length.

        A pairwise tournament vectorised across rows: merging two halves, the maximum is the
        larger maximum and the runner-up the larger of the smaller maximum and both runners-up.
        Works in place in ``a`` (plus half its size), to keep the step's peak memory low.
        """
        # clamp_min_(t) is an in-place maximum that torch.compile can trace.
        minimum = self.torch.minimum
        half = a.shape[-1] // 2
        first, right = a[..., :half], a[..., half:]
        second = minimum(first, right)
        first.clamp_min_(right)
        while half > 1:
            half //= 2
            left, right = first[..., :half], first[..., half:]
            runner_up = second[..., :half]
            runner_up.clamp_min_(second[..., half:])
            runner_up.clamp_min_(minimum(left, right))
            left.clamp_min_(right)
            first, second = left, runner_up
        return first, second

    def scalar(self, value, like):
        # A Python number, with no copy to any device: float32/float64 ops round it to their
        # dtype first, as numpy does. 16-bit ops would compute with it unrounded, in float32.
        if like.dtype in (self.torch.float32, self.torch.float64):
            return value
        return self.torch.full((), value, dtype=like.dtype, device=like.device)

    def divisor(self, value, like):
        # Filled on the device: CUDA divides by a host scalar as a multiplication by its
        # reciprocal, one ulp off numpy's division for some values; by a device tensor exactly.
        return self.torch.full((), value, dtype=like.dtype, device=like.device)

    def divide(self, a, b):
        return a / b

    def rounded(self, x):
        return x

    def where(self, cond, a, b):
        return self.torch.where(cond, a, b)

    def round_clip(self, x, lo, hi):
        return self.torch.round(x).clamp_(lo, hi)

    def divide_round_clip(self, blocks, scale, lo, hi):
        # One fresh tensor, rounded and clipped in place: the same values as round_clip.
        return (blocks / scale).round_().clamp_(lo, hi)

    def to_int8(self, x):
        return x.to(self.torch.int8)

    def to_named(self, x, name):
        return x.to(getattr(self.torch, name))

    def signed_max(self, a, axis=-1):
        # The first largest |a|, as ggml takes it. argmax along a short axis runs ~3x slower on CPU
        # than one integer max of a key: |a|'s bits (which order like |a|), then the reversed index.
        torch, count = self.torch, a.shape[axis]
        if a.dtype != torch.float32:
            return a.gather(axis, a.abs().argmax(dim=axis, keepdim=True))
        shift = max(1, (count - 1).bit_length())
        key = a.abs().view(torch.int32).to(torch.int64).bitwise_left_shift_(shift)
        trailing = a.ndim - 1 - axis % a.ndim
        key.bitwise_or_(torch.arange(count - 1, -1, -1, device=a.device).reshape((count,) + (1,) * trailing))
        index = (count - 1) - key.amax(dim=axis, keepdim=True).bitwise_and_((1 << shift) - 1)
        return a.gather(axis, index)

    def floor(self, x):
        return self.torch.floor(x)

    def trunc(self, x):
        return self.torch.trunc(x)

    def sign(self, x):
        return self.torch.sign(x)

    def clip(self, x, lo, hi):
        return self.torch.clamp(x, lo, hi)

    def to_dtype(self, x, like):
        return x.to(like.dtype)

    def add_(self, x, y):
        return x.add_(self.scalar(y, x) if isinstance(y, (int, float)) else y)

    def sub_(self, x, y):
        return x.sub_(y)

    def mul_(self, x, y):
        return x.mul_(y)

    def floor_(self, x):
        return x.floor_()

    def sign_(self, x):
        return x.sign_()

    def clip_(self, x, lo, hi):
        return x.clamp_(lo, hi)


def array_ops(x):
    """The adapter (``NumpyOps``, ``JaxOps`` or ``TorchOps``) of x's array library.

    Args:
        x: a numpy array, torch tensor or jax array (a jax tracer too).

    Raises:
        TypeError: x is none of these.

    >>> type(array_ops(np.zeros(2))).__name__
    'NumpyOps'
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):  # also traceable by torch.compile
        return TorchOps()
    kind = array_kind(x)
    if kind == "torch":
        return TorchOps()
    if kind == "jax":
        return JaxOps()
    return NumpyOps(np)


def is_tracer(x):
    """True for a jax tracer: an abstract value under ``jit``, whose contents cannot be read.

    >>> is_tracer(np.zeros(2))
    False
    """
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.core.Tracer)
