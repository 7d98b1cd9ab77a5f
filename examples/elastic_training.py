"""Fault-tolerant training: sharded checkpoints every few steps, resumed after a crash.

Each rank trains its own slice of the members and, every ``--every`` steps, the ranks
write one sharded checkpoint to ``--out/step-<N>/`` (``fe.distributed.save``). At
start-up every rank looks for the newest *complete* checkpoint there and resumes from
it (``fe.distributed.load``). Run it under ``torchrun --max-restarts``: when a rank
dies, torchrun restarts the whole group, and the run carries on from the last
checkpoint. Its result is bitwise the result of a run that never crashed, because
everything a step depends on is either in the checkpoint (parameters, Adam's state,
the step, the batch size) or derived from the step number (each step's batch); a
rerun with another ``--batch``, or fewer ``--steps`` than its newest checkpoint, is
refused::

    torchrun --standalone --nproc_per_node=2 --max-restarts=1 \\
        examples/elastic_training.py --crash-after 30

``--crash-after S`` makes rank ``--crash-rank`` kill itself (SIGKILL, as a lost node
would) after step S, once: it leaves a marker file in ``--out``, so the restarted
group runs to the end. Without torchrun the script runs as one process holding every
member. Checkpoints need a directory every rank can reach (one filesystem shared by
all machines). ``--quick`` is a seconds-long run.
"""

import argparse
import os
import re
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _cli
import torch
import torch.distributed as dist
from torch import Tensor, nn

import funcensemble as fe

NAME = "elastic_training"
QUICK = {"members": 5, "steps": 12, "every": 4}
COMPLETE = ".funcensemble-checksums"  # fe.distributed.save writes it last, after every rank
MARKER = ".crashed-once"


def make_member() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def dataset(samples: int = 128) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 3, generator=g, dtype=torch.float64)
    return x, (x.sin().sum(1, keepdim=True) + 0.1 * torch.randn(samples, 1, generator=g))


def batch_rows(step: int, members: int, samples: int, batch: int) -> Tensor:
    """Step ``step``'s sample indices for all members, drawn from the step number alone,
    so that a resumed run draws the same batches as one that never stopped."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(samples, (members, batch), generator=g)


def checkpoint(out: Path, step: int) -> Path:
    return out / f"step-{step:06d}"


def complete_steps(out: Path) -> list[int]:
    """The steps of the complete checkpoints in ``out``, oldest first."""
    found = (re.fullmatch(r"step-(\d+)", p.name) for p in out.glob("step-*"))
    return sorted(int(m.group(1)) for m in found if m and (out / m.group(0) / COMPLETE).is_file())


def remove_incomplete(out: Path) -> None:
    """Rank 0: delete what a save killed half-way left behind, so it can be written anew."""
    for path in out.glob("step-*"):
        ours = re.fullmatch(r"step-\d+", path.name) and path.is_dir()
        if ours and not (path / COMPLETE).is_file():
            shutil.rmtree(path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=16, help="ensemble size, all ranks (16)")
    parser.add_argument("--steps", type=int, default=200, help="Adam steps (200)")
    parser.add_argument("--every", type=int, default=20, help="checkpoint every N steps (20)")
    parser.add_argument("--keep", type=int, default=2, help="complete checkpoints kept (2)")
    parser.add_argument("--batch", type=int, default=16, help="samples per member per step (16)")
    parser.add_argument(
        "--crash-after",
        type=int,
        default=None,
        metavar="S",
        help="kill one rank (SIGKILL) after step S, on the first attempt only",
    )
    parser.add_argument(
        "--crash-rank", type=int, default=1, help="the rank that --crash-after kills (1)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK['members']} members, {QUICK['steps']} steps, "
        f"a checkpoint every {QUICK['every']} (options given are kept)",
    )
    _cli.add_common_options(parser, NAME)
    return parser


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    _cli.apply_quick(parser, args, argv, QUICK)
    if min(args.members, args.steps, args.every, args.keep, args.batch) < 1:
        parser.error("--members, --steps, --every, --keep and --batch must be positive")
    if args.crash_after is not None and not 1 <= args.crash_after < args.steps:
        parser.error(f"--crash-after must be a step from 1 to --steps - 1 ({args.steps - 1})")
    _cli.require(parser.prog, *_cli.needs(quiet=args.quiet, plot=False))
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    launched = "WORLD_SIZE" in os.environ  # set by torchrun
    if launched:
        fe.distributed.init_process_group("gloo")
    try:
        return train(args)
    finally:
        if launched:
            dist.destroy_process_group()


def train(args: argparse.Namespace) -> dict[str, Any]:
    shard = fe.distributed.MemberShard(args.members)
    say = print if shard.rank == 0 else (lambda *a, **k: None)
    if args.crash_after is not None and not 0 <= args.crash_rank < shard.world_size:
        raise SystemExit(
            f"--crash-rank {args.crash_rank} is not a rank of this run (0 to "
            f"{shard.world_size - 1}): --crash-after would kill nothing"
        )
    if shard.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        remove_incomplete(args.out)
    if shard.world_size > 1:
        dist.barrier()  # nobody looks for checkpoints before rank 0 has tidied up

    ens = shard.from_factory(make_member, seed=0)
    fmodel = ens.fmodel
    params = {k: v.detach() for k, v in ens.stacked_params().items()}
    buffers = dict(ens.stacked_buffers())
    opt = fe.optim.adam(1e-2)
    # The batch size is saved too: a run resumed with another one would match neither.
    run = {"params": params, "opt": opt.init(params), "step": 0, "batch": args.batch}
    steps = complete_steps(args.out)
    newest = [steps[-1] if steps else None]
    if dist.is_initialized():
        # Rank 0's choice for all: another machine's stale listing must not pick
        # another step (load refuses ranks that read different checkpoints).
        dist.broadcast_object_list(newest, src=0)
    if newest[0] is not None:
        # Every rank reads its own members' rows, whatever world size wrote them.
        where = checkpoint(args.out, newest[0])
        try:
            run = fe.distributed.load(where, run, shard)
        except ValueError as error:
            if "missing leaf `batch`" not in str(error):
                raise
            raise SystemExit(
                f"{where} was written by an earlier version of this example, which did not "
                "save --batch: pass a new --out"
            ) from None
        if run["batch"] != args.batch or run["step"] > args.steps:
            raise SystemExit(
                f"{where} was written with --batch {run['batch']} at step {run['step']}, "
                f"and this run asks for --batch {args.batch} and --steps {args.steps}: resume "
                "with the same --batch and --steps at least that step, or pass a new --out"
            )
        say(f"resumed from step {run['step']} ({where})")
    say(f"{args.members} members on {shard.world_size} rank(s), from step {run['step']}")

    x, y = dataset()
    step_fn = fe.value_and_grad(
        lambda p, b, xb, yb: nn.functional.mse_loss(fmodel(p, b, xb), yb), in_dims=0
    )
    params, state = run["params"], run["opt"]
    bar = _cli.progress(
        range(run["step"], args.steps), quiet=args.quiet or shard.rank != 0, desc="training"
    )
    for s in bar:
        rows = shard.select(batch_rows(s, args.members, x.shape[0], args.batch))
        _, grads, buffers = step_fn(params, buffers, x[rows], y[rows])
        updates, state = opt.update(grads, state, params)
        params = fe.optim.apply_updates(params, updates)
        done = s + 1
        if done % args.every == 0 or done == args.steps:
            fe.distributed.save(
                checkpoint(args.out, done),
                {"params": params, "opt": state, "step": done, "batch": args.batch},
                shard,
            )
            if shard.rank == 0:  # save returns once every rank's part is written
                for old in complete_steps(args.out)[: -args.keep]:
                    shutil.rmtree(checkpoint(args.out, old))
        if (
            args.crash_after is not None
            and done == args.crash_after
            and shard.rank == args.crash_rank
            and not (args.out / MARKER).exists()
        ):
            (args.out / MARKER).touch()
            print(f"rank {shard.rank}: killing itself after step {done}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    bar.close()
    losses = ((fe.vmap(fmodel)(params, buffers, x) - y) ** 2).mean((1, 2))  # [my members]
    mean_loss = fe.distributed.mean(losses, shard)
    say(f"done: step {args.steps}, mean loss over all members {mean_loss.item():.4f}")
    return {"params": params, "opt": state, "step": args.steps}


if __name__ == "__main__":
    main()
