"""CI executes the tour notebook on CPU so it cannot rot."""

import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NB = os.path.join(os.path.dirname(__file__), "..", "notebooks", "01_tour.ipynb")


def test_tour_notebook_runs(tmp_path, monkeypatch):
    nb = nbformat.read(NB, as_version=4)
    # the kernel inherits both; monkeypatch restores them (PYTHONPATH used to leak into every later test)
    monkeypatch.setenv("K3JAX_CACHE", str(tmp_path / "cache"))  # builds the demo model from scratch, as a new user
    root = os.path.abspath(os.path.join(os.path.dirname(NB), ".."))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": os.path.dirname(NB)}}
    ).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
