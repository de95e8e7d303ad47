"""Flax kernels fake-quantized in their own layout, under jax.jit: numpy's values for every element."""

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from mixle.core.array_ops import JaxOps  # noqa: E402
from mixle.core.numerics import quantize_dequantize_array  # noqa: E402
from mixle.core.spec import QuantSpec  # noqa: E402
from mixle.flax_backend.fake_quant import fake_quantize_weight, kernel_blocks  # noqa: E402
from tests.jaxpr_walk import equations  # noqa: E402
from tests.test_numerics import reference_codes_scales  # noqa: E402

# (kernel shape, input axes): nnx.Linear (in, out), a conv (kh, kw, in, out), an Embed used by
# attend (vocab, dim), an einsum kernel whose input axes are not adjacent (transposed path).
LAYOUTS = [((128, 48), (0,)), ((3, 3, 16, 8), (0, 1, 2)), ((40, 64), (1,)), ((4, 16, 6, 8), (0, 2))]


def _kernel(shape, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    flat = w.reshape(-1)
    flat[0] = -np.abs(w).max() * 1.5  # a -absmax element: the qwix grid's rounding tie
    flat[1:4] = np.abs(w).max() * 1.2  # a repeated top value: order statistics count repeats
    return w


def _as_matrix(w, input_axes):
    """numpy: the kernel as its (out, in) matrix, and the way back."""
    out_axes = [a for a in range(w.ndim) if a not in input_axes]
    perm = out_axes + list(input_axes)
    t = np.transpose(w, perm)
    rows = math.prod(t.shape[: len(out_axes)])
    return t.reshape(rows, -1), lambda m: np.transpose(m.reshape(t.shape), np.argsort(perm))


def _jitted(w, input_axes, spec):
    return np.asarray(jax.jit(lambda k: fake_quantize_weight(k, input_axes, spec))(jnp.asarray(w)))


# group_size needs adjacent input axes (the provider leaves a kernel with input axes (0, 2) float).
CASES = [(shape, axes, grid, bits, granularity, group_size, percentile)
         for shape, axes in LAYOUTS for grid in ("symmetric", "qwix") for bits in (4, 8)
         for granularity, group_size in (("channel", None), ("group", 16), ("tensor", None))
         for percentile in (None, 99.9, 99.0) if not (granularity == "group" and axes == (0, 2))]


@pytest.mark.parametrize("shape,input_axes,grid,bits,granularity,group_size,percentile", CASES)
def test_jitted_kernel_equals_the_numpy_reference_for_every_element(shape, input_axes, grid, bits, granularity,
                                                                    group_size, percentile):
    w = _kernel(shape)
    matrix, back = _as_matrix(w, input_axes)
    spec = QuantSpec(bits=bits, grid=grid, granularity=granularity, group_size=group_size, clip_percentile=percentile)
    expected = back(reference_codes_scales(matrix, bits, granularity, group_size, percentile, grid)[2])
    # Exact: XLA may neither multiply by the scale's reciprocal nor fuse the percentile's
    # interpolation into an FMA.
    np.testing.assert_array_equal(_jitted(w, input_axes, spec), expected)


@pytest.mark.parametrize("spec", [QuantSpec(bits=4, grid="q4_0", group_size=32),
                                  QuantSpec(bits=8, grid="q8_0", group_size=32)])
def test_jitted_kernel_equals_numpy_on_the_ggml_grids(spec):
    w = _kernel((64, 24))
    matrix, back = _as_matrix(w, (0,))
    np.testing.assert_array_equal(_jitted(w, (0,), spec), back(quantize_dequantize_array(matrix, spec)))


def _tpu_like_quotient(self, a, b):
    """A quotient as the TPU gives it: up to two ulps from a / b, not the nearest float. Half the
    elements multiply by the reciprocal (XLA's rewrite), the rest step one ulp down or two up."""
    q = a / b
    bits = jax.lax.bitcast_convert_type(a, jnp.uint32) % 4
    up = jnp.nextafter(jnp.nextafter(q, jnp.float32(jnp.inf)), jnp.float32(jnp.inf))
    nudged = jnp.where(bits == 1, up, jnp.nextafter(q, jnp.float32(-jnp.inf)))
    off = jnp.where(bits < 2, nudged, a * (1 / b))
    return jnp.where((a != 0) & jnp.isfinite(q) & jnp.isfinite(off), off, q)  # 0 and inf stay exact


# The stand-ins nudge the backend's own quotient: on a TPU that one is already off, and the real
# quotients are what every other test here checks.
stand_in = pytest.mark.skipif(jax.default_backend() == "tpu", reason="stands in for the TPU on other backends")


@stand_in
def test_tpu_like_quotients_are_corrected_to_numpys_division():
    rng = np.random.default_rng(1)
    a = (rng.standard_normal(20000) * np.exp(rng.uniform(-15, 15, 20000))).astype(np.float32)
    b = (rng.standard_normal(20000) * np.exp(rng.uniform(-15, 15, 20000))).astype(np.float32)
    a[:3], b[:3] = [0.0, 1.0, -2.0], [3.0, 0.0, 7.0]
    ops = JaxOps()
    raw = np.asarray(jax.jit(lambda a, b: _tpu_like_quotient(ops, a, b))(a, b))
    assert (raw != a / b).sum() > 10000  # the stand-in really is off
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(JaxOps, "quotient", _tpu_like_quotient)
        got = np.asarray(jax.jit(ops.divide)(jnp.asarray(a), jnp.asarray(b)))
    np.testing.assert_array_equal(got.view(np.uint32), (a / b).view(np.uint32))


@stand_in
@pytest.mark.parametrize("ulps", [-2, -1, 0, 1, 2])
@pytest.mark.parametrize("lo,hi", [(-8, 7), (-127, 127), (0, 255)])
def test_codes_next_to_half_integers_are_numpys_when_the_quotient_is_ulps_off(monkeypatch, ulps, lo, hi):
    # Weights within 40 ulps of a half-integer times their scale (a tenth of them exactly on the
    # product's float, the rounding ties), scales across 40 binades.
    rng = np.random.default_rng(2)
    n = 20000
    scale = (rng.uniform(0.5, 1, n) * 2.0 ** rng.integers(-30, 10, n)).astype(np.float32)
    h = (rng.integers(lo - 1, hi + 1, n) + 0.5).astype(np.float32)
    on_product = (h.astype(np.float64) * scale).astype(np.float32)
    nudge = np.where(np.arange(n) % 10 == 0, 0, rng.integers(-40, 41, n))
    w = (on_product.view(np.int32) + nudge).astype(np.int32).view(np.float32)
    expected = np.clip(np.round(w / scale), lo, hi)

    def off_quotient(self, a, b):
        return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(a / b, jnp.int32) + ulps, jnp.float32)

    monkeypatch.setattr(JaxOps, "quotient", off_quotient)
    got = jax.jit(lambda w, s: JaxOps().divide_round_clip(w, s, lo, hi))(jnp.asarray(w), jnp.asarray(scale))
    assert ((w / scale) == h).sum() > 1000  # numpy's quotient is the half-integer itself: ties to even
    np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_16_bit_rounding_without_a_cast_equals_numpys_cast(name):
    # The TPU skips a float32 -> float16 -> float32 round trip inside a jitted program (it keeps
    # the float32 value), so JaxOps rounds to 16 bits with integer and exact float ops.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(100_000) * np.exp(rng.uniform(-30, 14, 100_000))).astype(np.float32)
    x[:10] = [65504, 65519, 65520, -65520, 6.1e-5, 6e-8, 2.98e-8, -2.9e-8, np.inf, 3.4e38]
    dtype = np.float16 if name == "float16" else ml_dtypes.bfloat16
    with np.errstate(over="ignore"):
        expected = x.astype(dtype).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: JaxOps().narrow_rounded(v, name))(x))
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


@stand_in
@pytest.mark.parametrize("shape,input_axes,grid,bits,granularity,group_size,percentile",
                         [case for case in CASES if case[0] == (128, 48)])
def test_numpys_codes_when_xla_divides_as_the_tpu_does(monkeypatch, shape, input_axes, grid, bits, granularity,
                                                      group_size, percentile):
    # CI has no TPU: its division (an ulp off numpy's for a third of quotients) is stood in for.
    monkeypatch.setattr(JaxOps, "quotient", _tpu_like_quotient)
    w = _kernel(shape, seed=3)
    matrix, back = _as_matrix(w, input_axes)
    spec = QuantSpec(bits=bits, grid=grid, granularity=granularity, group_size=group_size, clip_percentile=percentile)
    expected = back(reference_codes_scales(matrix, bits, granularity, group_size, percentile, grid)[2])
    np.testing.assert_array_equal(_jitted(w, input_axes, spec), expected)
    if grid == "symmetric" and bits == 4 and percentile is None:
        # The float16 scales: a float32 -> float16 -> float32 round trip XLA may skip (the TPU does).
        for ggml in (QuantSpec(bits=4, grid="q4_0", group_size=32), QuantSpec(bits=8, grid="q8_0", group_size=32)):
            np.testing.assert_array_equal(_jitted(w, input_axes, ggml), back(quantize_dequantize_array(matrix, ggml)))


@pytest.mark.parametrize("count,percentile", [(2048, 99.9), (2048, 99.0), (2048, 90.0), (16, 95.0), (7, 50.0)])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_jax_order_statistics_equal_a_sort_along_any_axis(count, percentile, axis):
    # The few top ranks (distinct levels and counts), top_k (up to 64 from the top) and a sort.
    rng = np.random.default_rng(count)
    a = np.abs(rng.standard_normal((5, count, 3))).astype(np.float32)
    a[1] = a[1, :1]  # a block of one repeated value
    a[2, :3] = a[2].max()  # the maximum three times
    a[3, -2:] = np.sort(a[3], axis=0)[-2]  # the runner-up three times
    a = np.moveaxis(a, 1, axis)
    lo = int(math.floor(percentile / 100 * (count - 1)))
    ks = [lo, min(lo + 1, count - 1)]
    got = jax.jit(lambda v: JaxOps().order_stats(v, ks, axis))(jnp.asarray(a))
    expected = np.sort(a, axis=axis)
    for k, value in zip(ks, got):
        np.testing.assert_array_equal(np.asarray(value), np.take(expected, [k], axis=axis))


def _within_clip(matrix, percentile):
    """numpy: ``|w| <= c`` per row of the (out, in) matrix, ``c`` the row's percentile of ``|w|``
    (linear interpolation between the two order statistics around it): where the STE passes."""
    s = np.sort(np.abs(matrix), axis=1)
    pos = percentile / 100 * (s.shape[1] - 1)
    lo = int(math.floor(pos))
    c = s[:, lo : lo + 1] + (s[:, lo + 1 : lo + 2] - s[:, lo : lo + 1]) * np.float32(pos - lo)
    return np.abs(matrix) <= c


@pytest.mark.parametrize("shape,input_axes", LAYOUTS[:3])
def test_clip_gradient_masks_weights_beyond_the_threshold_under_jit(shape, input_axes):
    spec = QuantSpec(bits=4, clip_percentile=90.0, clip_gradient=True)
    w = _kernel(shape, seed=1)
    r = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    grad = jax.jit(jax.grad(lambda k: jnp.sum(fake_quantize_weight(k, input_axes, spec) * r)))(jnp.asarray(w))
    matrix, back = _as_matrix(w, input_axes)
    mask = back(_within_clip(matrix, 90.0))
    np.testing.assert_array_equal(np.asarray(grad), np.where(mask, r, 0))
    assert 0.05 < 1 - mask.mean() < 0.2


def test_kernel_blocks_are_reshapes_of_adjacent_input_axes():
    assert kernel_blocks((3, 3, 16, 8), (0, 1, 2), QuantSpec(bits=4)) == ((144, 8), 0)
    assert kernel_blocks((3, 3, 16, 8), (0, 1, 2), QuantSpec(bits=4, group_size=16)) == ((9, 16, 8), 1)
    assert kernel_blocks((40, 64), (1,), QuantSpec(bits=4, group_size=16)) == ((40, 4, 16), 2)
    assert kernel_blocks((40, 64), (1,), QuantSpec(bits=4, granularity="tensor")) == ((2560,), 0)
    assert kernel_blocks((4, 16, 6, 8), (0, 2), QuantSpec(bits=4)) is None
    with pytest.raises(ValueError, match="group_size=48 does not divide the input size 64"):
        kernel_blocks((40, 64), (1,), QuantSpec(bits=4, group_size=48))


@pytest.mark.parametrize("clip_percentile", [None, 90.0])
def test_a_bfloat16_dtype_rounds_numpys_values_once_and_passes_a_float32_gradient(clip_percentile):
    # What a layer computing in bfloat16 gets: the float32 lattice rounded once to bfloat16, and
    # the straight-through gradient (masked beyond the threshold with clip_gradient) in the
    # master weight's float32.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    spec = QuantSpec(bits=4, clip_percentile=clip_percentile, clip_gradient=clip_percentile is not None)
    w = _kernel((128, 48), seed=4)
    r = np.random.default_rng(5).standard_normal(w.shape).astype(np.float32)
    deq = jax.jit(lambda k: fake_quantize_weight(k, (0,), spec, dtype=jnp.bfloat16))(jnp.asarray(w))
    grad = jax.jit(jax.grad(
        lambda k: jnp.sum(fake_quantize_weight(k, (0,), spec, dtype=jnp.bfloat16).astype(jnp.float32) * r)))(
        jnp.asarray(w))
    matrix, back = _as_matrix(w, (0,))
    expected = reference_codes_scales(matrix, 4, "channel", None, clip_percentile, "symmetric")[2]
    assert deq.dtype == jnp.bfloat16 and grad.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(deq.astype(jnp.float32)),
                                  back(expected).astype(ml_dtypes.bfloat16).astype(np.float32))
    # the cotangent reaching the kernel is r rounded to bfloat16 (the output's dtype)
    passed = r.astype(ml_dtypes.bfloat16).astype(np.float32)
    if clip_percentile is not None:
        passed = np.where(back(_within_clip(matrix, clip_percentile)), passed, 0)
    np.testing.assert_array_equal(np.asarray(grad), passed)


@pytest.mark.parametrize("tpu_like", [False, pytest.param(True, marks=stand_in)])
def test_activation_row_codes_and_scales_are_numpys_quotients(monkeypatch, tpu_like):
    # XLA multiplies by the reciprocal of a constant divisor, an ulp off for some scales (4% on
    # CPU), and the TPU's own quotients are ulps off (the stand-in): the row scales and the codes'
    # multipliers are the correctly rounded absmax / qmax and qmax / absmax, as numpy divides.
    from mixle.flax_backend.int_matmul import quantize_rows

    if tpu_like:
        monkeypatch.setattr(JaxOps, "quotient", _tpu_like_quotient)
    rng = np.random.default_rng(6)
    x = rng.uniform(0.1, 10, (20000, 3)).astype(np.float32)
    # rows whose scaled values sit on halves, where a multiplier an ulp off moves the code
    x[:, 1] = x[:, 0] * np.float32(rng.integers(1, 126, 20000) + 0.5) / np.float32(127)
    x[:, 2] = x[:, 0] * rng.uniform(0, 1, 20000).astype(np.float32)
    for bits, axis in ((8, -1), (4, 0)):
        qmax = np.float32(2 ** (bits - 1) - 1)
        codes, scale = jax.jit(lambda v: quantize_rows(v, bits, axis))(jnp.asarray(x))
        absmax = np.abs(x).max(axis=axis, keepdims=True)
        np.testing.assert_array_equal(np.asarray(scale).view(np.uint32), (absmax / qmax).view(np.uint32))
        np.testing.assert_array_equal(np.asarray(codes), np.clip(np.round(x * (qmax / absmax)), -qmax, qmax))
    # a plain division would be exact here on the CPU and off on the TPU: there is none outside the
    # conditionals in which JaxOps.divide corrects its quotient
    jaxpr = jax.make_jaxpr(lambda v: quantize_rows(v, 8))(jnp.asarray(x)).jaxpr
    assert not equations(jaxpr, "div", skip=("cond",))


@pytest.mark.parametrize("shape,input_axes", LAYOUTS)
@pytest.mark.parametrize("grouped", [False, True])
def test_off_the_cpu_only_a_grouped_kernel_keeps_a_barrier_in_its_group_view(monkeypatch, shape, input_axes, grouped):
    # Off the CPU a per-channel kernel is not kept behind a barrier (XLA fuses it into its consumer,
    # 1.069x -> 1.032x of the float step on a TPU); a grouped one is, in its group view, before the
    # reshape back (else XLA materializes the per-group arrays at the kernel's size). The values
    # must not change.
    import re

    import mixle.flax_backend.fake_quant as fake_quant

    if grouped and input_axes == (0, 2):
        pytest.skip("group_size needs adjacent input axes")
    spec = QuantSpec(bits=4, group_size=16) if grouped else QuantSpec(bits=8)
    w = _kernel(shape, seed=7)

    def barrier_types():
        text = jax.jit(lambda k: fake_quantize_weight(k, input_axes, spec)).lower(jnp.asarray(w)).as_text()
        return sorted(re.findall(r"optimization_barrier %\S+ : tensor<([^>]*)>", text))

    def tensor_type(dims):
        return "x".join(map(str, dims)) + "xf32"

    monkeypatch.setattr(fake_quant.jax, "default_backend", lambda: "cpu")  # the test also runs on a TPU
    on_cpu = barrier_types()
    expected = list(on_cpu)
    expected.remove(tensor_type(shape))  # the CPU's barrier on the kernel in its own shape
    if grouped:
        expected.append(tensor_type(fake_quant.kernel_blocks(shape, input_axes, spec)[0]))
    monkeypatch.setattr(fake_quant.jax, "default_backend", lambda: "tpu")
    assert barrier_types() == sorted(expected)
    matrix, back = _as_matrix(w, input_axes)
    np.testing.assert_array_equal(_jitted(w, input_axes, spec), back(quantize_dequantize_array(matrix, spec)))
