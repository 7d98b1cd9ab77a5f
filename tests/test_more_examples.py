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

import funcensemble as fe

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
NOTEBOOK = EXAMPLES / "quickstart.ipynb"


def load(name: str) -> ModuleType:
    return load_example(name)


def test_deep_ensemble_quick_widens_away_from_the_data(tmp_path, capsys):
    example = load("deep_ensemble_regression")
    plot = tmp_path / "deep_ensemble.png"
    result = example.main(["--quick", "--out", str(tmp_path)])
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
    plot = tmp_path / "lr_sweep.png"
    result = example.main(["--quick", "--out", str(tmp_path)])
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


def test_digits_quick_ensemble_beats_one_model(tmp_path, capsys):
    pytest.importorskip("sklearn")
    example = load("digits_ensemble")
    result = example.main(["--quick", "--out", str(tmp_path)])
    members, ens = result.members, result.ensemble
    assert len(members) == example.QUICK["members"]
    assert ens.accuracy >= example.MIN_ACCURACY
    # Averaging probabilities never raises the NLL above the members' mean (Jensen); it
    # falls strictly only if the members differ, as they must.
    assert ens.nll < result.mean("nll")
    assert ens.auroc_noise > result.mean("auroc_noise")
    # Noise is far from any digit: every score tells it apart well.
    assert min(ens.auroc_noise, ens.mi_auroc_noise) > 0.85
    assert ens.auroc_digit > 0.8  # the held-out digit 9 is harder, but far above chance
    assert all(m.mutual_information is None for m in members)
    assert (tmp_path / "digits_ensemble.png").read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out
    assert "ensemble of 4" in out and "its NLL is below its members' mean" in out


def test_digits_data_hold_out_one_digit():
    pytest.importorskip("sklearn")
    data = load("digits_ensemble").load_data(3, 0.3, seed=0)
    assert 3 not in data.y.tolist() and 3 not in data.y_test.tolist()
    assert set(data.y.unique().tolist()) == set(range(10)) - {3}
    assert data.x.shape[1] == data.x_digit.shape[1] == data.x_noise.shape[1] == 64
    assert len(data.x) + len(data.x_test) + len(data.x_digit) == 1797
    assert data.x.min() >= 0 and data.x.max() == 1  # pixels scaled from 0..16


def test_digits_calibration_error_by_hand():
    example = load("digits_ensemble")
    # Confidences 0.9 (right), 0.9 (wrong), 0.6 (right), 0.55 (wrong) in 2 bins:
    # (0.5, 1.0] holds all four: accuracy 2/4, mean confidence 0.7375.
    probs = torch.tensor([[0.9, 0.1], [0.9, 0.1], [0.4, 0.6], [0.55, 0.45]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 1])
    cal = example.calibration(probs.log(), labels, bins=2)
    assert cal.counts.tolist() == [0, 4]
    assert math.isclose(cal.ece, abs(0.5 - 0.7375), rel_tol=1e-12)
    cal = example.calibration(probs.log(), labels, bins=10)
    # Bins (0.5, 0.6], (0.8, 0.9]: |1/2 - 0.575| * 2/4 + |1/2 - 0.9| * 2/4.
    assert math.isclose(cal.ece, 0.5 * 0.075 + 0.5 * 0.4, rel_tol=1e-9)
    assert math.isclose(
        example.nll(probs.log(), labels),
        -sum(map(math.log, [0.9, 0.1, 0.6, 0.45])) / 4,
        rel_tol=1e-6,
    )


def test_digits_fails_when_the_members_are_copies(monkeypatch):
    pytest.importorskip("sklearn")
    example = load("digits_ensemble")
    train = example.train

    def copies(data, **kwargs):
        trained = train(data, **{**kwargs, "members": 1})
        return fe.Ensemble([trained.member(0)] * kwargs["members"])

    monkeypatch.setattr(example, "train", copies)
    with pytest.raises(AssertionError, match=r"members predict alike \(are they copies\?\)"):
        example.main(["--members", "2", "--epochs", "1", "--no-plot", "--quiet"])


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


def test_pbt_digits_quick_beats_fixed_learning_rates(tmp_path, capsys):
    pytest.importorskip("sklearn")
    example = load("pbt_digits")
    result = example.main(["--quick", "--out", str(tmp_path)])
    quick = example.QUICK
    pbt, fixed = result.pbt, result.fixed
    assert len(pbt.ens) == len(fixed.ens) == quick["members"]
    assert len(pbt.val) == len(pbt.lrs) == quick["rounds"]
    assert pbt.copies == quick["rounds"] * quick["members"] // 4 and fixed.copies == 0
    # The same initial population: fixed keeps its lrs, PBT moved away from the extremes.
    assert torch.equal(fixed.lr, pbt.lrs[0]) and all(torch.equal(fixed.lr, x) for x in fixed.lrs)
    assert pbt.lr.min() > fixed.lr.min() and pbt.lr.max() < fixed.lr.max()
    assert pbt.val[-1].mean() > fixed.val[-1].mean()
    assert result.pbt_test.mean() > result.fixed_test.mean()
    assert (tmp_path / "pbt_digits.png").read_bytes().startswith(b"\x89PNG")
    assert "PBT's mean validation accuracy beats fixed learning rates" in capsys.readouterr().out


def test_pbt_digits_fails_without_exploit_and_explore(monkeypatch):
    pytest.importorskip("sklearn")
    example = load("pbt_digits")
    train = example.train
    monkeypatch.setattr(example, "train", lambda *a, pbt, **kw: train(*a, pbt=False, **kw))
    with pytest.raises(AssertionError, match="PBT's mean validation accuracy is not above"):
        example.main(["--members", "4", "--rounds", "2", "--interval", "2", "--no-plot", "--quiet"])
