"""The walkthrough notebook runs end to end (on the tiny size) so it cannot rot."""

import base64
import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "qat_walkthrough.ipynb"


def test_walkthrough_notebook_executes_and_shows_the_plot(monkeypatch):
    monkeypatch.setenv("MIXLE_NOTEBOOK_SIZE", "tiny")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.get("output_type") == "error"]
    text = "".join(out.get("text", "") for out in outputs)
    assert "tiny" in text and "QAT weights in fp32" in text and "bytes on disk" in text
    assert "fine-tune + PTQ" in text  # the comparison table
    images = [out["data"]["image/png"] for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) == 1
    assert base64.b64decode(images[0])[:8] == b"\x89PNG\r\n\x1a\n"
