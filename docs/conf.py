"""Sphinx configuration of mixle's documentation: guides, the API reference, the results.

Build the pages and run every example (CI runs both, warnings as errors)::

    python -m sphinx -W --keep-going -b html docs /tmp/mixle-docs
    python -m sphinx -W --keep-going -b doctest docs /tmp/mixle-docs-doctest
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import mixle  # noqa: E402

project = "mixle"
author = "the mixle authors"
copyright = "the mixle authors"
release = version = mixle.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "matplotlib.sphinxext.plot_directive",
]
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_theme_options = {"description": "Quantization-aware training that survives the file", "fixed_sidebar": True}

autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the signatures are shown as written; the docstrings describe the types
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# The ``>>>`` examples in the docstrings run under pytest (--doctest-modules); the doctest builder
# runs the pages' own ``testcode`` / ``doctest`` blocks.
doctest_test_doctest_blocks = ""
# Every example group runs in a fresh temporary directory, so the files it writes go nowhere else.
doctest_global_setup = """
import os as _os, shutil as _shutil, tempfile as _tempfile
_docs_home = _os.getcwd()
_docs_tmp = _tempfile.mkdtemp(prefix="mixle-docs-")
_os.chdir(_docs_tmp)
"""
doctest_global_cleanup = """
_os.chdir(_docs_home)
_shutil.rmtree(_docs_tmp, ignore_errors=True)
"""

# Plots drawn from the measured tables on the results pages.
plot_include_source = False
plot_html_show_source_link = False
plot_html_show_formats = False
plot_formats = [("png", 100)]
plot_rcparams = {"figure.figsize": (6.4, 3.4), "font.size": 9}
