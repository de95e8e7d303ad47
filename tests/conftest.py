"""Shared fixtures: run the torch fake-quant tests on both of its execution paths."""

import pytest


@pytest.fixture(params=["fused", "torch-ops"])
def fake_quant_path(request, monkeypatch):
    """The fused CPU kernels, or the same numerics as separate torch ops (no compiler, or off)."""
    from mixle.models import _fused_cpu

    if request.param == "fused":
        if not _fused_cpu.available():
            pytest.skip("the fused CPU kernels could not be built here (no C++ compiler)")
    else:
        monkeypatch.setitem(_fused_cpu._loaded, "kernels", None)
    return request.param
