"""The documentation's house rules, checked without building it.

CI builds ``docs/`` with warnings as errors and runs every example in it with Sphinx's doctest
builder (``.ci/run``); these checks keep what that cannot see: the README stays short and links
every page, every Python example is one the doctest builder runs, the API reference lists every
public name, the pages read as what is true now, and every ``--flag`` they show exists.
"""

import argparse
import re
from pathlib import Path

import pytest

import mixle

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.rst"
# Words that tell the project's history instead of what is true now.
HISTORY = re.compile(r"no longer|since then|\(issue|\bissue \d|this session|the issue's|before this change", re.I)
# Flags of other programs that the pages quote.
OTHER_FLAGS = {
    "--no-deps", "--force-reinstall", "--no-cache-dir",  # pip
    "--nproc-per-node", "--nnodes", "--rdzv-backend", "--rdzv-endpoint",  # torchrun
    "--keep-going",  # sphinx
    "--pure", "--process-output", "--output-format",  # llama-quantize, llama-imatrix
    "--token-embedding-type", "--output-tensor-type",  # llama-quantize
    "--outtype", "--outfile",  # convert_hf_to_gguf.py
    "--xla_force_host_platform_device_count",  # XLA_FLAGS
}


def pages():
    return sorted(DOCS.rglob("*.rst"))


def test_readme_is_short_and_links_every_page():
    text = README.read_text()
    assert len(text.splitlines()) < 200
    links = set(re.findall(r"<(docs/[^>]+\.rst)>`_", text))
    assert links, "the README links the documentation pages"
    missing = sorted(link for link in links if not (ROOT / link).is_file())
    assert not missing, f"README links pages that do not exist: {missing}"
    pages_linked = {str(p.relative_to(ROOT)) for p in pages() if p.parent.name in ("guides", "results")
                    and p.name != "index.rst"}
    assert pages_linked <= links, f"README does not link: {sorted(pages_linked - links)}"


def test_every_python_example_runs_under_the_doctest_builder():
    for page in pages():
        text = page.read_text()
        assert ".. code-block:: python" not in text, f"{page}: use .. testcode:: so CI runs it"
        assert not re.search(r"^\s*>>> ", text, re.M), f"{page}: use .. testcode:: (a bare >>> block is not run)"
    assert "doctest_test_doctest_blocks" in (DOCS / "conf.py").read_text()


def test_the_api_reference_lists_every_public_name():
    text = (DOCS / "api" / "index.rst").read_text()
    documented = set(re.findall(r"^\.\. (?:autofunction|autoclass|data):: (\w+)", text, re.M))
    public = set(mixle.__all__) - {"__version__"}
    assert not public - documented, f"not in docs/api/index.rst: {sorted(public - documented)}"
    assert not documented - public, f"docs/api/index.rst documents names mixle does not offer: {sorted(documented - public)}"


@pytest.mark.parametrize("path", [README, *pages()], ids=lambda p: str(Path(p).relative_to(ROOT)))
def test_pages_say_what_is_true_now(path):
    hits = [line.strip() for line in path.read_text().splitlines() if HISTORY.search(line)]
    assert not hits, f"{path.name} tells history instead of what is true now: {hits}"


def _known_flags():
    from mixle.lm.cli import build_parser

    flags = set(OTHER_FLAGS)
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for parser in action.choices.values():
                flags |= {option for a in parser._actions for option in a.option_strings}
    for script in [*(ROOT / "benchmarks").glob("*.py"), ROOT / ".ci" / "latest"]:
        flags |= set(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", script.read_text()))
        flags |= set(re.findall(r"""== ["'](--[a-z][a-z0-9-]*)""", script.read_text()))
    for script in (ROOT / "benchmarks").glob("*.sh"):  # a bash script's flags are its case labels
        flags |= set(re.findall(r"^(--[a-z][a-z0-9-]*)\)", script.read_text(), re.M))
    return flags


def test_every_flag_shown_exists():
    known = _known_flags()
    for path in [README, *pages()]:
        shown = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*[a-z0-9])", path.read_text()))
        unknown = sorted(shown - known)
        assert not unknown, f"{path.name} shows flags that no command here has: {unknown}"
