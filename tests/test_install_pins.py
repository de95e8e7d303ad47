"""The install CI runs is the README's, and it pins every package it installs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pins():
    lines = (ROOT / ".ci" / "constraints.txt").read_text().splitlines()
    return {line.split("==")[0].lower().replace("_", "-"): line.split("==")[1]
            for line in lines if line and not line.startswith("#")}


def test_ci_runs_the_readme_commands_with_the_constraints():
    readme = (ROOT / "README.rst").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    install = re.search(r"^\s+(pip install -c \.ci/constraints\.txt -e \"\.\[all\]\")", readme, re.M)
    assert install, "README's quick start must install with .ci/constraints.txt"
    assert install.group(1) in ci.splitlines()
    assert "python -m pytest" in ci.splitlines()


def test_every_requirement_of_setup_cfg_is_pinned():
    text = (ROOT / "setup.cfg").read_text()
    block = re.search(r"install_requires =\n((?:    .+\n)+)", text).group(1)
    extras = re.findall(r"^    ([A-Za-z0-9_.\-]+)\s*[=<>!]", text, re.M)
    names = set(re.findall(r"^    ([A-Za-z0-9_.\-]+)", block, re.M)) | set(extras)
    pins = _pins()
    missing = sorted(n for n in names if n.lower().replace("_", "-") not in pins and n not in {"llama-cpp-python", "mixle"})
    assert not missing, f"not pinned in .ci/constraints.txt: {missing}"
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.]*", v) for v in pins.values()), "pins are exact versions"
