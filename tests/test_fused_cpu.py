"""The fused CPU fake-quant kernels: bit-identical to plain numpy, every selection path, the build."""

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from torch import nn

import mixle.torch_backend.fake_quant.buffers as fq
from mixle.torch_backend.kernels import fused_cpu as _fused_cpu
from mixle.torch_backend.kernels import kernel_cache
from mixle.models.qat import apply_qat
from mixle.core.spec import QuantSpec
from tests.test_numerics import reference_codes_scales
from tests.test_qat_cache import batches

pytestmark = pytest.mark.skipif(not _fused_cpu.available(), reason="no C++ compiler: the kernels could not be built")

LAYOUTS = [("tensor", None), ("channel", None), ("group", 16), ("group", 32)]
# None: max|w|; 99.9 and 97: a few values above rank lo (walk down the distinct maxima);
# 80: many (a heap of the top values); 30 and 0.5: far from the top (selection); 100: the max.
PERCENTILES = [None, 99.9, 97.0, 80.0, 30.0, 0.5, 100.0]


def weight(dtype, rows=24, cols=64, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(dtype)
    w[3] = 0.0  # all-zero row: scale 1
    w[5, 7] = 0.9  # outlier
    w[6] = np.round(w[6], 2)  # many ties
    w[7, :40] = -0.125  # ties at the top
    w[8, ::2] = -0.0
    return w


def spec_for(bits, granularity, group_size, percentile, grid="symmetric"):
    return QuantSpec(bits=bits, granularity=granularity, group_size=group_size, clip_percentile=percentile, grid=grid)


def reference_threshold(w, granularity, group_size, percentile):
    """max|w| or the linear-interpolated percentile of |w| per block, in w's dtype (numpy)."""
    blocks = w.reshape(1, -1) if granularity == "tensor" else w.reshape(-1, group_size or w.shape[1])
    a = np.sort(np.abs(blocks), axis=1)
    if percentile is None:
        return a[:, -1:]
    pos = percentile / 100 * (a.shape[1] - 1)
    lo = int(np.floor(pos))
    hi = min(lo + 1, a.shape[1] - 1)
    frac = np.asarray(pos - lo, dtype=w.dtype)
    return a[:, lo : lo + 1] + (a[:, hi : hi + 1] - a[:, lo : lo + 1]) * frac if frac else a[:, lo : lo + 1]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("grid", ["symmetric", "qwix"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("granularity,group_size", LAYOUTS)
@pytest.mark.parametrize("percentile", PERCENTILES)
def test_kernel_equals_numpy_bit_for_bit(dtype, grid, bits, granularity, group_size, percentile):
    w = weight(dtype)
    spec = spec_for(bits, granularity, group_size, percentile, grid)
    codes, scale, deq = reference_codes_scales(w, bits, granularity, group_size, percentile, grid)
    x = torch.from_numpy(w)
    got_deq, got_codes, got_scale, threshold, nonfinite, overflow = _fused_cpu.fake_quant(
        x, spec, want_codes=True, want_threshold=True)
    assert int(nonfinite) == 0 and int(overflow) == 0
    np.testing.assert_array_equal(got_codes.numpy(), codes)
    np.testing.assert_array_equal(got_scale.numpy().reshape(-1), scale.reshape(-1))
    np.testing.assert_array_equal(got_deq.numpy(), deq)
    assert got_deq.dtype == x.dtype
    np.testing.assert_array_equal(threshold.numpy().reshape(-1), reference_threshold(w, granularity, group_size, percentile).reshape(-1))
    # Rebuilding on the stored scales and dequantizing the codes give the same values.
    rebuilt = _fused_cpu.fake_quant(x, spec, scale=got_scale)[0]
    np.testing.assert_array_equal(rebuilt.numpy(), deq)
    np.testing.assert_array_equal(_fused_cpu.dequantize(got_codes, got_scale, spec).numpy(), deq)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("granularity,group_size", LAYOUTS)
def test_thread_count_does_not_change_a_bit(threads, granularity, group_size):
    # 3 blocks of a 3-row tensor-granularity batch, fewer blocks than threads, odd sizes.
    w = weight(np.float32, rows=96, cols=96, seed=1)
    spec = spec_for(4, granularity, group_size, 99.0)
    expected = reference_codes_scales(w, 4, granularity, group_size, 99.0)[2]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        deq = _fused_cpu.fake_quant(torch.from_numpy(w), spec)[0]
    finally:
        torch.set_num_threads(before)
    np.testing.assert_array_equal(deq.numpy(), expected)


def test_large_tensor_block_uses_every_selection_path():
    # One block of 2**16 values: percentiles whose top sets are tiny, mid-sized and huge.
    rng = np.random.default_rng(2)
    w = rng.standard_normal((256, 256)).astype(np.float32)
    w[0, :50] = 4.0  # ties at the very top
    for percentile in (99.99, 99.95, 99.0, 90.0, 50.0):
        spec = spec_for(8, "tensor", None, percentile)
        got = _fused_cpu.fake_quant(torch.from_numpy(w), spec, want_threshold=True)
        np.testing.assert_array_equal(got[3].numpy().reshape(-1), reference_threshold(w, "tensor", None, percentile).reshape(-1))
        np.testing.assert_array_equal(got[0].numpy(), reference_codes_scales(w, 8, "tensor", None, percentile)[2])


def test_selection_stays_exact_when_the_sample_misjudges_the_cut():
    # The kernel samples every 8th value of a 2**16 block to place its cut; make exactly those
    # values the large ones, so that too few values pass the cut and it must fall back.
    w = np.full(2**16, 1e-3, np.float32)
    w[::8] = np.linspace(1.0, 2.0, 2**13, dtype=np.float32)
    w[1::8] = np.linspace(0.5, 0.9, 2**13, dtype=np.float32)  # ranks the sample never saw
    w = w.reshape(256, 256)
    for percentile in (97.0, 80.0):
        spec = spec_for(8, "tensor", None, percentile)
        got = _fused_cpu.fake_quant(torch.from_numpy(w), spec, want_threshold=True)
        np.testing.assert_array_equal(got[3].numpy().reshape(-1), reference_threshold(w, "tensor", None, percentile).reshape(-1))
        np.testing.assert_array_equal(got[0].numpy(), reference_codes_scales(w, 8, "tensor", None, percentile)[2])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("percentile", [None, 99.0])
def test_nan_or_infinity_is_reported_not_hidden(bad, percentile):
    w = weight(np.float32)
    w[10, 3] = bad
    for granularity, group_size in LAYOUTS:
        assert int(_fused_cpu.fake_quant(torch.from_numpy(w), spec_for(4, granularity, group_size, percentile))[4]) == 1
    w[10, 3] = 0.5
    assert int(_fused_cpu.fake_quant(torch.from_numpy(w), spec_for(4, "channel", None, percentile))[4]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("grid", ["symmetric", "qwix"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("granularity,group_size", [("tensor", None), ("channel", None), ("group", 16)])
def test_blocks_that_would_dequantize_to_infinity_are_counted(dtype, grid, bits, granularity, group_size):
    """The kernel counts, in its own pass, the blocks whose scale times the grid's largest code overflows
    the weight's dtype (rounds to infinity in bfloat16): numerics' check_dequantized_range, on its scales."""
    from mixle.core.checks import ScaleOverflowError
    from mixle.core.stored import check_dequantized_range

    finfo = torch.finfo(dtype)
    w = torch.from_numpy(weight(np.float64, rows=12, cols=32)).to(dtype)
    w[0, 1] = -finfo.max  # overflows wherever the largest code exceeds the divisor (qwix; symmetric int8 rounds up)
    w[2, 20] = -finfo.max / 2  # fits
    spec = spec_for(bits, granularity, group_size, None, grid)
    _, _, scale, _, nonfinite, overflow = _fused_cpu.fake_quant(w, spec)
    largest = GRIDS_LARGEST[grid, bits]
    with np.errstate(over="ignore"):
        top = np.abs(scale.numpy()) * scale.numpy().dtype.type(largest)
    limit = 2.0 ** 127 * (2 - 2.0 ** -8) if dtype == torch.bfloat16 else np.inf
    want = int((~(top < limit)).sum())  # the numpy rule, independently
    assert int(nonfinite) == 0 and int(overflow) == want
    assert want > 0 or grid == "symmetric"
    if want:
        with pytest.raises(ScaleOverflowError):
            check_dequantized_range(scale, spec, dtype=None if dtype != torch.bfloat16 else "bfloat16")
    if dtype == torch.float32:  # written as bfloat16 (autocast's operand): the weight's own dtype decides
        out = torch.empty_like(w, dtype=torch.bfloat16)
        assert int(_fused_cpu.fake_quant(w, spec, out=out)[5]) == want


GRIDS_LARGEST = {("symmetric", 4): 7, ("symmetric", 8): 127, ("qwix", 4): 8, ("qwix", 8): 128}


def test_clip_mask_gradient_matches_numpy():
    w = weight(np.float32)
    spec = spec_for(4, "group", 16, 80.0)
    threshold = reference_threshold(w, "group", 16, 80.0)
    g = np.random.default_rng(3).standard_normal(w.shape).astype(np.float32)
    g[0, 0] = np.nan  # the reference multiplies: NaN * 0 stays NaN, -g * 0 is -0.0
    expected = (g.reshape(-1, 16) * (np.abs(w.reshape(-1, 16)) <= threshold)).reshape(w.shape)
    got = _fused_cpu.clip_mask_grad(torch.from_numpy(g), torch.from_numpy(w), torch.from_numpy(threshold.reshape(1, -1, 1)), spec)
    np.testing.assert_array_equal(got.numpy(), expected)
    assert np.array_equal(np.signbit(got.numpy()), np.signbit(expected))


def bits_of(t):
    """The bit patterns of a bfloat16 tensor (equal only where every bit is, NaN and -0 included)."""
    return t.view(torch.int16)


def bf16_values(deq):
    """A bf16 weight's fake-quantized values from the numpy reference's values of its float32 copy:
    those values rounded once to bf16 (-0 included)."""
    return torch.from_numpy(deq).bfloat16()


def bf16_weight():
    """``weight``'s test cases in bfloat16, and their float32 copy (exactly the same values)."""
    x = torch.from_numpy(weight(np.float32)).bfloat16()
    return x, x.float().numpy()


@pytest.mark.parametrize("grid", ["symmetric", "qwix"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("granularity,group_size", LAYOUTS)
@pytest.mark.parametrize("percentile", [None, 99.9, 80.0, 30.0])
def test_bf16_kernel_runs_the_float32_numerics_bit_for_bit(grid, bits, granularity, group_size, percentile):
    x, w = bf16_weight()
    spec = spec_for(bits, granularity, group_size, percentile, grid)
    codes, scale, ref_deq = reference_codes_scales(w, bits, granularity, group_size, percentile, grid)
    deq, got_codes, got_scale, threshold, nonfinite, overflow = _fused_cpu.fake_quant(
        x, spec, want_codes=True, want_threshold=True)
    assert int(nonfinite) == 0 and int(overflow) == 0
    # Codes, scales and thresholds: the float32 copy's, kept in float32.
    assert got_scale.dtype == threshold.dtype == torch.float32
    np.testing.assert_array_equal(got_codes.numpy(), codes)
    np.testing.assert_array_equal(got_scale.numpy().reshape(-1), scale.reshape(-1))
    np.testing.assert_array_equal(threshold.numpy().reshape(-1), reference_threshold(w, granularity, group_size, percentile).reshape(-1))
    # Values: the float32 copy's, rounded once to bf16.
    expected = bf16_values(ref_deq)
    assert deq.dtype == torch.bfloat16 and torch.equal(bits_of(deq), bits_of(expected))
    # The rebuild on the float32 scales; the dequantize of the int8 codes (int8 codes have no -0,
    # so values compare, as on float32).
    assert torch.equal(bits_of(_fused_cpu.fake_quant(x, spec, scale=got_scale)[0]), bits_of(expected))
    got = _fused_cpu.dequantize(got_codes, got_scale, spec, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


def test_bf16_per_tensor_block_over_threads_and_nan_blocks():
    # One large block (the all-threads statistics path) and a NaN block, in bf16.
    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.standard_normal((256, 256)).astype(np.float32)).bfloat16()
    w = x.float().numpy()
    for percentile in (None, 99.99, 90.0):
        spec = spec_for(8, "tensor", None, percentile)
        deq, codes, *_ = _fused_cpu.fake_quant(x, spec, want_codes=True)
        ref = reference_codes_scales(w, 8, "tensor", None, percentile)
        np.testing.assert_array_equal(codes.numpy(), ref[0])
        assert torch.equal(bits_of(deq), bits_of(bf16_values(ref[2])))
    x[10, 3] = float("nan")
    assert int(_fused_cpu.fake_quant(x, spec_for(4, "group", 32, None))[4]) == 1


def test_bf16_clip_mask_gradient_matches_numpy():
    x, w = bf16_weight()
    spec = spec_for(4, "group", 16, 80.0)
    threshold = reference_threshold(w, "group", 16, 80.0)
    g = torch.from_numpy(np.random.default_rng(3).standard_normal(w.shape).astype(np.float32)).bfloat16()
    g[0, 0] = float("nan")
    # g * mask is exact in bf16 (g, +-0 or NaN): numpy's float32 product, cast.
    expected = (g.float().numpy().reshape(-1, 16) * (np.abs(w.reshape(-1, 16)) <= threshold)).reshape(w.shape)
    got = _fused_cpu.clip_mask_grad(g, x, torch.from_numpy(threshold.reshape(1, -1, 1)), spec)
    assert got.dtype == torch.bfloat16
    np.testing.assert_array_equal(got.float().numpy(), expected)
    assert np.array_equal(np.signbit(got.float().numpy()), np.signbit(expected))


def test_kernels_apply_only_where_they_are_exact():
    x = torch.zeros(4, 8)
    assert _fused_cpu.applies_to(x) and _fused_cpu.applies_to(x.double()) and _fused_cpu.applies_to(x.bfloat16())
    assert not _fused_cpu.applies_to(x.half())
    assert not _fused_cpu.applies_to(x.t())  # not contiguous: the torch ops take it


def _train_three_steps(spec):
    """Three SGD steps of 2 micro-batches each, with an eval forward between, on two equal-sized
    hidden layers (so dead forward buffers are recycled); returns the final parameters."""
    torch.manual_seed(0)
    model = apply_qat(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                                    nn.Linear(32, 32), nn.Linear(32, 8)), spec=spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        for x in batches(2, seed=step):
            model(x).square().mean().backward()
        with torch.no_grad():
            model(x)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("spec", [QuantSpec(bits=4), QuantSpec(bits=8, group_size=8, clip_percentile=90.0,
                                                                 clip_gradient=True)])
def test_fused_kernels_train_bit_identically_to_the_torch_ops(spec, monkeypatch):
    recycled = []
    take = fq._SpareBuffer.take

    def counted_take(self, like, holding=None, dtype=None):
        buffer, holds = take(self, like, holding, dtype)
        recycled.append((buffer is not None, holds))
        return buffer, holds

    monkeypatch.setattr(fq._SpareBuffer, "take", counted_take)
    fused = _train_three_steps(spec)
    assert sum(reused for reused, _ in recycled) >= 6  # forward buffers and weight gradients
    assert sum(holds for _, holds in recycled) >= 3  # the last layer's weight was not rebuilt
    with _fused_cpu.switched_off():
        reference = _train_three_steps(spec)
    for a, b in zip(fused, reference):
        assert torch.equal(a, b)


def test_a_recycled_buffer_stands_for_a_weight_only_in_its_own_layers_backward():
    def grads():
        torch.manual_seed(0)
        first, *others = (apply_qat(nn.Linear(32, 32), bits=4) for _ in range(4))
        x = torch.randn(4, 32, requires_grad=True)
        loss_first = first(x).square().sum()
        for other in others:  # the last of them takes first's dead buffer (the last two forwards' are kept)
            other(x).sum()
        loss_first.backward()  # first's backward gets another layer's buffer: it must rebuild its own weight
        return x.grad, first.weight.grad

    fused = grads()
    with _fused_cpu.switched_off():
        reference = grads()
    for a, b in zip(fused, reference):
        assert torch.equal(a, b)


def _run(code, **env):
    full_env = {**os.environ, **env}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=240, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


TRAIN_ONE_STEP = """
    import warnings
    import numpy as np, torch
    from mixle.torch_backend.kernels import fused_cpu as _fused_cpu
    from mixle.models.qat import apply_qat
    from tests.test_numerics import reference_codes_scales
    warnings.simplefilter("always")
    torch.manual_seed(0)
    model = apply_qat(torch.nn.Sequential(torch.nn.Linear(8, 4)), bits=4)
    x = torch.randn(3, 8)
    w = reference_codes_scales(model[0].weight.detach().numpy(), 4, "channel")[2]
    assert torch.equal(model(x), torch.nn.functional.linear(x, torch.from_numpy(w), model[0].bias))
    print("available", _fused_cpu.available())
"""


@pytest.mark.parametrize("compiler", ["no-such-c++", "false"])  # missing, or failing every build
def test_without_a_compiler_qat_warns_once_and_runs_the_same_numerics(tmp_path, compiler):
    cxx = str(tmp_path / compiler) if compiler == "no-such-c++" else compiler
    out = _run(TRAIN_ONE_STEP, CXX=cxx, MIXLE_CACHE_DIR=str(tmp_path))
    assert "available False" in out
    assert out.count("could not build its fused CPU fake-quant kernels") == 1
    assert "MIXLE_FUSED_KERNELS=0" in out and compiler in out
    assert not list(tmp_path.glob("*.so"))  # no partial build left behind


def test_switched_off_kernels_stay_quiet(tmp_path):
    out = _run(TRAIN_ONE_STEP, MIXLE_FUSED_KERNELS="0", MIXLE_CACHE_DIR=str(tmp_path))
    assert "available False" in out and "Warning" not in out


def test_built_once_per_source_and_reused(tmp_path):
    _run(TRAIN_ONE_STEP, MIXLE_CACHE_DIR=str(tmp_path))
    built = sorted(p.name for p in tmp_path.iterdir())
    assert len(built) == 2 and built[0].startswith("fused_fake_quant_") and built[0].endswith(".json")
    assert built[1].startswith(built[0][:-5] + "_") and built[1].endswith(".so")  # the record and its library
    stamp = (tmp_path / built[1]).stat().st_mtime_ns
    assert "available True" in _run(TRAIN_ONE_STEP, MIXLE_CACHE_DIR=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == built  # no second build, no leftovers
    assert (tmp_path / built[1]).stat().st_mtime_ns == stamp


# ----------------------------------------------------------------------------------------------
# The kernel cache loads only what this user built (each load runs in a subprocess: a crash
# inside dlopen fails the test instead of killing pytest). A stand-in compiler "builds" by copying
# the library this process already loaded, so the tests run the cache's logic without compiling.

PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("MIXLE_TEST_MARKER"), "w");
    if (f) { fputs("foreign code ran", f); fclose(f); }
}
"""


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory):
    """A foreign library whose constructor writes the file named by MIXLE_TEST_MARKER."""
    directory = tmp_path_factory.mktemp("planted")
    (directory / "planted.c").write_text(PLANTED)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(directory / "planted.so"), str(directory / "planted.c")],
                   check=True)
    return (directory / "planted.so").read_bytes()


def _stand_in_compiler(directory):
    compiler = directory / "stand-in-c++"
    compiler.write_text(f"""#!/bin/sh
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
cp '{_fused_cpu.library_path()}' "$out"
""")
    compiler.chmod(0o755)
    return str(compiler)


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    """``(cache holding one recorded build, the compiler it was recorded for)``; tests copy it."""
    directory = tmp_path_factory.mktemp("built")
    compiler = _stand_in_compiler(tmp_path_factory.mktemp("bin"))
    assert "available True" in _run(TRAIN_ONE_STEP, MIXLE_CACHE_DIR=str(directory), CXX=compiler)
    return directory, compiler


def _copy_cache(built_cache, directory):
    for path in built_cache[0].iterdir():
        shutil.copy2(path, directory / path.name)  # keeps the 0600 modes


def _record_of(directory, compiler):
    key = kernel_cache.build_key(_fused_cpu.SOURCE.read_bytes(), compiler, _fused_cpu.FLAGS + ("-fopenmp",))
    return directory / f"fused_fake_quant_{key}.json", key


def _forge_record(record, library):
    """A record naming ``library`` with its true size and digest (what a forger would write)."""
    record.write_text(json.dumps({"version": 1, "library": library.name, "size": library.stat().st_size,
                                  "sha256": hashlib.sha256(library.read_bytes()).hexdigest()}))


def test_a_library_planted_in_a_world_writable_cache_never_runs(tmp_path, built_cache, planted_library):
    compiler = built_cache[1]
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # like /tmp: anyone may drop files here
    record, key = _record_of(shared, compiler)
    planted = shared / f"fused_fake_quant_{key}_0000000000000000.so"
    planted.write_bytes(planted_library)
    _forge_record(record, planted)
    for path in (record, planted):
        path.chmod(0o666)
    marker = tmp_path / "marker"
    out = _run(TRAIN_ONE_STEP, MIXLE_CACHE_DIR=str(shared), CXX=compiler, MIXLE_TEST_MARKER=str(marker))
    assert not marker.exists(), "the planted library's constructor ran"
    assert "available True" in out  # built afresh in the private per-user subdirectory
    private = shared / f"mixle-{os.getuid()}"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert len(list(private.glob("fused_fake_quant_*.so"))) == 1


@pytest.mark.skipif(os.getuid() != 0, reason="planting files owned by another user needs root")
def test_a_cache_directory_owned_by_another_user_is_refused(tmp_path, built_cache, planted_library):
    compiler = built_cache[1]
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    foreign = shared / f"mixle-{os.getuid()}"  # pre-created by another user, with a planted build
    foreign.mkdir(mode=0o700)
    record, key = _record_of(foreign, compiler)
    planted = foreign / f"fused_fake_quant_{key}_0000000000000000.so"
    planted.write_bytes(planted_library)
    _forge_record(record, planted)
    for path in (foreign, record, planted):
        os.chown(path, 65534, 65534)
    marker = tmp_path / "marker"
    out = _run(TRAIN_ONE_STEP, MIXLE_CACHE_DIR=str(shared), CXX=compiler, MIXLE_TEST_MARKER=str(marker))
    assert not marker.exists()
    assert "available False" in out and out.count("could not build its fused CPU") == 1
    assert "not this user's private directory" in out


DAMAGES = ["truncated", "foreign", "loose-record"] + (["foreign-owner-record"] if os.getuid() == 0 else [])


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_cached_library_is_rebuilt_not_loaded(tmp_path, damage, built_cache, planted_library):
    _copy_cache(built_cache, tmp_path)
    record, _ = _record_of(tmp_path, built_cache[1])
    (library,) = tmp_path.glob("fused_fake_quant_*.so")
    marker = tmp_path / "marker"
    if damage == "truncated":
        library.write_bytes(library.read_bytes()[: library.stat().st_size // 2])
    else:
        library.write_bytes(planted_library)
    if damage == "loose-record":  # a record anyone may write is not trusted, whatever it says
        _forge_record(record, library)
        record.chmod(0o666)
    elif damage == "foreign-owner-record":
        _forge_record(record, library)
        os.chown(record, 65534, 65534)
    out = _run(TRAIN_ONE_STEP, MIXLE_CACHE_DIR=str(tmp_path), CXX=built_cache[1], MIXLE_TEST_MARKER=str(marker))
    assert "available True" in out and "Warning" not in out
    assert not marker.exists()
    entry = json.loads(record.read_text())
    rebuilt = tmp_path / entry["library"]
    assert hashlib.sha256(rebuilt.read_bytes()).hexdigest() == entry["sha256"]
    assert rebuilt.read_bytes() == Path(_fused_cpu.library_path()).read_bytes()
    assert stat.S_IMODE(record.stat().st_mode) == 0o600 and record.stat().st_uid == os.getuid()


def test_a_recorded_build_is_used_without_a_compiler_on_path(tmp_path):
    cache, bin_dir = tmp_path / "cache", tmp_path / "bin"
    bin_dir.mkdir()
    compiler = bin_dir / "c++"  # the default compiler name, found on PATH for the first build only
    compiler.symlink_to(_stand_in_compiler(tmp_path))
    assert "available True" in _run(TRAIN_ONE_STEP, MIXLE_CACHE_DIR=str(cache), CXX="c++",
                                    PATH=f"{bin_dir}:{os.environ['PATH']}")
    built = sorted(p.name for p in cache.iterdir())
    compiler.unlink()
    out = _run(TRAIN_ONE_STEP, MIXLE_CACHE_DIR=str(cache), CXX="c++", PATH=str(bin_dir))  # no compiler anywhere
    assert "available True" in out and "Warning" not in out
    assert sorted(p.name for p in cache.iterdir()) == built
