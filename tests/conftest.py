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
