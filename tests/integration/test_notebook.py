"""notebooks/inspect_run.ipynb runs top to bottom on a fresh run (a copy of conftest's): curves plotted and saved,
text generated."""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "inspect_run.ipynb"


def test_inspect_run_notebook_executes(tiny_run, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run.dir, run_dir)  # the notebook writes curves.png into it
    monkeypatch.setenv("PARALLAMA_RUN_DIR", str(run_dir))  # the kernel inherits the environment
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # kernel connection files, IPython profile
    monkeypatch.setenv("MPLBACKEND", "agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), "clear the outputs"
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    assert (run_dir / "curves.png").stat().st_size > 0
    text = "".join(out.get("text", "") for out in nb.cells[-1].outputs)
    assert text.strip()
