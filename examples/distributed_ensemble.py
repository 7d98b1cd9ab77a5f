"""A bagged regression ensemble whose members are spread over processes with torch.distributed.

Each rank builds and trains only its own members (a contiguous slice): members are
independent, so training needs no communication at all, not even a gradient
all-reduce. Every rank draws the same data from the same seed; each member trains on
its own bootstrap sample (bagging). Collectives are used only to look at all members
at once (the ensemble's mean prediction and its spread, the epistemic uncertainty),
and the trained members are written as one sharded checkpoint that loads at any world
size, or into an ordinary single-process ``fe.Ensemble``.

Run it with two processes on one machine (gloo on the CPU, NCCL on GPUs)::

    torchrun --standalone --nproc_per_node=2 examples/distributed_ensemble.py

``--data-parallel D`` arranges the W ranks as a ``(W / D, D)`` mesh of
``("member", "data")``: the members are split over W / D ranks, and each member's batch
over D replicas, whose gradients are averaged every step (one all-reduce), so the
members train exactly as with one process on the whole batch (up to rounding)::

    torchrun --standalone --nproc_per_node=4 examples/distributed_ensemble.py --data-parallel 2

or without torchrun, as one process holding every member. ``--quick`` is a seconds-long
smoke run. The checkpoint goes to ``--out`` (default ``./out/distributed_ensemble/``).
Rank 0's progress bar needs tqdm (``pip install '.[examples]'``); ``--quiet``
runs without it.
"""

import argparse
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

import _cli
import torch
import torch.distributed as dist
from torch import Tensor, nn

import funcensemble as fe

NAME = "distributed_ensemble"

QUICK = {"members": 8, "steps": 20}


def make_member(hidden: int = 32) -> nn.Module:
    return nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def dataset(samples: int) -> tuple[Tensor, Tensor]:
    """Noisy sin(2x) on two separate intervals: members disagree in the gap between."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.rand(samples // 2, 1, generator=g) * 2 - 3,
            torch.rand(samples - samples // 2, 1, generator=g) * 2 + 1,
        ]
    )
    return x, torch.sin(2 * x) + 0.1 * torch.randn(x.shape, generator=g)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=64, help="ensemble size, all ranks (64)")
    parser.add_argument("--steps", type=int, default=1000, help="Adam steps (1000)")
    parser.add_argument("--batch", type=int, default=32, help="samples per member per step (32)")
    parser.add_argument("--samples", type=int, default=256, help="training points (256)")
    parser.add_argument(
        "--data-parallel",
        type=int,
        default=1,
        metavar="D",
        help="data-parallel replicas of each member slice; divides the number of ranks (1)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK['members']} members, {QUICK['steps']} steps (options given "
        "are kept)",
    )
    _cli.add_common_options(parser, NAME)
    return parser


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    _cli.apply_quick(parser, args, argv, QUICK)
    if args.members < 1 or args.steps < 1 or args.data_parallel < 1 or args.batch < 1:
        parser.error("--members, --steps, --batch and --data-parallel must be positive")
    if args.members < 2:  # (the spread reported at the end needs two)
        parser.error("--members must be at least 2: the run reports the members' spread")
    if args.samples < 2:
        parser.error("--samples must be at least 2 (one point on each interval)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % args.data_parallel:
        parser.error(f"--data-parallel {args.data_parallel} does not divide the {world} ranks")
    if args.batch % args.data_parallel:
        parser.error(f"--data-parallel {args.data_parallel} does not divide --batch {args.batch}")
    _cli.require(parser.prog, *_cli.needs(quiet=args.quiet, plot=False))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    launched = "WORLD_SIZE" in os.environ  # set by torchrun
    # A short timeout: a rank that dies or hangs makes the others fail within a minute.
    device = fe.distributed.init_process_group() if launched else torch.device("cpu")
    try:
        train(args, device)
    finally:
        if launched:
            dist.destroy_process_group()


def remove_previous_checkpoint(out: Path) -> None:
    """Remove a previous run's checkpoint from ``out`` (or what a killed save left of
    one): all of its files, and only those.

    fe.distributed.save never overwrites a checkpoint in place (a crash mid-save would
    corrupt it). The checksum file goes first, so that no removal or save cut short
    leaves it beside files it does not describe (load would call them corrupt).
    """
    for old in [out / ".funcensemble-checksums", out / ".metadata", *sorted(out.glob("*.distcp"))]:
        old.unlink(missing_ok=True)


def train(args: argparse.Namespace, device: torch.device) -> None:
    if dist.is_initialized():
        # The ranks as a (members, data) mesh: members split over the first axis, each
        # member's batch over the second.
        d = args.data_parallel
        # (fe.distributed.init_mesh: the mesh's groups keep the process group's timeout)
        mesh = fe.distributed.init_mesh(dist.get_world_size() // d, d)
        shard = fe.distributed.MemberShard(args.members, mesh=mesh)  # this rank's members
        first = dist.get_rank() == 0
    else:
        shard, first = fe.distributed.MemberShard(args.members), True
    say = print if first else (lambda *a, **k: None)
    if first:
        # The other ranks look at --out only when they save, many collectives later.
        remove_previous_checkpoint(args.out)
    say(
        f"{args.members} members on {shard.world_size} ranks "
        f"({', '.join(map(str, shard.sizes))} members each), device {device.type}"
        + (
            f"; each member's batch split over {shard.data_size} data replicas"
            * (shard.data_size > 1)
        )
    )
    # Only this rank's members are built, each exactly as in a single-process ensemble.
    ens = shard.from_factory(make_member, seed=0).to(device)
    fmodel = ens.fmodel
    params = {k: v.detach() for k, v in ens.stacked_params().items()}
    buffers = dict(ens.stacked_buffers())

    # Same seed on every rank: the same data, and the same bootstrap draws for all N
    # members, of which each rank keeps its own rows.
    x, y = (t.to(device) for t in dataset(args.samples))
    bags = shard.select(
        fe.bootstrap_indices(args.members, args.samples, generator=torch.Generator().manual_seed(1))
    ).to(device)
    picks = torch.Generator().manual_seed(2)

    def loss_fn(p, b, xb, yb):
        return nn.functional.mse_loss(fmodel(p, b, xb), yb)

    step = fe.value_and_grad(loss_fn, in_dims=0)
    opt = fe.optim.adam(1e-2)
    # Every rank must train alike: a rank with another learning rate or batch size
    # would make its members differ from the single-process run. Checked once, here.
    shard.check_agreement(optimizer=opt, batch=args.batch, samples=args.samples)
    state = opt.init(params)
    start = time.perf_counter()
    part = shard.batch_slice(args.batch)  # this data replica's samples of each batch
    bar = _cli.progress(range(args.steps), quiet=args.quiet or not first, desc="training")
    for s in bar:
        columns = torch.randint(args.samples, (args.members, args.batch), generator=picks)
        rows = bags.gather(1, shard.select(columns).to(device))[:, part]  # [my members, part]
        losses, grads, buffers = step(params, buffers, x[rows], y[rows])
        # The gradient of the loss on the whole batch: one all-reduce over the replicas.
        grads = fe.distributed.average_gradients(grads, shard)
        updates, state = opt.update(grads, state, params)
        params = fe.optim.apply_updates(params, updates)
        if s % max(1, args.steps // 5) == 0 or s == args.steps - 1:
            losses = fe.distributed.average_gradients(losses, shard)  # the whole batch's
            mean_loss = fe.distributed.mean(losses, shard)  # over all members, all ranks
            if first:
                bar.write(
                    f"step {s:4d}: mean training loss over all members {mean_loss.item():.4f}"
                )
                bar.set_postfix(mean_loss=f"{mean_loss.item():.4f}")
    bar.close()
    per_step = (time.perf_counter() - start) / args.steps

    # Predictions of all members, reduced across ranks: mean and disagreement.
    grid = torch.linspace(-4, 4, 9, device=device).unsqueeze(1)
    preds = fe.vmap(fmodel)(params, buffers, grid)[..., 0]  # [my members, 9]
    mean, spread = fe.distributed.mean(preds, shard), fe.distributed.std(preds, shard)
    say("     x   truth    mean  spread (members' std: large away from the data)")
    for xi, m, sd in zip(grid[:, 0].tolist(), mean.tolist(), spread.tolist(), strict=True):
        say(f"{xi:6.1f} {math.sin(2 * xi):7.3f} {m:7.3f} {sd:7.3f}")

    with torch.no_grad():
        for name, t in ens.stacked_params().items():
            t.copy_(params[name])
    fe.distributed.save(args.out, ens, shard)
    say(f"{per_step * 1e3:.2f} ms per step; sharded checkpoint written to {args.out}")


if __name__ == "__main__":
    main()
