"""A llama-cpp-python that crashes on this machine is found in a subprocess and left out, saying why.

The probe's subprocess is replaced by one that crashes (or fails) the way llama.cpp's native code
does, so this runs without llama-cpp-python; with it installed, the real probe runs too.
"""

import sys

import pytest

pytest.importorskip("torch")

from mixle._optional import is_available  # noqa: E402
from mixle.lm import llama_cpp_eval  # noqa: E402


@pytest.fixture
def probe(monkeypatch):
    """Make llama-cpp-python look installed and its probe run ``code``; the cached answer is cleared."""

    def use(code):
        monkeypatch.setattr(llama_cpp_eval, "is_available", lambda name: name == "llama_cpp")
        monkeypatch.setattr(llama_cpp_eval, "PROBE", code)
        llama_cpp_eval.llama_cpp_problem.cache_clear()

    yield use
    llama_cpp_eval.llama_cpp_problem.cache_clear()


def test_a_crash_is_named_with_its_signal_and_the_rebuild(probe):
    probe("import os, signal, sys; print('ldtilecfg', file=sys.stderr); os.kill(os.getpid(), signal.SIGSEGV)")
    problem = llama_cpp_eval.llama_cpp_problem()
    assert "llama.cpp crashed (SIGSEGV) running a tiny Q4_0 file" in problem and "(ldtilecfg)" in problem
    assert llama_cpp_eval.REBUILD in problem and "-DGGML_NATIVE=OFF" in llama_cpp_eval.REBUILD
    with pytest.warns(RuntimeWarning, match=r"crashed \(SIGSEGV\)"):
        assert llama_cpp_eval.llama_cpp_module() is None
    assert llama_cpp_eval.llama_cpp_skipped() == {"skipped": problem}  # what finetune / compare record
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match=r"^a check needs llama.cpp: llama-cpp-python"):
        llama_cpp_eval.require_llama_cpp("a check")


def test_a_failure_is_named_with_its_exit_status_and_asked_once(probe, tmp_path):
    count = tmp_path / "runs"
    probe(f"import pathlib; p = pathlib.Path({str(count)!r}); p.write_text(p.read_text() + 'x' if p.exists() "
          "else 'x'); raise SystemExit(3)")
    first = llama_cpp_eval.llama_cpp_problem()
    assert "llama.cpp failed (exit status 3)" in first
    assert llama_cpp_eval.llama_cpp_problem() is first and count.read_text() == "x"  # one subprocess per process


def test_a_probe_that_runs_is_no_problem(probe):
    probe("import sys; sys.exit(0)")
    assert llama_cpp_eval.llama_cpp_problem() is None
    assert llama_cpp_eval.llama_cpp_skipped() is None


def test_require_llama_cpp_names_the_extra_when_it_is_not_installed(monkeypatch):
    monkeypatch.setattr(llama_cpp_eval, "is_available", lambda name: False)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(ImportError, match=r"mixle needs 'llama_cpp' for a check.*pip install mixle\[llama\]"):
        llama_cpp_eval.require_llama_cpp("a check")
    assert llama_cpp_eval.llama_cpp_skipped() is None


def test_the_real_probe_runs_the_installed_llama_cpp():
    if sys.modules.get("llama_cpp", 0) is None:
        pytest.skip("conftest found it crashing here (the run's header says why)")
    if not is_available("llama_cpp"):
        pytest.skip("llama-cpp-python is not installed")
    assert llama_cpp_eval.llama_cpp_problem() is None  # the probe ran llama.cpp in a subprocess and it finished

