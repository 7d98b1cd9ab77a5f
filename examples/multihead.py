"""128 small regression heads over one shared batch: a Python loop vs one funcensemble call.

The question that started funcensemble: I have many separate little models (here 128
``Linear(8, 32) -> Tanh -> Linear(32, 4)`` heads) that all see the same input batch.
Trained as an ``nn.ModuleList`` loop, every step launches hundreds of tiny kernels. Can
they train as one vectorized model, with the same results, faster?

This script trains the same heads (same initial weights, same data, same number of
steps) three ways and checks that every head ends at the same loss:

* loop: ``nn.ModuleList`` and one ``torch.optim.Adam(foreach=True)`` (a fair baseline);
* module face: ``fe.Ensemble(heads)`` and ``torch.optim.Adam(ens.parameters())``;
* functional face: ``fe.stack``, ``fe.value_and_grad`` and the pure optimizer
  ``fe.optim.adam``.

Run ``python examples/multihead.py`` (``--quick`` for a seconds-long smoke run). Its
progress bars need tqdm (``pip install '.[examples]'``); ``--quiet`` runs
without them.
"""

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import _cli
import torch
from torch import Tensor, nn

import funcensemble as fe

NAME = "multihead"
QUICK = {"heads": 16, "steps": 20}  # --quick: a seconds-long smoke run

IN, HIDDEN, OUT = 8, 32, 4
LR = 3e-3
WARMUP = 3  # untimed first steps (allocator, caches, lazy init); they still train
# All variants compute the same float32 math, but not always in the same order (a
# vectorized matmul may sum differently than N separate ones; fe.optim.adam arranges
# Adam's formula differently than torch.optim.Adam), so results can differ in the last
# bits, and training amplifies such differences step after step. Measured here at the
# default 300 steps: up to about 1e-5 relative. (At lr 1e-2 the heads reach a regime
# where tiny gradients make Adam's normalized steps so sensitive that rounding grows to
# about 1e-2 within 300 steps, even though the variants agree to 1e-16 per step in
# float64; hence the moderate learning rate.) Per-head final losses must agree to:
RTOL = 1e-3


def make_heads(num_heads: int, *, seed: int) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
        for _ in range(num_heads)
    )


def make_data(num_heads: int, batch: int, *, seed: int) -> tuple[Tensor, Tensor]:
    """One shared input batch ``[batch, IN]``; each head its own noisy target function."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, IN, generator=g)
    w = torch.randn(num_heads, IN, OUT, generator=g)
    y = torch.sin(x @ w) + 0.1 * torch.randn(num_heads, batch, OUT, generator=g)
    return x, y  # y: [heads, batch, OUT]


@torch.no_grad()
def final_losses(heads: Sequence[nn.Module], x: Tensor, y: Tensor) -> Tensor:
    """Each head's mean squared error, evaluated the same way for every variant."""
    return torch.stack([((head(x) - y[i]) ** 2).mean() for i, head in enumerate(heads)])


# Each variant takes the initial heads and returns (step, trained): `step()` runs one
# training step on all heads and returns the sum of their losses (before the step),
# `trained()` returns the heads as ordinary modules.
Variant = Callable[[nn.ModuleList, Tensor, Tensor], tuple[Callable[[], Tensor], Callable]]


def loop_variant(heads: nn.ModuleList, x: Tensor, y: Tensor):
    opt = torch.optim.Adam(heads.parameters(), lr=LR, foreach=True)

    def step() -> Tensor:
        loss = sum(((head(x) - y[i]) ** 2).mean() for i, head in enumerate(heads))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return step, lambda: heads


def ensemble_variant(heads: nn.ModuleList, x: Tensor, y: Tensor):
    ens = fe.Ensemble(heads)  # copies the heads' initial weights into [N, ...] parameters
    opt = torch.optim.Adam(ens.parameters(), lr=LR, foreach=True)

    def step() -> Tensor:
        per_head = ((ens(x) - y) ** 2).mean(dim=(1, 2))  # ens(x): [heads, batch, OUT]
        loss = per_head.sum()
        opt.zero_grad()
        loss.backward()  # the heads share nothing: each gets its own gradient
        opt.step()
        return loss.detach()

    return step, ens.unstack


def functional_variant(heads: nn.ModuleList, x: Tensor, y: Tensor):
    fmodel, params, buffers = fe.stack(heads)  # pure function + dicts of [N, ...] tensors

    def loss_fn(params, buffers, x, y):  # ONE head's loss
        return ((fmodel(params, buffers, x) - y) ** 2).mean()

    losses_and_grads = fe.value_and_grad(loss_fn, in_dims=(None, 0))  # x shared, y per head
    opt = fe.optim.adam(lr=LR)
    state = opt.init(params)

    def step() -> Tensor:
        nonlocal params, buffers, state
        losses, grads, buffers = losses_and_grads(params, buffers, x, y)
        updates, state = opt.update(grads, state, params)
        params = fe.optim.apply_updates(params, updates)
        return losses.sum()

    return step, lambda: fe.unstack(fmodel, params, buffers)


@dataclass
class Result:
    name: str
    losses: Tensor  # final per-head losses, [heads]
    steps_per_s: float


def run(
    name: str,
    variant: Variant,
    heads: nn.ModuleList,
    x: Tensor,
    y: Tensor,
    steps: int,
    *,
    quiet: bool = True,
) -> Result:
    step, trained = variant(heads, x, y)
    bar = _cli.progress(total=steps, quiet=quiet, desc=name)
    for _ in range(min(WARMUP, steps - 1)):
        step()
        bar.update()
    timed = steps - min(WARMUP, steps - 1)
    every = max(1, timed // 20)  # reading the loss waits for the step: not every step
    start = time.perf_counter()
    for k in range(timed):
        loss = step()
        bar.update()
        if k % every == 0 or k == timed - 1:
            bar.set_postfix(mean_loss=f"{loss.item() / len(heads):.4f}")
    elapsed = time.perf_counter() - start
    bar.close()
    return Result(name, final_losses(trained(), x, y), timed / elapsed)


def variants() -> dict[str, Variant]:
    return {
        "nn.ModuleList loop + torch.optim.Adam": loop_variant,
        "fe.Ensemble + torch.optim.Adam": ensemble_variant,
        "fe.value_and_grad + fe.optim.adam": functional_variant,
    }


def relative_gap(losses: Tensor, reference: Tensor) -> float:
    return ((losses - reference).abs() / reference.abs()).max().item()


def print_table(results: list[Result]) -> None:
    base = results[0]
    rows = [("variant", "steps/s", "speed-up", "mean loss", "max |Δ loss|", "max rel. Δ")]
    for r in results:
        rows.append(
            (
                r.name,
                f"{r.steps_per_s:.1f}",
                f"{r.steps_per_s / base.steps_per_s:.1f}x",
                f"{r.losses.mean().item():.5f}",
                "-" if r is base else f"{(r.losses - base.losses).abs().max().item():.1e}",
                "-" if r is base else f"{relative_gap(r.losses, base.losses):.1e}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        print("  ".join(cells))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=128, help="number of heads (128)")
    parser.add_argument("--steps", type=int, default=300, help="Adam steps per variant (300)")
    parser.add_argument("--batch", type=int, default=256, help="shared batch size (256)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and data (0)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (torch's default)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK['heads']} heads, {QUICK['steps']} steps (options given are kept)",
    )
    _cli.add_common_options(parser, NAME, out=False)  # it writes no files
    return parser


def main(argv: Sequence[str] | None = None) -> list[Result]:
    parser = build_parser()
    args = parser.parse_args(argv)
    _cli.apply_quick(parser, args, argv, QUICK)
    if min(args.heads, args.steps, args.batch, args.threads or 1) < 1:
        parser.error("--heads, --steps, --batch and --threads must be positive")
    _cli.require(parser.prog, *_cli.needs(quiet=args.quiet, plot=False))
    if args.threads:
        torch.set_num_threads(args.threads)

    x, y = make_data(args.heads, args.batch, seed=args.seed)
    print(
        f"{args.heads} heads Linear({IN},{HIDDEN})-Tanh-Linear({HIDDEN},{OUT}), shared batch "
        f"{args.batch}, {args.steps} Adam steps (lr {LR}); torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU thread(s)\n"
    )
    results = [
        run(
            name,
            variant,
            make_heads(args.heads, seed=args.seed),
            x,
            y,
            args.steps,
            quiet=args.quiet,
        )
        for name, variant in variants().items()
    ]
    print_table(results)

    base = results[0]
    for r in results[1:]:
        if not torch.allclose(r.losses, base.losses, rtol=RTOL, atol=0.0):
            raise AssertionError(
                f"{r.name}: per-head final losses differ from the loop's by up to "
                f"{relative_gap(r.losses, base.losses):.1e} (relative), more than the "
                f"tolerance {RTOL:.0e}. (Very long runs amplify float32 rounding; see RTOL.)"
            )
    print(
        f"\nAll {args.heads} heads end at the same loss in every variant "
        f"(relative tolerance {RTOL:.0e})."
    )
    return results


if __name__ == "__main__":
    main()
