"""Every notebook in notebooks/ executes (small on the CPU, full size on a GPU) and reports
correct results. Notebooks are discovered, not listed: a new one must follow the same contract
(a ``parameters`` cell taking ``device``, ``size`` and ``results_json``, and a results file whose
``checks`` include gradient equality and the resident-bytes check) or this suite fails."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest

import background

from offload_examples.instruments.notebooks import as_committed, cells_missing_figures, execute_notebook, has_outputs

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
REQUIRED_CHECKS = {"grads_equal", "resident_matches_theory"}


def _env() -> None:
    # the kernel imports the package from the repository, installed or not
    root = str(Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))


def run(nb: Path, tmp_path: Path, **params) -> dict:
    _env()
    results = tmp_path / "results.json"
    execute_notebook(nb, {**params, "results_json": str(results)}, tmp_path / nb.name, timeout=900)
    return json.loads(results.read_text())


def test_there_are_notebooks():
    assert [nb.name for nb in NOTEBOOKS][:2] == ["01_concepts.ipynb", "02_basic.ipynb"]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_small_on_cpu(nb):
    results = background.small_run(nb)  # started when the run was collected (tests/background.py)
    assert REQUIRED_CHECKS <= results["checks"].keys()
    assert all(results["checks"].values()), results["checks"]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_has_gpu_outputs(nb):
    assert has_outputs(nb), f"{nb.name} was committed without executed outputs (run `make notebooks` on a GPU)"
    meta = nbformat.read(nb, as_version=4).metadata.get("offload_examples", {})
    assert "NVIDIA" in meta.get("device", ""), f"{nb.name}'s stored outputs do not come from a GPU run"
    first = nbformat.read(nb, as_version=4).cells
    assert not any("injected-parameters" in c.metadata.get("tags", []) for c in first), "stray injected cell"
    assert not cells_missing_figures(nb), f"{nb.name}: figures missing from cells {cells_missing_figures(nb)}"


def test_executed_notebooks_keep_their_figures(tmp_path, monkeypatch):
    """Even with MPLBACKEND=Agg outside (as on a headless node), the kernel draws inline."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("device = 'cpu'", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\nplt.plot([0, 1])\nplt.show()"),
    ])
    path = tmp_path / "figure.ipynb"
    nbformat.write(nb, path)
    _env()
    execute_notebook(path)
    assert not cells_missing_figures(path)


@pytest.mark.gpu
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_full_size_on_gpu(nb, tmp_path):
    """Each notebook at full size with its own defaults (device "auto" is the GPU). With
    ``OFFLOAD_EXAMPLES_KEEP_NOTEBOOKS=DIR`` an execution that passed is kept there, ready to commit."""
    results = run(nb, tmp_path, size="full")
    assert all(results["checks"].values()), results["checks"]
    if results.get("saving_ratio") is not None:
        assert results["saving_ratio"] >= 0.95
    if os.environ.get("OFFLOAD_EXAMPLES_KEEP_NOTEBOOKS"):
        as_committed(tmp_path / nb.name, Path(os.environ["OFFLOAD_EXAMPLES_KEEP_NOTEBOOKS"]) / nb.name)
