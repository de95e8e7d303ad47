"""Shared fixtures: run the torch fake-quant tests on both of its execution paths; hide a
llama-cpp-python that crashes on this machine, so the live llama.cpp checks skip saying why."""

import sys

import pytest

from mixle._optional import is_available


def _llama_cpp_problem():
    if not (is_available("llama_cpp") and is_available("torch")):
        return None
    from mixle.lm.llama_cpp_eval import llama_cpp_problem

    return llama_cpp_problem()


LLAMA_CPP_PROBLEM = _llama_cpp_problem()
if LLAMA_CPP_PROBLEM is not None:
    sys.modules["llama_cpp"] = None  # import fails, find_spec is None: the live checks skip


def pytest_report_header(config):
    return None if LLAMA_CPP_PROBLEM is None else f"llama.cpp checks skipped: {LLAMA_CPP_PROBLEM}"


@pytest.fixture(params=["fused", "torch-ops"])
def fake_quant_path(request):
    """The fused CPU kernels, or the same numerics as separate torch ops (no compiler, or off)."""
    from mixle.torch_backend.kernels import fused_cpu as _fused_cpu

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
    from mixle.torch_backend.kernels import packed_linear

    with packed_linear.switched_off():
        yield
