"""fe.reduce.gaussian_mixture: the hand formula, and the law of total variance on samples."""

import math
from pathlib import Path

import pytest
import torch
from helpers import runtime_typecheck_off

import funcensemble as fe


@pytest.mark.parametrize("shape", [(5,), (5, 7), (3, 4, 2)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_the_hand_formula(shape, dtype):
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(shape, generator=g, dtype=torch.float64)
    var = torch.rand(shape, generator=g, dtype=torch.float64)
    mix = fe.reduce.gaussian_mixture(mean.to(dtype), var.to(dtype))
    n = shape[0]
    center = sum(mean[i] for i in range(n)) / n
    aleatoric = sum(var[i] for i in range(n)) / n
    epistemic = sum((mean[i] - center) ** 2 for i in range(n)) / n
    second_moment = sum(var[i] + mean[i] ** 2 for i in range(n)) / n  # E[y^2]
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    for got, want in [
        (mix.mean, center),
        (mix.aleatoric, aleatoric),
        (mix.epistemic, epistemic),
        (mix.var, aleatoric + epistemic),
        (mix.var, second_moment - center**2),  # Var[y] = E[y^2] - E[y]^2
    ]:
        assert got.dtype == dtype and got.shape == shape[1:]
        torch.testing.assert_close(got, want.to(dtype), **tol)
    assert isinstance(mix, fe.reduce.GaussianMixture)
    assert mix._fields == ("mean", "var", "aleatoric", "epistemic")


def test_law_of_total_variance_on_a_sampled_mixture():
    g = torch.Generator().manual_seed(1)
    mean = torch.tensor([[-1.0, 0.0], [0.5, 0.0], [2.0, 0.0]], dtype=torch.float64)
    var = torch.tensor([[0.2, 1.0], [1.0, 1.0], [0.5, 1.0]], dtype=torch.float64)
    mix = fe.reduce.gaussian_mixture(mean, var)
    draws = 400_000
    member = torch.randint(3, (draws,), generator=g)  # pick a member, then draw from it
    noise = torch.randn(draws, 2, generator=g, dtype=torch.float64)
    y = mean[member] + var[member].sqrt() * noise
    # Standard errors: of the mean, sqrt(var / n); of the variance, about
    # sqrt((m4 - var^2) / n) with m4 the fourth central moment. 5 of them each.
    se_mean = (mix.var / draws).sqrt()
    centered = y - y.mean(0)
    se_var = ((centered**4).mean(0) - mix.var**2).sqrt() / math.sqrt(draws)
    assert ((y.mean(0) - mix.mean).abs() < 5 * se_mean).all()
    assert ((y.var(0) - mix.var).abs() < 5 * se_var).all()
    # The second column: all members agree, so nothing is epistemic.
    assert mix.epistemic[1].item() == 0.0 and mix.var[1].item() == 1.0


def test_one_member_has_no_epistemic_part():
    mix = fe.reduce.gaussian_mixture(torch.tensor([[3.0, 4.0]]), torch.tensor([[0.5, 2.0]]))
    assert mix.mean.tolist() == [3.0, 4.0]
    assert mix.epistemic.tolist() == [0.0, 0.0] and mix.var.tolist() == [0.5, 2.0]


def test_gradients_flow_to_means_and_variances():
    mean = torch.tensor([[0.0], [2.0]], dtype=torch.float64, requires_grad=True)
    var = torch.tensor([[1.0], [3.0]], dtype=torch.float64, requires_grad=True)
    fe.reduce.gaussian_mixture(mean, var).var.sum().backward()
    # d/dmu_i of mean_j (mu_j - mu)^2 = 2 (mu_i - mu) / N; d/dvar_i = 1 / N.
    assert mean.grad.tolist() == [[-1.0], [1.0]]
    assert var.grad.tolist() == [[0.5], [0.5]]


# One rounding to the dtype: half an ulp, relative (1% more for float64's own error).
ROUNDING = {
    torch.float32: 1.01 * 2.0**-24,
    torch.float16: 1.01 * 2.0**-11,
    torch.bfloat16: 1.01 * 2.0**-8,
}


@pytest.mark.parametrize(
    ("dtype", "offset", "spread"),
    [
        (torch.float32, 1e3, 1e-1),
        (torch.float32, 1e4, 1e-2),
        (torch.float32, 1e4, 1e-3),
        (torch.float16, 100.0, 1.0),
        (torch.bfloat16, 100.0, 1.0),
    ]
    + [(dtype, 0.0, 1.0) for dtype in (torch.float32, torch.float16, torch.bfloat16)],
)
def test_epistemic_keeps_its_precision_when_members_nearly_agree(dtype, offset, spread):
    """The members' spread is rounded once to the dtype, not taken around a mean already
    rounded to it (which gave 100% off at a spread of 1e-3 around 1e4 in float32)."""
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(16, 200, generator=g, dtype=torch.float64) * spread + offset
    mean = raw.to(dtype).requires_grad_(True)
    mix = fe.reduce.gaussian_mixture(mean, torch.ones_like(mean))
    exact = mean.detach().double()  # the variance of the very inputs, in float64
    want = exact.var(dim=0, correction=0)
    assert mix.epistemic.dtype == dtype
    torch.testing.assert_close(mix.epistemic.double(), want, rtol=ROUNDING[dtype], atol=0)
    assert torch.equal(mix.var, mix.aleatoric + mix.epistemic)
    # d/dmu_i of the epistemic part: 2 (mu_i - mu) / N, which also needs the exact mean.
    (grad,) = torch.autograd.grad(mix.epistemic.sum(), mean)
    want_grad = 2 * (exact - exact.mean(dim=0)) / 16
    torch.testing.assert_close(grad.double(), want_grad, rtol=ROUNDING[dtype], atol=0)


def test_float16_squares_do_not_overflow_before_their_mean():
    """One member at 1000, 15 at 0: the squared deviation (1e6) overflows float16, the
    variance (58593.75) does not."""
    mean = torch.zeros(16, 1, dtype=torch.float16)
    mean[0] = 1000
    mix = fe.reduce.gaussian_mixture(mean, torch.zeros_like(mean))
    assert mix.epistemic.item() == torch.tensor(58593.75).half().item() == mix.var.item()


@pytest.mark.parametrize(
    ("mean", "var", "error", "match"),
    [
        (torch.zeros(3, 2), torch.ones(3), ValueError, "the same shape"),
        (
            torch.zeros(3),
            torch.tensor([1.0, -0.5, 1.0]),
            ValueError,
            r"var must be >= 0 everywhere .*got -0.5 at member 1\. Map",
        ),
        (
            torch.zeros(2, 2),
            torch.tensor([[1.0, 1.0], [1.0, -1.0]]),
            ValueError,
            r"member 1, index \(1,\)",
        ),
        (torch.zeros(3, dtype=torch.int64), torch.ones(3), TypeError, "floating-point"),
        (
            [0.0, 1.0],
            torch.ones(2),
            TypeError,
            r"values is not a tensor \(expected a tensor of stacked outputs",
        ),
        (torch.zeros(0, 2), torch.ones(0, 2), ValueError, "member axis"),
        (torch.tensor(1.0), torch.tensor(1.0), ValueError, "dimension"),
    ],
)
def test_refuses_bad_inputs(mean, var, error, match):
    with runtime_typecheck_off(), pytest.raises(error, match=match):
        fe.reduce.gaussian_mixture(mean, var)


def test_runs_under_vmap_without_reading_values():
    mean, var = torch.randn(4, 3, 5), torch.rand(4, 3, 5)
    got = torch.vmap(fe.reduce.gaussian_mixture, in_dims=1)(mean, var)
    want = fe.reduce.gaussian_mixture(mean, var)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_gaussian_nll_loss_cannot_be_mapped_so_the_doc_writes_the_loss_out():
    """docs/how-to/regression-uncertainty.md writes the Gaussian NLL out because
    ``F.gaussian_nll_loss`` checks its variances with Python control flow, which vmap
    refuses; the written-out loss maps and gives the library function's value."""
    torch.manual_seed(0)
    fmodel, params, buffers = fe.stack([torch.nn.Linear(3, 2) for _ in range(3)])
    x, y = torch.randn(5, 3), torch.randn(5)

    def library(p, b, x, y):
        out = fmodel(p, b, x)
        return torch.nn.functional.gaussian_nll_loss(
            out[:, 0], y, torch.nn.functional.softplus(out[:, 1])
        )

    def written_out(p, b, x, y):
        out = fmodel(p, b, x)
        var = torch.nn.functional.softplus(out[:, 1])
        return 0.5 * (var.log() + (out[:, 0] - y) ** 2 / var).mean()

    with pytest.raises(RuntimeError, match="data-dependent control flow") as info:
        fe.value_and_grad(library)(params, buffers, x, y)
    # The message names the page by its title (it once named one that does not exist).
    page = Path(__file__).parents[1] / "docs" / "how-to" / "regression-uncertainty.md"
    title = page.read_text().splitlines()[0].removeprefix("# ")
    assert f"the how-to page '{title}'" in str(info.value)
    losses, _, _ = fe.value_and_grad(written_out)(params, buffers, x, y)
    for i in range(3):
        member = {k: v[i] for k, v in params.items()}
        out = x @ member["weight"].detach().T + member["bias"].detach()
        want = torch.nn.functional.gaussian_nll_loss(
            out[:, 0], y, torch.nn.functional.softplus(out[:, 1])
        )
        torch.testing.assert_close(losses[i], want)


def test_a_nan_variance_gives_nan_as_the_loop_does():
    """regression-uncertainty.md: a NaN variance (a diverged member) is not refused; it
    gives NaN in the mixture's variance, and leaves the mean alone."""
    mean, var = torch.zeros(3, 2), torch.ones(3, 2)
    var[1, 0] = math.nan
    mix = fe.reduce.gaussian_mixture(mean, var)
    assert math.isnan(mix.var[0].item()) and mix.var[1].item() == 1.0
    assert torch.equal(mix.mean, torch.zeros(2))


@pytest.mark.parametrize(
    ("mean_dtype", "var_dtype"),
    [
        (torch.bfloat16, torch.float16),
        (torch.float32, torch.float64),
        (torch.float64, torch.float32),
    ],
)
def test_mean_and_var_of_different_dtypes_are_refused(mean_dtype, var_dtype):
    """The epistemic part was rounded to mean's dtype and added in var's: a float32 var
    holding bfloat16 precision (25 off at 8665)."""
    mean, var = torch.randn(3, 4).to(mean_dtype), torch.rand(3, 4).to(var_dtype)
    with pytest.raises(TypeError, match=r"gaussian_mixture: mean and var must have one dtype"):
        fe.reduce.gaussian_mixture(mean, var)
