"""The README's Python examples run as written.

Each block runs in a fresh namespace in a temporary working directory, so a README example that
stops working (a renamed function, a changed default, an assertion that no longer holds) fails CI.
The examples in ``docs/`` run under Sphinx's doctest builder (``.ci/run``).
"""

import pathlib
import re
import textwrap

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.rst"
BLOCK = re.compile(r"^\.\. code-block:: python\n\n((?:    .*\n|\n)+)", re.M)

# (a line that identifies the block, the packages it needs)
CASES = (
    ("optimizer = torch.optim.AdamW(model.parameters())", ("torch",)),
    ("mixle.save_gguf(lm", ("torch", "gguf")),
    ("torch_mlp = torch.nn.Sequential", ("torch", "flax", "qwix")),
)


def blocks():
    return [textwrap.dedent(body) for body in BLOCK.findall(README.read_text())]


def test_every_python_block_has_a_case():
    keys = [key for key, _ in CASES]
    assert len(blocks()) == len(CASES)
    for code in blocks():
        owners = [key for key in keys if key in code]
        assert len(owners) == 1, f"README block without exactly one case here:\n{code[:300]}"


@pytest.mark.parametrize("key, packages", CASES, ids=[c[0][:40] for c in CASES])
def test_readme_block_runs(key, packages, tmp_path, monkeypatch):
    for package in packages:
        pytest.importorskip(package)
    (code,) = [code for code in blocks() if key in code]
    monkeypatch.chdir(tmp_path)  # the examples write their files into the working directory
    exec(compile(code, f"README block {key!r}", "exec"), {"__name__": "readme"})
