"""Population-based training (PBT) of an ensemble on handwritten digits, with member surgery.

A population of N MLPs ``64 -> hidden -> 10`` trains as one ``fe.Ensemble`` with one
``fe.optim.EnsembleOptimizer`` running Adam with a learning rate per member (a ``[N]``
tensor), drawn log-uniformly from ``--lr-min`` to ``--lr-max``: some start far too low,
some too high. Every ``--interval`` steps each member is scored on a validation split,
and PBT (Jaderberg et al., 2017) acts on the population:

* exploit: each member of the bottom quarter is overwritten by a random member of the
  top quarter, parameters, buffers and Adam state alike
  (``ens.copy_members_(src, dst)`` and ``opt.copy_members_(src, dst)``: the same as
  ``load_state_dict`` of the source's module and ``torch.optim`` state);
* explore: each overwritten member's learning rate is its source's, multiplied by 0.8
  or 1.25 at random (a new ``fe.optim.adam(lr=lr)``; the state keeps its layout).

The same initial population also trains with its learning rates fixed. The script
reports both populations' validation and test accuracy and checks that PBT's mean
validation accuracy beats the fixed population's (the members with hopeless learning
rates get replaced). It saves the learning rate of every member over time and the
populations' accuracy as ``pbt_digits.png`` in ``--out`` (default ``./out/pbt_digits/``).

Run ``python examples/pbt_digits.py`` (``--quick`` for a seconds-long smoke run). Needs
scikit-learn, matplotlib and tqdm (``pip install '.[examples]'``);
``--no-plot --quiet`` needs only scikit-learn.
"""

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import _cli
import torch
from torch import Tensor, nn
from torch.nn import functional as F

import funcensemble as fe

NAME = "pbt_digits"
FIGURE = "pbt_digits.png"
IN, CLASSES = 64, 10
QUICK = {"members": 8, "rounds": 8, "interval": 25}
PERTURB = (0.8, 1.25)


def make_member(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(IN, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))


@dataclass
class Split:
    x: Tensor  # [samples, 64], pixel values in [0, 1]
    y: Tensor  # [samples]


def load_data(seed: int) -> tuple[Split, Split, Split]:
    """Training, validation and test splits (60/20/20) of scikit-learn's digits."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.as_tensor(images, dtype=torch.float32) / 16
    y = torch.as_tensor(labels, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    a, b = int(0.6 * len(y)), int(0.8 * len(y))
    parts = order[:a], order[a:b], order[b:]
    return tuple(Split(x[p], y[p]) for p in parts)  # type: ignore[return-value]


def accuracy(ens: fe.Ensemble, split: Split) -> Tensor:
    """Each member's accuracy on ``split``: ``[members]``."""
    with torch.no_grad():
        return (ens(split.x).argmax(dim=-1) == split.y).float().mean(dim=1)


@dataclass
class Run:
    """One population's training: its final ensemble and its history per round."""

    ens: fe.Ensemble
    lr: Tensor  # the final learning rates, [members]
    lrs: list[Tensor] = field(default_factory=list)  # per round, [members]
    val: list[Tensor] = field(default_factory=list)  # per round, [members]
    copies: int = 0  # members overwritten by exploit, in all


def train(
    train_set: Split,
    val_set: Split,
    *,
    members: int,
    hidden: int,
    rounds: int,
    interval: int,
    batch: int,
    lr_range: tuple[float, float],
    pbt: bool,
    seed: int,
    bar: object,
) -> Run:
    """Train a population for ``rounds * interval`` steps, with PBT or with fixed lrs."""
    ens = fe.Ensemble.from_factory(lambda: make_member(hidden), members, seed=seed)
    g = torch.Generator().manual_seed(seed)
    low, high = torch.tensor(lr_range).log()
    lr = (low + (high - low) * torch.rand(members, generator=g)).exp()
    opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=lr))
    run = Run(ens, lr)
    n = len(train_set.y)
    quarter = max(1, members // 4)
    for _ in range(rounds):
        for _ in range(interval):
            idx = torch.randint(n, (members, batch), generator=g)  # a batch per member
            logits = ens(train_set.x[idx], in_dims=0)
            losses = F.cross_entropy(logits.transpose(1, 2), train_set.y[idx], reduction="none")
            loss = losses.mean(dim=1).sum()  # each member gets its own loss's gradient
            opt.zero_grad()
            loss.backward()
            opt.step()
            bar.update()  # type: ignore[attr-defined]
        val = accuracy(ens, val_set)
        run.val.append(val)
        run.lrs.append(lr.clone())
        bar.set_postfix(  # type: ignore[attr-defined]
            pbt=pbt, mean_val=f"{val.mean().item():.3f}", best=f"{val.max().item():.3f}"
        )
        if not pbt:
            continue
        ranked = val.argsort(descending=True)
        top, bottom = ranked[:quarter], ranked[-quarter:]
        src = top[torch.randint(quarter, (quarter,), generator=g)]
        # Exploit: the bottom members become copies of top ones, Adam state included.
        ens.copy_members_(src.tolist(), bottom.tolist())
        opt.copy_members_(src.tolist(), bottom.tolist())
        # Explore: perturb the copies' learning rates; the state keeps its layout.
        factors = torch.tensor(PERTURB)[torch.randint(2, (quarter,), generator=g)]
        lr[bottom] = lr[src] * factors
        opt.transform = fe.optim.adam(lr=lr)
        run.copies += quarter
    run.lr = lr
    return run


@dataclass
class Result:
    pbt: Run
    fixed: Run
    pbt_test: Tensor  # each member's test accuracy, [members]
    fixed_test: Tensor


def plot(result: Result, interval: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    steps = [interval * (r + 1) for r in range(len(result.pbt.lrs))]
    lrs = torch.stack(result.pbt.lrs)  # [rounds, members]
    for m in range(lrs.shape[1]):
        left.plot(steps, lrs[:, m], marker=".", lw=1)
    left.set_yscale("log")
    left.set(xlabel="step", ylabel="learning rate", title="PBT: each member's lr")
    for run, name in ((result.pbt, "PBT"), (result.fixed, "fixed lrs")):
        val = torch.stack(run.val)
        line = right.plot(steps, val.mean(dim=1), label=f"{name}: mean")[0]
        right.plot(steps, val.max(dim=1).values, ls="--", color=line.get_color(), label="best")
    right.set(xlabel="step", ylabel="validation accuracy", title="population accuracy")
    right.legend(fontsize=8)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=16, help="population size (16)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden width (64)")
    parser.add_argument("--rounds", type=int, default=20, help="exploit/explore rounds (20)")
    parser.add_argument(
        "--interval", type=int, default=50, help="training steps between rounds (50)"
    )
    parser.add_argument("--batch", type=int, default=32, help="images per member per step (32)")
    parser.add_argument(
        "--lr-min", type=float, default=1e-5, help="lowest initial learning rate (1e-5)"
    )
    parser.add_argument(
        "--lr-max", type=float, default=0.3, help="highest initial learning rate (0.3)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for split, weights, lrs (0)")
    parser.add_argument("--no-plot", action="store_true", help=f"do not save {FIGURE}")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK['members']} members, {QUICK['rounds']} rounds of "
        f"{QUICK['interval']} steps (options given are kept)",
    )
    _cli.add_common_options(parser, NAME)
    return parser


def main(argv: Sequence[str] | None = None) -> Result:
    parser = build_parser()
    args = parser.parse_args(argv)
    _cli.apply_quick(parser, args, argv, QUICK)
    if args.members < 4 or min(args.hidden, args.rounds, args.interval, args.batch) < 1:
        parser.error(
            "--members must be at least 4; --hidden, --rounds, --interval, --batch positive"
        )
    if not 0 < args.lr_min <= args.lr_max:
        parser.error(f"need 0 < --lr-min <= --lr-max, got {args.lr_min} and {args.lr_max}")
    _cli.require(
        parser.prog, *_cli.needs(quiet=args.quiet, plot=not args.no_plot, also=["sklearn"])
    )

    train_set, val_set, test_set = load_data(args.seed)
    print(
        f"digits: {len(train_set.y)} training, {len(val_set.y)} validation, "
        f"{len(test_set.y)} test images; {args.members} MLPs 64-{args.hidden}-10, "
        f"Adam lr from {args.lr_min:g} to {args.lr_max:g}, {args.rounds} rounds of "
        f"{args.interval} steps, seed {args.seed}"
    )
    steps = args.rounds * args.interval
    bar = _cli.progress(total=2 * steps, quiet=args.quiet, desc="PBT, then fixed lrs")
    options = dict(
        members=args.members,
        hidden=args.hidden,
        rounds=args.rounds,
        interval=args.interval,
        batch=args.batch,
        lr_range=(args.lr_min, args.lr_max),
        seed=args.seed,
        bar=bar,
    )
    pbt = train(train_set, val_set, pbt=True, **options)
    fixed = train(train_set, val_set, pbt=False, **options)
    bar.close()
    result = Result(pbt, fixed, accuracy(pbt.ens, test_set), accuracy(fixed.ens, test_set))

    for run, test, name in ((pbt, result.pbt_test, "PBT"), (fixed, result.fixed_test, "fixed")):
        val = run.val[-1]
        print(
            f"{name:>5}: validation accuracy mean {val.mean():.4f}, best {val.max():.4f}; "
            f"test mean {test.mean():.4f}, best {test.max():.4f}; lr from "
            f"{run.lr.min():.2g} to {run.lr.max():.2g}"
        )
    print(f"PBT overwrote {pbt.copies} members in {args.rounds} rounds")
    if not args.no_plot:
        path = _cli.output_file(args.out, FIGURE)
        plot(result, args.interval, path)
        print(f"saved {path}")
    gain = (pbt.val[-1].mean() - fixed.val[-1].mean()).item()
    assert gain > 0, (
        f"PBT's mean validation accuracy is not above the fixed population's ({gain:+.4f})"
    )
    print(f"PBT's mean validation accuracy beats fixed learning rates by {gain:+.4f}")
    return result


if __name__ == "__main__":
    main()
