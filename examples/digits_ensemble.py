"""A deep ensemble on real data: handwritten digits, one model vs an ensemble of N.

scikit-learn ships a small real dataset on disk (``load_digits``: 1,797 scanned 8x8
handwritten digits, no download). All images of one digit (``--ood-digit``, 9 by
default) are held out of training; the rest is split into a training and a test set.
N MLPs ``64 -> 128 -> 128 -> 10`` (ReLU), each from its own initialization and with its
own shuffling of the training set, train as one ``fe.Ensemble`` with one
``torch.optim.Adam``: its parameters are the members' stacked, and Adam is per element,
so every member is stepped as it would be alone (the same arithmetic; the stacked
products may round the last bit of a gradient differently).

On the test set the script compares one model (each member alone) with the ensemble
(the mean of the members' predicted probabilities) in accuracy, negative
log-likelihood (NLL) and expected calibration error (ECE). It then scores images the
models were never trained on, the held-out digit and uniform noise, by predictive
entropy and by mutual information (the members' disagreement; zero for one model), and
reports how well each score tells them from the test digits (AUROC: 0.5 is chance, 1 is
perfect). It saves a reliability diagram and the score histograms as
``digits_ensemble.png`` in ``--out`` (default ``./out/digits_ensemble/``) and checks
that the ensemble reaches 90% test accuracy, that its NLL is below its members' mean
NLL (Jensen's inequality guarantees this for any ensemble whose members differ, so it
checks that they do), and that its predictive entropy tells noise from digits better
than one model's does on average.

Run ``python examples/digits_ensemble.py`` (``--quick`` for a seconds-long smoke run).
Needs scikit-learn, matplotlib and tqdm (``pip install '.[examples]'``);
``--no-plot --quiet`` needs only scikit-learn.
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

NAME = "digits_ensemble"
FIGURE = "digits_ensemble.png"  # the name of the figure in docs/img (make figures)
IN, CLASSES = 64, 10
BINS = 15  # confidence bins of the calibration error and the reliability diagram
QUICK = {"members": 4, "epochs": 15}
MIN_ACCURACY = 0.9  # the ensemble's test accuracy on the digits it was trained on


def make_member(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, CLASSES),
    )


@dataclass
class Data:
    x: Tensor  # training images, [train, 64], pixel values in [0, 1]
    y: Tensor  # their labels, [train]
    x_test: Tensor  # test images of the trained digits, [test, 64]
    y_test: Tensor
    x_digit: Tensor  # every image of the held-out digit, [held out, 64]
    x_noise: Tensor  # uniform noise images, [test, 64]


def load_data(ood_digit: int, test_fraction: float, *, seed: int) -> Data:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    x = torch.as_tensor(images, dtype=torch.float32) / 16  # pixel values are 0..16
    y = torch.as_tensor(labels, dtype=torch.long)
    held_out = y == ood_digit
    x_in, y_in = x[~held_out], y[~held_out]
    train, test = train_test_split(
        torch.arange(len(y_in)).numpy(),
        test_size=test_fraction,
        stratify=y_in.numpy(),
        random_state=seed,
    )
    train, test = torch.as_tensor(train), torch.as_tensor(test)
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(len(test), IN, generator=g)
    return Data(x_in[train], y_in[train], x_in[test], y_in[test], x[held_out], noise)


def train(
    data: Data,
    *,
    members: int,
    hidden: int,
    epochs: int,
    batch: int,
    lr: float,
    weight_decay: float,
    seed: int,
    quiet: bool = True,
) -> fe.Ensemble:
    """N members trained as one ``fe.Ensemble``, each on its own shuffling of the data."""
    ens = fe.Ensemble.from_factory(lambda: make_member(hidden), members, seed=seed)
    opt = torch.optim.Adam(ens.parameters(), lr=lr, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(seed)
    n = len(data.y)
    steps_per_epoch = -(-n // batch)
    bar = _cli.progress(total=epochs * steps_per_epoch, quiet=quiet, desc=f"{members} members")
    for _ in range(epochs):
        # Member i sees the training set in its own order: [members, n] indices.
        order = torch.stack([torch.randperm(n, generator=g) for _ in range(members)])
        for start in range(0, n, batch):
            idx = order[:, start : start + batch]  # [members, batch]
            logits = ens(data.x[idx], in_dims=0)  # one batch per member: [members, batch, 10]
            # Each member's mean cross-entropy on its own batch, summed over members:
            # the members share no parameter, so each gets its own loss's gradient.
            losses = F.cross_entropy(logits.transpose(1, 2), data.y[idx], reduction="none")
            loss = losses.mean(dim=1).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            bar.update()
            if start == 0:
                bar.set_postfix(mean_loss=f"{loss.item() / members:.4f}")
    bar.close()
    return ens


@dataclass
class Calibration:
    ece: float  # expected calibration error: sum over bins of |accuracy - confidence| * share
    accuracy: Tensor  # per confidence bin, [BINS] (NaN where a bin is empty)
    confidence: Tensor  # mean confidence per bin, [BINS]
    counts: Tensor  # predictions per bin, [BINS]


def calibration(log_probs: Tensor, labels: Tensor, bins: int = BINS) -> Calibration:
    """How far the confidence of the predicted class is from how often it is right.

    Predictions are grouped into ``bins`` equal-width bins of their confidence
    ``max_c p_c`` (bin ``b`` holds ``(b / bins, (b + 1) / bins]``).
    """
    confidence, predicted = log_probs.double().exp().max(dim=-1)
    correct = (predicted == labels).double()
    which = (torch.ceil(confidence * bins).long() - 1).clamp(0, bins - 1)
    counts = torch.bincount(which, minlength=bins).double()
    right = torch.bincount(which, weights=correct, minlength=bins)
    sure = torch.bincount(which, weights=confidence, minlength=bins)
    ece = ((right - sure).abs().sum() / len(labels)).item()
    return Calibration(ece, right / counts, sure / counts, counts)


def nll(log_probs: Tensor, labels: Tensor) -> float:
    """The mean negative log-likelihood of the true labels, in nats."""
    return -log_probs.double().gather(-1, labels.unsqueeze(-1)).mean().item()


def accuracy(log_probs: Tensor, labels: Tensor) -> float:
    return (log_probs.argmax(dim=-1) == labels).double().mean().item()


def auroc(in_scores: Tensor, out_scores: Tensor) -> float:
    """How well a score ranks out-of-distribution inputs above in-distribution ones."""
    from sklearn.metrics import roc_auc_score

    truth = torch.cat([torch.zeros(len(in_scores)), torch.ones(len(out_scores))])
    return float(roc_auc_score(truth.numpy(), torch.cat([in_scores, out_scores]).numpy()))


@dataclass
class Scores:
    """One model's or the ensemble's numbers on the test set and the OOD sets."""

    accuracy: float
    nll: float
    calibration: Calibration
    entropy: dict[str, Tensor]  # predictive entropy on "test", "digit", "noise"
    auroc_digit: float  # by predictive entropy
    auroc_noise: float
    mutual_information: dict[str, Tensor] | None = None  # the ensemble's only
    mi_auroc_digit: float | None = None
    mi_auroc_noise: float | None = None


def score(logits: dict[str, Tensor], labels: Tensor) -> Scores:
    """Scores of the members ``logits[...]`` ``[N, batch, 10]`` taken as one ensemble.

    With N = 1 these are one model's scores (its mutual information is 0, not reported).
    """
    log_probs = fe.reduce.mean_log_probs(logits["test"])
    entropy = {k: fe.reduce.predictive_entropy(v) for k, v in logits.items()}
    result = Scores(
        accuracy=accuracy(log_probs, labels),
        nll=nll(log_probs, labels),
        calibration=calibration(log_probs, labels),
        entropy=entropy,
        auroc_digit=auroc(entropy["test"], entropy["digit"]),
        auroc_noise=auroc(entropy["test"], entropy["noise"]),
    )
    if next(iter(logits.values())).shape[0] > 1:
        mi = {k: fe.reduce.mutual_information(v) for k, v in logits.items()}
        result.mutual_information = mi
        result.mi_auroc_digit = auroc(mi["test"], mi["digit"])
        result.mi_auroc_noise = auroc(mi["test"], mi["noise"])
    return result


@dataclass
class Result:
    members: list[Scores]  # each member alone
    ensemble: Scores
    ood_digit: int

    def mean(self, name: str) -> float:
        return sum(getattr(m, name) for m in self.members) / len(self.members)


def evaluate(ens: fe.Ensemble, data: Data, ood_digit: int) -> Result:
    with torch.no_grad():
        # Every member on the same images (a shared input): [members, images, 10].
        logits = {"test": ens(data.x_test), "digit": ens(data.x_digit), "noise": ens(data.x_noise)}
    members = [
        score({k: v[i : i + 1] for k, v in logits.items()}, data.y_test) for i in range(len(ens))
    ]
    return Result(members, score(logits, data.y_test), ood_digit)


def check(result: Result) -> list[str]:
    """The claims that fail, each as a line (empty when all hold)."""
    ens, failed = result.ensemble, []
    if not ens.accuracy >= MIN_ACCURACY:
        failed.append(f"ensemble test accuracy {ens.accuracy:.4f} is below {MIN_ACCURACY}")
    if not ens.nll < result.mean("nll"):
        failed.append(
            f"ensemble NLL {ens.nll:.4f} is not below its members' mean "
            f"{result.mean('nll'):.4f}: the members predict alike (are they copies?)"
        )
    if not ens.auroc_noise > result.mean("auroc_noise"):
        failed.append(
            f"the ensemble's predictive entropy tells noise from digits no better than one "
            f"model's (AUROC {ens.auroc_noise:.4f}, members' mean {result.mean('auroc_noise'):.4f})"
        )
    return failed


def report(result: Result) -> None:
    n, ens = len(result.members), result.ensemble
    d = result.ood_digit

    def spread(name: str) -> str:
        values = torch.tensor([getattr(m, name) for m in result.members])
        return f"{values.mean():.4f} ± {values.std():.4f}" if n > 1 else f"{values[0]:.4f}"

    member_ece = torch.tensor([m.calibration.ece for m in result.members])
    rows = [
        ("", "accuracy", "NLL", "ECE", f"AUROC digit {d}", "AUROC noise"),
        (
            f"one model (mean ± std of {n})",
            spread("accuracy"),
            spread("nll"),
            f"{member_ece.mean():.4f} ± {member_ece.std():.4f}",
            spread("auroc_digit"),
            spread("auroc_noise"),
        ),
        (
            f"ensemble of {n}",
            f"{ens.accuracy:.4f}",
            f"{ens.nll:.4f}",
            f"{ens.calibration.ece:.4f}",
            f"{ens.auroc_digit:.4f}",
            f"{ens.auroc_noise:.4f}",
        ),
        (
            f"ensemble of {n}, by mutual information",
            "",
            "",
            "",
            f"{ens.mi_auroc_digit:.4f}",
            f"{ens.mi_auroc_noise:.4f}",
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        print("  ".join(cells).rstrip())
        if k == 0:
            print("  ".join("-" * w for w in widths))
    print(
        f"(AUROC: how well the score, predictive entropy unless stated, ranks the held-out "
        f"digit {d} or noise images above the test digits; 0.5 is chance.)"
    )


def plot(result: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    single, ens, n, d = result.members[0], result.ensemble, len(result.members), result.ood_digit
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5), layout="constrained")
    ax = axes[0, 0]
    ax.plot([0, 1], [0, 1], color="0.6", ls="--", lw=1, label="perfect calibration")
    for scores, label, color in ((single, "one model", "C1"), (ens, f"ensemble of {n}", "C0")):
        cal = scores.calibration
        shown = cal.counts > 0
        ax.plot(cal.confidence[shown], cal.accuracy[shown], color=color, lw=0.8, alpha=0.6)
        ax.scatter(
            cal.confidence[shown],
            cal.accuracy[shown],
            s=8 + 300 * cal.counts[shown] / cal.counts.sum(),  # area: share of the images
            color=color,
            label=f"{label}: ECE {cal.ece:.3f}",
        )
    ax.set_xlim(0, 1.02)
    ax.set_ylim(-0.02, 1.05)
    ax.set_xlabel(f"mean confidence (max predicted probability) in each of {BINS} bins")
    ax.set_ylabel("accuracy in the bin")
    ax.set_title("Reliability diagram, test digits (marker area: share of images)")
    ax.legend(loc="upper left", fontsize=8)

    panels = [
        (axes[0, 1], single.entropy, "one model (member 0): predictive entropy", single, False),
        (axes[1, 0], ens.entropy, f"ensemble of {n}: predictive entropy", ens, False),
        (axes[1, 1], ens.mutual_information, f"ensemble of {n}: mutual information", ens, True),
    ]
    top = max(max(v.max().item() for v in ens.entropy.values()), 1e-3)
    for ax, values, title, scores, mi in panels:
        edges = torch.linspace(0, top, 41)
        aurocs = (
            (scores.mi_auroc_digit, scores.mi_auroc_noise)
            if mi
            else (scores.auroc_digit, scores.auroc_noise)
        )
        for key, label, color in (
            ("test", "test digits", "C0"),
            ("digit", f"held-out digit {d} (AUROC {aurocs[0]:.2f})", "C3"),
            ("noise", f"uniform noise (AUROC {aurocs[1]:.2f})", "0.4"),
        ):
            ax.hist(
                values[key].numpy(),
                bins=edges.numpy(),
                density=True,
                histtype="step",
                lw=1.5,
                color=color,
                label=label,
            )
        ax.set_yscale("log")
        ax.set_xlabel("nats")
        ax.set_ylabel("density")
        ax.set_title(title)
        ax.legend(loc="upper right", fontsize=8)
    fig.suptitle(
        f"Digits (scikit-learn), digit {d} held out: one MLP vs a deep ensemble of {n}",
        fontsize=11,
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=8, help="ensemble size (8)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden width (128)")
    parser.add_argument(
        "--epochs", type=int, default=100, help="passes over the training set (100)"
    )
    parser.add_argument("--batch", type=int, default=64, help="images per member per step (64)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (1e-3)")
    parser.add_argument(
        "--weight-decay", type=float, default=0.0, help="Adam's L2 weight decay (0)"
    )
    parser.add_argument(
        "--ood-digit", type=int, default=9, help="the digit held out of training (9)"
    )
    parser.add_argument(
        "--test-fraction",
        type=float,
        default=0.3,
        help="share of the other digits' images kept for the test set (0.3)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for split, weights, order (0)")
    parser.add_argument("--no-plot", action="store_true", help=f"do not save {FIGURE}")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK['members']} members, {QUICK['epochs']} epochs "
        "(options given are kept)",
    )
    _cli.add_common_options(parser, NAME)
    return parser


def main(argv: Sequence[str] | None = None) -> Result:
    parser = build_parser()
    args = parser.parse_args(argv)
    _cli.apply_quick(parser, args, argv, QUICK)
    if args.members < 2 or min(args.hidden, args.epochs, args.batch) < 1:
        parser.error("--members must be at least 2; --hidden, --epochs and --batch positive")
    if not 0 <= args.ood_digit <= 9:
        parser.error(f"--ood-digit must be a digit 0..9, got {args.ood_digit}")
    if not 0 < args.test_fraction < 1:
        parser.error(f"--test-fraction must lie in (0, 1), got {args.test_fraction}")
    _cli.require(
        parser.prog, *_cli.needs(quiet=args.quiet, plot=not args.no_plot, also=["sklearn"])
    )

    data = load_data(args.ood_digit, args.test_fraction, seed=args.seed)
    print(
        f"digits: {len(data.y)} training and {len(data.y_test)} test images of 9 digits; "
        f"{len(data.x_digit)} images of the held-out digit {args.ood_digit}; "
        f"{len(data.x_noise)} noise images"
    )
    print(
        f"{args.members} MLPs 64-{args.hidden}-{args.hidden}-10, {args.epochs} epochs, batch "
        f"{args.batch}, Adam lr {args.lr}, weight decay {args.weight_decay}, seed {args.seed}\n"
    )
    ens = train(
        data,
        members=args.members,
        hidden=args.hidden,
        epochs=args.epochs,
        batch=args.batch,
        lr=args.lr,
        weight_decay=args.weight_decay,
        seed=args.seed,
        quiet=args.quiet,
    )
    result = evaluate(ens, data, args.ood_digit)
    report(result)
    if not args.no_plot:
        path = _cli.output_file(args.out, FIGURE)
        plot(result, path)
        print(f"plot saved to {path}")
    failed = check(result)
    if failed:
        raise AssertionError("; ".join(failed))
    print(
        f"\nThe ensemble reaches test accuracy >= {MIN_ACCURACY}, its NLL is below its "
        f"members' mean, and its entropy tells noise from digits better than one model's."
    )
    return result


if __name__ == "__main__":
    main()
