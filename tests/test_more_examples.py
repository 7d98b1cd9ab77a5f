"""The deep-ensemble and learning-rate-sweep examples and the quickstart notebook run.

The scripts run in quick mode, in process (``main(argv)``), and their key claims are
checked: the ensemble's std widens away from the data; the best learning rate is
finite and one of the swept ones. The notebook is committed with its outputs (the docs
render them): they must be clean and complete, and the same as those of a fresh run by
a Jupyter kernel running this interpreter (tests/notebook_outputs.py; ``make notebook``
stores a fresh run).
"""

import copy
import json
import math
import re
import sys
from pathlib import Path
from types import ModuleType

import notebook_outputs
import pytest
import torch
from helpers import load_example

import funcensemble as fe

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
NOTEBOOK = EXAMPLES / "quickstart.ipynb"


def load(name: str) -> ModuleType:
    return load_example(name)


@pytest.mark.slow  # a whole (quick) run of the example: make test only
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


@pytest.mark.slow  # a whole (quick) run of the example: make test only
def test_deep_ensemble_nll_quick_splits_the_predictive_variance(tmp_path, capsys):
    example = load("deep_ensemble_regression")
    result = example.main(["--quick", "--nll", "--out", str(tmp_path)])
    mix = result.mixture
    assert result.preds.shape == (5, result.grid.shape[0], 1)  # the means, not the variances
    assert mix.var.shape == mix.aleatoric.shape == mix.epistemic.shape == result.grid.shape
    torch.testing.assert_close(mix.mean, result.mean)
    torch.testing.assert_close(mix.var, mix.aleatoric + mix.epistemic)
    # The epistemic part is the members' disagreement (over N, where std divides by N - 1).
    torch.testing.assert_close(mix.epistemic, result.preds.var(dim=0, correction=0))
    assert bool((mix.aleatoric > 0).all())
    assert result.std_outside >= example.MIN_RATIO * result.std_inside > 0
    assert bool(torch.isfinite(result.final_losses).all())
    out = capsys.readouterr().out
    assert "training NLL per member" in out and "predicted noise std (aleatoric)" in out
    assert (tmp_path / "deep_ensemble.png").read_bytes().startswith(b"\x89PNG")


def test_deep_ensemble_fails_when_the_claim_fails(monkeypatch):
    example = load("deep_ensemble_regression")
    monkeypatch.setattr(example, "MIN_RATIO", 1e9)
    with pytest.raises(AssertionError, match="std outside the training range is only"):
        example.main(["--members", "2", "--steps", "2", "--samples", "8", "--no-plot"])


def test_deep_ensemble_rejects_one_member():
    with pytest.raises(SystemExit):
        load("deep_ensemble_regression").main(["--members", "1", "--no-plot"])


@pytest.mark.slow  # a whole (quick) run of the example: make test only
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


@pytest.mark.slow  # a whole (quick) run of the example: make test only
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


@pytest.mark.parametrize(("dtype", "bound"), [(torch.float64, 1e-15), (torch.float32, 5e-8)])
def test_digits_stacked_gradients_are_each_members_own(dtype, bound):
    """real-data.md: each member gets the gradient it would get alone, the stacked
    products rounding the last bit differently (about 1e-16 in float64, 1e-8 in
    float32)."""
    pytest.importorskip("sklearn")
    example = load("digits_ensemble")
    data = example.load_data(9, 0.3, seed=0)
    members = 8
    ens = fe.Ensemble.from_factory(lambda: example.make_member(128), members, seed=0).to(dtype)
    loop = [copy.deepcopy(ens.member(i)) for i in range(members)]
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(len(data.x), generator=g)[:64] for _ in range(members)])
    x, y = data.x[idx].to(dtype), data.y[idx]
    logits = ens(x, in_dims=0)
    loss = sum(torch.nn.functional.cross_entropy(logits[i], y[i]) for i in range(members))
    loss.backward()
    worst = 0.0
    for i, member in enumerate(loop):
        torch.nn.functional.cross_entropy(member(x[i]), y[i]).backward()
        for name, p in member.named_parameters():
            got = ens.stacked_params()[name].grad[i]
            worst = max(worst, (got - p.grad).abs().max().item())
    assert worst < bound


def test_digits_fails_when_the_members_are_copies(monkeypatch):
    pytest.importorskip("sklearn")
    example = load("digits_ensemble")
    train = example.train

    def copies(data, **kwargs):
        trained = train(data, **{**kwargs, "members": 1})
        return fe.Ensemble([trained.member(0) for _ in range(kwargs["members"])])

    monkeypatch.setattr(example, "train", copies)
    with pytest.raises(AssertionError, match=r"members predict alike \(are they copies\?\)"):
        example.main(["--members", "2", "--epochs", "1", "--no-plot", "--quiet"])


def test_notebook_is_stored_with_its_outputs():
    pytest.importorskip("nbformat")
    nb = notebook_outputs.read(NOTEBOOK)
    assert nb.metadata.kernelspec.name == "python3"
    assert "widgets" not in json.loads(NOTEBOOK.read_text())["metadata"]
    problems = notebook_outputs.stored_output_problems(nb)
    assert not problems, "\n".join(problems) + "\nRe-run and store it: make notebook"


def test_stored_output_checks_catch_stale_and_dirty_outputs():
    nbformat = pytest.importorskip("nbformat")
    stored = notebook_outputs.read(NOTEBOOK)

    def problems_after(change) -> str:
        nb = copy.deepcopy(stored)
        change([cell for cell in nb.cells if cell.cell_type == "code"])
        return "\n".join(notebook_outputs.stored_output_problems(nb))

    def strip(cells):
        for cell in cells:
            cell.outputs, cell.execution_count = [], None

    assert "execution counts are [None" in problems_after(strip)
    assert "no image output" in problems_after(strip)
    assert "code cell 1 has no stored outputs" in problems_after(strip)
    swap = lambda cells: setattr(cells[2], "execution_count", 9)  # noqa: E731
    assert "expected 1 to" in problems_after(swap)
    stderr = nbformat.v4.new_output("stream", name="stderr", text="UserWarning: ...")
    assert "stores stderr" in problems_after(lambda cells: cells[1].outputs.append(stderr))
    path = nbformat.v4.new_output("stream", name="stdout", text="/home/me/.venv/lib\n")
    assert "machine-specific '/home/'" in problems_after(
        lambda cells: cells[1].outputs.append(path)
    )
    timing = lambda cells: cells[1].metadata.update(execution={"shell.execute_reply": 1})  # noqa: E731
    assert "timing metadata" in problems_after(timing)

    # A fresh run that prints another number, or another kind of output, is a difference.
    changed = copy.deepcopy(stored)
    printed = next(c for c in changed.cells if c.cell_type == "code" and "MSE" in c.source)
    printed.outputs[0].text = printed.outputs[0].text.replace("first step", "first step 1 +")
    assert notebook_outputs.output_differences(stored, changed)
    changed = copy.deepcopy(stored)
    number = next(c for c in changed.cells if c.cell_type == "code" and "MSE" in c.source)
    number.outputs[0].text = re.sub(r"\d\.\d+\n", "9.9\n", number.outputs[0].text)
    assert "fresh" in "".join(notebook_outputs.output_differences(stored, changed))
    assert notebook_outputs.output_differences(stored, copy.deepcopy(stored)) == []


def test_docs_render_the_stored_notebook():
    yaml = pytest.importorskip("yaml")
    page = ROOT / "docs" / "quickstart.ipynb"
    assert page.resolve() == NOTEBOOK, "docs/quickstart.ipynb should link examples/quickstart.ipynb"
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert {"Quickstart notebook": "quickstart.ipynb"} in config["nav"]
    plugins = {}
    for entry in config["plugins"]:
        plugins.update(entry if isinstance(entry, dict) else {entry: {}})
    # The docs show the stored outputs; the docs build does not run the notebook.
    assert plugins["mkdocs-jupyter"]["execute"] is False
    assert "*.ipynb" in plugins["mkdocs-jupyter"]["include"]

    # What the page shows: the plot and the printed results, as stored.
    nbconvert2 = pytest.importorskip("mkdocs_jupyter.nbconvert2")
    html = nbconvert2.nb2html(str(page), execute=False)
    assert len(re.findall(r'<img [^>]*src="data:image/png;base64,', html)) == 1
    assert "per-member MSE: first step 0." in html and "mean std inside [-1, 1]: 0." in html


@pytest.mark.slow
def test_notebook_runs_top_to_bottom_as_stored():
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    nb = notebook_outputs.read(NOTEBOOK)
    # Prove the kernel is this interpreter (the venv), not some `python` on PATH:
    # jupyter_client swaps the kernelspec's bare "python" for sys.executable.
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    notebook_outputs.execute(nb)
    assert nb.cells.pop().outputs[0].text.strip() == sys.executable

    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) == 1, "the plot cell should display one figure"
    printed = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    assert "per-member MSE" in printed and "mean std inside" in printed
    assert notebook_outputs.stored_output_problems(nb) == []
    # What the docs show is what the notebook's code prints today.
    differences = notebook_outputs.output_differences(notebook_outputs.read(NOTEBOOK), nb)
    assert not differences, "\n".join(differences) + "\nRe-run and store it: make notebook"


@pytest.mark.slow  # a whole (quick) run of the example: make test only
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
