"""A learning-rate sweep as one ensemble: N learning rates, one training run.

A hyperparameter sweep trains the same model many times with different settings.
When the settings are optimizer hyperparameters, the runs are an ensemble: N copies of
one initial model, each stepped by Adam with its own learning rate
(``fe.optim.adam(lr=torch.logspace(-4, -1, N))``, a ``[N]`` tensor with one value per
member). All N runs then train as one vectorized model, in one loop.

The script fits a small MLP to a fixed random teacher network, picks the learning rate
with the lowest validation loss, checks that this member trained as a plain
``torch.optim.Adam`` run at that learning rate would (final training losses within a
relative ``RTOL``), and saves every member's training loss curve in one plot,
``lr_sweep.png`` in ``--out`` (default ``./out/lr_sweep/``).

Run ``python examples/lr_sweep.py`` (``--quick`` for a seconds-long smoke run). Needs
matplotlib and tqdm (``pip install '.[examples]'``) unless run with
``--no-plot --quiet``.
"""

import argparse
import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import _cli
import torch
from torch import Tensor, nn
from torch.nn import functional as F

import funcensemble as fe

NAME = "lr_sweep"
FIGURE = "lr_sweep.png"  # the name of the figure in docs/img (make figures)
QUICK = {"members": 6, "steps": 60}  # --quick: a seconds-long smoke run
IN, HIDDEN = 8, 64
# The best member is re-trained alone with torch.optim.Adam; its final training loss
# must match the ensemble member's to this relative tolerance. Both run the same
# float32 math, but a batched matmul sums in a different order than a single one, and
# Adam carries the last-bit differences through the steps.
RTOL = 1e-3


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1)
    )


def make_data(num_samples: int, *, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Train and validation sets ``(x, y, x_val, y_val)`` from a random teacher MLP."""
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(IN, 32, generator=g), torch.randn(32, 1, generator=g)
    x = torch.randn(2 * num_samples, IN, generator=g)
    y = torch.tanh(x @ w1 / math.sqrt(IN)) @ w2 / math.sqrt(32)
    y = y + 0.05 * torch.randn(y.shape, generator=g)
    return x[:num_samples], y[:num_samples], x[num_samples:], y[num_samples:]


@dataclass
class Result:
    lrs: Tensor  # [members]
    curves: Tensor  # training loss of every member at every step, [steps, members]
    val_losses: Tensor  # [members]
    best: int  # index of the member with the lowest validation loss
    reference_loss: float  # final training loss of torch.optim.Adam at lrs[best]

    @property
    def best_lr(self) -> float:
        return self.lrs[self.best].item()


def sweep(lrs: Tensor, steps: int, num_samples: int, *, seed: int, quiet: bool = True) -> Result:
    x, y, x_val, y_val = make_data(num_samples, seed=seed)
    torch.manual_seed(seed)
    model = make_model()
    # N copies of ONE initial model: the members differ only in their learning rate.
    fmodel, params, buffers = fe.stack([copy.deepcopy(model) for _ in lrs])

    def loss_fn(p, b, x, y):
        return F.mse_loss(fmodel(p, b, x), y)

    loss_and_grads = fe.value_and_grad(loss_fn)  # in_dims=None: every member sees x, y
    opt = fe.optim.adam(lr=lrs)  # one learning rate per member
    state = opt.init(params)
    curves = []
    bar = _cli.progress(range(steps), quiet=quiet, desc=f"{len(lrs)} learning rates")
    for step in bar:
        losses, grads, buffers = loss_and_grads(params, buffers, x, y)
        curves.append(losses)
        updates, state = opt.update(grads, state, params)
        params = fe.optim.apply_updates(params, updates)
        if step % 10 == 0 or step == steps - 1:
            bar.set_postfix(lowest_mse=f"{losses.nan_to_num(math.inf).min().item():.4f}")
    bar.close()
    with torch.no_grad():
        final = fe.vmap(loss_fn)(params, buffers, x, y)
        val = fe.vmap(loss_fn)(params, buffers, x_val, y_val)
    curves.append(final)
    # A diverged member has a NaN loss; it must not win the sweep.
    best = int(torch.nan_to_num(val, nan=math.inf).argmin())

    # The reference: the same initial model trained alone by torch.optim.Adam.
    alone = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(alone.parameters(), lr=lrs[best].item())
    for _ in _cli.progress(range(steps), quiet=quiet, desc="torch.optim.Adam reference"):
        ref_opt.zero_grad()
        F.mse_loss(alone(x), y).backward()
        ref_opt.step()
    with torch.no_grad():
        reference = F.mse_loss(alone(x), y).item()
    return Result(lrs, torch.stack(curves), val, best, reference)


def plot(result: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    lrs = result.lrs
    norm = LogNorm(lrs.min().item(), lrs.max().item())
    cmap = plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(7.5, 4.2), layout="constrained")
    steps = torch.arange(result.curves.shape[0])
    for k, lr in enumerate(lrs.tolist()):
        best = k == result.best
        ax.plot(
            steps,
            result.curves[:, k],
            color="C3" if best else cmap(norm(lr)),
            lw=2.2 if best else 1.0,
            zorder=3 if best else 2,
            label=f"lowest validation loss: lr = {lr:.2g}" if best else None,
        )
    ax.set_yscale("log")
    ax.set_xlabel("Adam step")
    ax.set_ylabel("training MSE")
    ax.set_title(f"{len(lrs)} learning rates trained as one ensemble, in one run")
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="learning rate")
    ax.legend(loc="upper right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=16, help="learning rates (16)")
    parser.add_argument("--steps", type=int, default=500, help="Adam steps (500)")
    parser.add_argument("--samples", type=int, default=512, help="training points (512)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data and weights (0)")
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
    if args.members < 1 or args.steps < 1 or args.samples < 1:
        parser.error("--members, --steps and --samples must be positive")
    _cli.require(parser.prog, *_cli.needs(quiet=args.quiet, plot=not args.no_plot))

    lrs = torch.logspace(-4, -1, args.members)
    result = sweep(lrs, args.steps, args.samples, seed=args.seed, quiet=args.quiet)
    print(
        f"{args.members} learning rates {lrs[0]:.0e}..{lrs[-1]:.0e}, {args.steps} Adam steps, "
        f"{args.samples} training points, one ensemble\n"
    )
    print(f"{'lr':>9}  {'train MSE':>10}  {'val MSE':>10}")
    for k, lr in enumerate(lrs.tolist()):
        mark = "  <- best" if k == result.best else ""
        print(f"{lr:9.2e}  {result.curves[-1, k]:10.5f}  {result.val_losses[k]:10.5f}{mark}")
    print(f"\nbest lr: {result.best_lr:.3g} (validation MSE {result.val_losses[result.best]:.5f})")

    if not args.no_plot:
        path = _cli.output_file(args.out, FIGURE)
        plot(result, path)
        print(f"plot saved to {path}")
    member = result.curves[-1, result.best].item()
    if not math.isclose(member, result.reference_loss, rel_tol=RTOL):
        raise AssertionError(
            f"the best member's final training loss {member:.6g} differs from a plain "
            f"torch.optim.Adam run at lr {result.best_lr:.3g} ({result.reference_loss:.6g}) "
            f"by more than rtol {RTOL:.0e}."
        )
    print(
        f"The best member matches a plain torch.optim.Adam run at lr {result.best_lr:.3g} "
        f"(final loss {member:.6g} vs {result.reference_loss:.6g})."
    )
    return result


if __name__ == "__main__":
    main()
