"""llama.cpp parity in CI, against logits llama.cpp computed once (``benchmarks/make_llama_cpp_fixtures.py``).

For each case, today's ``save_gguf`` must write exactly the tensors of the file llama.cpp ran (type,
shape and bytes), and today's mixle forward must match llama.cpp's stored logits within the gap
measured when the fixture was made, so a change to ``save_gguf`` or to the numerics that breaks
parity fails here without llama.cpp installed.
"""

import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

from tests.gguf_parity_cases import CASES, FIXTURE, save_options, tensor_digests  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
# mixle's own forward may sum in another order on another CPU (float32 eps x a reduction of ~100
# terms x |logit| ~ 1 is ~1e-5), and such an order can move a Q8_0 activation code that sits at a
# tie; 1e-4 of room above the measured gap covers both and still fails a layout or grid change,
# which moves logits by 1e-2 or more.
ORDER_SLACK = 1e-4


@pytest.fixture(scope="module")
def fixture():
    path = ROOT / FIXTURE
    if not path.exists():
        pytest.fail(f"{FIXTURE} is missing: run `python benchmarks/make_llama_cpp_fixtures.py` with llama-cpp-python")
    data = np.load(path)
    return data, json.loads(str(data["meta"]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_save_gguf_writes_the_file_llama_cpp_ran(name, fixture, tmp_path):
    import mixle

    build, options, _, packages = CASES[name]
    for package in packages:
        pytest.importorskip(package)
    _, meta = fixture
    path = tmp_path / f"{name}.gguf"
    model = build()
    mixle.save_gguf(model, path, **save_options(options, model))
    now = tensor_digests(path)
    then = meta["cases"][name]["tensors"]  # {name: [type, shape, sha256]}
    assert sorted(now) == sorted(then)
    changed = [key for key in then if list(now[key]) != then[key]]
    assert changed == [], f"tensors that differ from the file llama.cpp ran: {changed}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_mixle_forward_matches_llama_cpps_logits(name, fixture):
    build, _, logits_of, packages = CASES[name]
    for package in packages:
        pytest.importorskip(package)
    data, meta = fixture
    theirs = data[f"{name}.llama_cpp"]
    bound = meta["cases"][name]["max_abs_diff"] + ORDER_SLACK
    np.testing.assert_allclose(logits_of(build()), theirs, rtol=0, atol=bound)


def test_the_fixture_would_catch_a_broken_forward(fixture):
    # A forward that is off by a little more than the bound must fail the comparison above.
    data, meta = fixture
    theirs = data["gpt2_q4_0_act8.llama_cpp"]
    bound = meta["cases"]["gpt2_q4_0_act8"]["max_abs_diff"] + ORDER_SLACK
    assert bound < 1e-3
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(theirs + 2 * bound, theirs, rtol=0, atol=bound)
