"""A deep ensemble for 1-D regression: uncertainty that grows away from the data.

Eight small MLPs are trained on ``y = sin(3x) + noise`` with ``x`` in ``[-1, 1]``, each
on its own bootstrap sample of the data (bagging) and from its own random
initialization. Where there is data the members agree; away from it nothing pins them
down and they extrapolate in different directions. The spread of their predictions
(the ensemble's standard deviation) is the model's epistemic uncertainty: small inside
the training range, large outside it.

Everything runs as one vectorized ensemble through the functional face:
``fe.stack`` -> ``fe.value_and_grad`` (per-member batches, ``in_dims=0``) ->
``fe.optim.adam`` -> ``fe.reduce.mean`` / ``fe.reduce.std``.

With ``--nll`` each member also predicts the noise: a mean and a variance, trained with
the Gaussian negative log-likelihood (Lakshminarayanan et al., 2017), and
``fe.reduce.gaussian_mixture`` splits the ensemble's predictive variance into the
members' mean variance (aleatoric: the noise) and the variance of their means
(epistemic: their disagreement, still the quantity the check is about).

Run ``python examples/deep_ensemble_regression.py`` (``--quick`` for a seconds-long
smoke run); it saves a plot as ``deep_ensemble.png`` in ``--out`` (default
``./out/deep_ensemble_regression/``) and checks that the average standard deviation
outside the training range is several times the one inside. Needs matplotlib and tqdm
(``pip install '.[examples]'``) unless run with ``--no-plot --quiet``.
"""

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import _cli
import torch
from torch import Tensor, nn
from torch.nn import functional as F

import funcensemble as fe

NAME = "deep_ensemble_regression"
FIGURE = "deep_ensemble.png"  # the name of the figure in docs/img (make figures)
QUICK = {"members": 5, "steps": 150}  # --quick: a seconds-long smoke run
TRAIN_RANGE = (-1.0, 1.0)
PLOT_RANGE = (-3.0, 3.0)
NOISE = 0.1
# The claim the script checks: the mean std outside the training range is at least
# this many times the mean std inside it.
MIN_RATIO = 3.0


def make_member(outputs: int = 1) -> nn.Module:
    """An MLP with ``outputs`` outputs: a mean, or (with ``--nll``) a mean and a raw variance."""
    return nn.Sequential(
        nn.Linear(1, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, outputs)
    )


def split(out: Tensor) -> tuple[Tensor, Tensor]:
    """A 2-output member's mean and variance (softplus keeps the variance positive)."""
    return out[..., :1], F.softplus(out[..., 1:]) + 1e-6


def gaussian_nll(out: Tensor, y: Tensor) -> Tensor:
    # Written out: F.gaussian_nll_loss checks its variances with Python control flow,
    # which vmap cannot trace. The same value, less the constant log(2 pi) / 2.
    mean, var = split(out)
    return 0.5 * (var.log() + (y - mean).square() / var).mean()


def make_data(num_samples: int, *, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``num_samples`` points ``(x, y)``, each ``[num_samples, 1]``."""
    low, high = TRAIN_RANGE
    x = low + (high - low) * torch.rand(num_samples, 1, generator=generator)
    y = torch.sin(3 * x) + NOISE * torch.randn(num_samples, 1, generator=generator)
    return x, y


@dataclass
class Result:
    x: Tensor  # the training data, [samples, 1]
    y: Tensor
    grid: Tensor  # evaluation points over PLOT_RANGE, [points, 1]
    preds: Tensor  # every member's prediction on the grid, [members, points, 1]
    mean: Tensor  # [points, 1]
    std: Tensor  # [points, 1]
    final_losses: Tensor  # each member's loss on its own sample at the last step, [members]
    std_inside: float
    std_outside: float
    # With --nll: the mixture's moments on the grid (fe.reduce.gaussian_mixture), else None.
    mixture: fe.reduce.GaussianMixture | None = None

    @property
    def ratio(self) -> float:
        return self.std_outside / self.std_inside


def train(
    num_members: int,
    num_samples: int,
    steps: int,
    lr: float,
    *,
    seed: int,
    quiet: bool = True,
    nll: bool = False,
) -> Result:
    g = torch.Generator().manual_seed(seed)
    x, y = make_data(num_samples, generator=g)

    # Bagging: member i trains on its own bootstrap resample of the data.
    idx = fe.bootstrap_indices(num_members, num_samples, generator=g)  # [members, samples]
    xs, ys = x[idx], y[idx]  # [members, samples, 1]: one batch per member

    torch.manual_seed(seed)
    outputs = 2 if nll else 1
    fmodel, params, buffers = fe.stack([make_member(outputs) for _ in range(num_members)])

    def loss_fn(p, b, x, y):  # ONE member's loss on ONE member's batch
        out = fmodel(p, b, x)
        return gaussian_nll(out, y) if nll else F.mse_loss(out, y)

    loss_and_grads = fe.value_and_grad(loss_fn, in_dims=0)  # in_dims=0: per-member batches
    opt = fe.optim.adam(lr=lr)
    state = opt.init(params)
    bar = _cli.progress(range(steps), quiet=quiet, desc="training")
    for step in bar:
        losses, grads, buffers = loss_and_grads(params, buffers, xs, ys)
        updates, state = opt.update(grads, state, params)
        params = fe.optim.apply_updates(params, updates)
        if step % 20 == 0 or step == steps - 1:
            bar.set_postfix(**{"mean_nll" if nll else "mean_mse": f"{losses.mean().item():.4f}"})
    bar.close()

    grid = torch.linspace(*PLOT_RANGE, 601).unsqueeze(1)
    with torch.no_grad():
        preds = fe.vmap(fmodel)(params, buffers, grid)  # shared grid: [members, points, outputs]
    mixture = None
    if nll:
        preds, variances = split(preds)
        mixture = fe.reduce.gaussian_mixture(preds, variances)
    mean, std = fe.reduce.mean(preds), fe.reduce.std(preds)
    inside = (grid >= TRAIN_RANGE[0]) & (grid <= TRAIN_RANGE[1])
    return Result(
        x=x,
        y=y,
        grid=grid,
        preds=preds,
        mean=mean,
        std=std,
        final_losses=losses,
        std_inside=std[inside].mean().item(),
        std_outside=std[~inside].mean().item(),
        mixture=mixture,
    )


def plot(result: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid, mean, std = result.grid[:, 0], result.mean[:, 0], result.std[:, 0]
    fig, ax = plt.subplots(figsize=(7.5, 4.2), layout="constrained")
    ax.axvspan(*TRAIN_RANGE, color="0.93", zorder=0, label="training range")
    ax.fill_between(
        grid, mean - 2 * std, mean + 2 * std, color="C0", alpha=0.25, label="mean ± 2 std"
    )
    for k, member in enumerate(result.preds[:, :, 0]):
        ax.plot(grid, member, color="C0", lw=0.6, alpha=0.45, label="members" if k == 0 else None)
    ax.plot(grid, mean, color="C0", lw=2, label="ensemble mean")
    if result.mixture is not None:  # the mixture's std: disagreement and predicted noise
        total = result.mixture.var[:, 0].sqrt()
        for sign in (-1, 1):
            ax.plot(
                grid, mean + sign * 2 * total, color="C1", lw=1, ls="--",
                label="mean ± 2 predictive std (with the noise)" if sign < 0 else None,
            )  # fmt: skip
    ax.plot(grid, torch.sin(3 * grid), color="k", ls="--", lw=1, label="sin(3x)")
    ax.scatter(result.x[:, 0], result.y[:, 0], s=8, color="C3", zorder=3, label="data")
    ax.set_xlim(*PLOT_RANGE)
    ax.set_ylim(-4, 4)
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.set_title(
        f"Deep ensemble of {result.preds.shape[0]} bootstrapped MLPs: std outside the "
        f"data is {result.ratio:.0f}x the std inside"
    )
    ax.legend(loc="lower left", fontsize=8, ncols=3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=8, help="ensemble size (8)")
    parser.add_argument("--samples", type=int, default=100, help="training points (100)")
    parser.add_argument("--steps", type=int, default=2000, help="Adam steps (2000)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data and weights (0)")
    parser.add_argument(
        "--nll",
        action="store_true",
        help="members predict a mean and a variance (Gaussian NLL); report the mixture's "
        "aleatoric and epistemic parts",
    )
    parser.add_argument("--no-plot", action="store_true", help=f"do not save {FIGURE}")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK['members']} members, {QUICK['steps']} steps "
        "(options given are kept)",
    )
    _cli.add_common_options(parser, NAME)
    return parser


def main(argv: Sequence[str] | None = None) -> Result:
    parser = build_parser()
    args = parser.parse_args(argv)
    _cli.apply_quick(parser, args, argv, QUICK)
    if args.members < 2 or args.samples < 1 or args.steps < 1:
        parser.error("--members must be at least 2; --samples and --steps positive")
    _cli.require(parser.prog, *_cli.needs(quiet=args.quiet, plot=not args.no_plot))

    result = train(
        args.members,
        args.samples,
        args.steps,
        args.lr,
        seed=args.seed,
        quiet=args.quiet,
        nll=args.nll,
    )
    print(
        f"{args.members} MLPs, {args.samples} points, {args.steps} Adam steps (lr {args.lr}): "
        f"training {'NLL' if args.nll else 'MSE'} per member "
        f"{result.final_losses.min():.4f}..{result.final_losses.max():.4f}"
    )
    if result.mixture is not None:
        inside = (result.grid >= TRAIN_RANGE[0]) & (result.grid <= TRAIN_RANGE[1])
        noise = result.mixture.aleatoric[inside].sqrt().mean().item()
        print(
            f"predicted noise std (aleatoric) inside the training range: {noise:.4f} "
            f"(the data's is {NOISE})"
        )
    print(
        f"mean std inside the training range {TRAIN_RANGE}: {result.std_inside:.4f}; "
        f"outside it (up to {PLOT_RANGE}): {result.std_outside:.4f}; ratio {result.ratio:.1f}x"
    )
    if not args.no_plot:
        path = _cli.output_file(args.out, FIGURE)
        plot(result, path)
        print(f"plot saved to {path}")
    if not result.ratio >= MIN_RATIO:
        raise AssertionError(
            f"the ensemble's std outside the training range is only {result.ratio:.2f}x the "
            f"std inside it; expected at least {MIN_RATIO}x."
        )
    print(f"The uncertainty widens away from the data (ratio >= {MIN_RATIO:g}).")
    return result


if __name__ == "__main__":
    main()
