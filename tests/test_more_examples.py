"""The deep-ensemble and learning-rate-sweep examples and the quickstart notebook run.

The scripts run in quick mode, in process (``main(argv)``), and their key claims are
checked: the ensemble's std widens away from the data; the best learning rate is
finite and one of the swept ones. The notebook is executed top to bottom by a Jupyter
kernel running this interpreter, and must be committed without outputs.
"""

import json
import math
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from helpers import load_example

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
NOTEBOOK = EXAMPLES / "quickstart.ipynb"


def load(name: str) -> ModuleType:
    return load_example(name)


def test_deep_ensemble_quick_widens_away_from_the_data(tmp_path, capsys):
    example = load("deep_ensemble_regression")
    plot = tmp_path / "deep.png"
    result = example.main(["--quick", "--plot", str(plot)])
    assert result.preds.shape == (5, result.grid.shape[0], 1)
    assert result.std.shape == result.mean.shape == result.grid.shape
    assert torch.allclose(result.mean, result.preds.mean(dim=0))
    assert result.std_outside >= example.MIN_RATIO * result.std_inside > 0
    # The claim holds at the far ends, not just on average.
    assert result.std[0] > 5 * result.std_inside and result.std[-1] > 5 * result.std_inside
    assert bool(torch.isfinite(result.final_losses).all())
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert "widens away from the data" in capsys.readouterr().out


def test_deep_ensemble_fails_when_the_claim_fails(monkeypatch):
    example = load("deep_ensemble_regression")
    monkeypatch.setattr(example, "MIN_RATIO", 1e9)
    with pytest.raises(AssertionError, match="std outside the training range is only"):
        example.main(["--members", "2", "--steps", "2", "--samples", "8", "--no-plot"])


def test_deep_ensemble_rejects_one_member():
    with pytest.raises(SystemExit):
        load("deep_ensemble_regression").main(["--members", "1", "--no-plot"])


def test_lr_sweep_quick_finds_a_finite_best_lr(tmp_path, capsys):
    example = load("lr_sweep")
    plot = tmp_path / "sweep.png"
    result = example.main(["--quick", "--plot", str(plot)])
    lrs = torch.logspace(-4, -1, 6)
    assert torch.equal(result.lrs, lrs)
    assert math.isfinite(result.best_lr) and result.best_lr in lrs.tolist()
    assert result.curves.shape == (61, 6)  # 60 steps plus the final loss
    assert result.val_losses[result.best] == result.val_losses.min()
    # The sweep learned something: every member's loss fell, the best one's a lot.
    assert bool((result.curves[-1] < result.curves[0]).all())
    assert result.curves[-1, result.best] < 0.1 * result.curves[0, result.best]
    assert math.isclose(result.curves[-1, result.best], result.reference_loss, rel_tol=1e-3)
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert f"best lr: {result.best_lr:.3g}" in capsys.readouterr().out


def test_lr_sweep_fails_when_the_best_member_differs_from_torch_optim(monkeypatch):
    example = load("lr_sweep")
    sweep = example.sweep

    def off(*args, **kwargs):
        result = sweep(*args, **kwargs)
        result.reference_loss *= 1.1
        return result

    monkeypatch.setattr(example, "sweep", off)
    with pytest.raises(AssertionError, match=r"differs from a plain torch\.optim\.Adam run"):
        example.main(["--members", "2", "--steps", "3", "--samples", "16", "--no-plot"])


def test_notebook_is_committed_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, "the notebook has no code cells"
    for k, cell in enumerate(code):
        assert cell.outputs == [], f"code cell {k} has stored outputs; strip them"
        assert cell.execution_count is None, f"code cell {k} has an execution count"
    assert nb.metadata.kernelspec.name == "python3"
    raw = json.loads(NOTEBOOK.read_text())
    assert "widgets" not in raw["metadata"]


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Prove the kernel is this interpreter (the venv), not some `python` on PATH:
    # jupyter_client swaps the kernelspec's bare "python" for sys.executable.
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=120,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()

    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    assert outputs[-1].text.strip() == sys.executable
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) == 1, "the plot cell should display one figure"
    printed = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    assert "per-member MSE" in printed and "mean std inside" in printed
