"""The example notebooks (``examples/notebooks``), as they would be published: each one runs top to bottom on CPU
in a fresh kernel, downloads nothing and leaves nothing behind, and the copy in the repository stores the outputs of
such a run, small enough to read on the Hub."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import nbformat
import pytest
from _machine import scaled
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).parents[2] / "examples" / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
MAX_BYTES = 150_000
"""A stored notebook's size, outputs (figures included) and all."""


def _leftovers() -> set[str]:
    """What a run could leave behind: files beside the notebooks, its scratch directories, shared-memory segments."""
    shm = {f"/dev/shm/{name}" for name in os.listdir("/dev/shm") if name.startswith("hf_odc_")}
    scratch = {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("hf_odc_")}
    return {str(path) for path in NOTEBOOK_DIR.rglob("*")} | shm | scratch


def test_the_three_notebooks_exist():
    assert [path.stem for path in NOTEBOOKS] == ["01_plan_your_workload", "02_sft_with_odc", "03_grpo_with_odc"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_the_stored_notebook_is_publishable(path):
    """A title, what it shows and what to change for a real workload, every code cell run (in order, no error)."""
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    intro = notebook.cells[0]
    assert intro.cell_type == "markdown" and intro.source.startswith("# ")
    assert "This notebook" in intro.source and "**For " in intro.source and "downloads nothing" in intro.source
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), "store a top-to-bottom run"
    assert not [output for cell in code for output in cell.outputs if output.output_type == "error"]
    assert any("image/png" in output.get("data", {}) for cell in code for output in cell.outputs)
    assert path.stat().st_size < MAX_BYTES


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_the_notebook_runs_top_to_bottom_on_cpu(path, monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")  # the kernel inherits them: any download attempt fails the run
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    before = _leftovers()
    notebook = nbformat.read(path, as_version=4)
    where = {"metadata": {"path": NOTEBOOK_DIR}}
    timeout = round(scaled(240, 2))  # a cell's; the launches run 2 processes
    client = NotebookClient(notebook, timeout=timeout, kernel_name="python3", record_timing=False, resources=where)
    client.execute()  # raises CellExecutionError, naming the cell, on the first error
    assert _leftovers() == before
