"""Shared fixtures: run the torch fake-quant tests on both of its execution paths."""

import pytest


@pytest.fixture(params=["fused", "torch-ops"])
def fake_quant_path(request):
    """The fused CPU kernels, or the same numerics as separate torch ops (no compiler, or off)."""
    from mixle.torch_backend import fused_cpu as _fused_cpu

    if request.param == "fused":
        if not _fused_cpu.available():
            pytest.skip("the fused CPU kernels could not be built here (no C++ compiler)")
        yield request.param
    else:
        with _fused_cpu.switched_off():
            yield request.param


@pytest.fixture
def exact_converted_layers():
    """Converted layers compute with the exact dequantize-then-matmul path, so "convert ==
    fake-quant" is the same float operations in the same order and holds bit for bit (the packed
    int kernel, which sums in another order, is checked against a tolerance in test_packed_linear)."""
    from mixle.torch_backend import packed_linear

    with packed_linear.switched_off():
        yield
