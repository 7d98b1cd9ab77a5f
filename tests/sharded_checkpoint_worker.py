"""One rank of test_sharded_checkpoint.py's two-rank test (run as a script, not collected).

``python sharded_checkpoint_worker.py DIR`` with MASTER_ADDR, MASTER_PORT, RANK and
WORLD_SIZE=2 set: both ranks save 5 members (3 + 2) to ``DIR``, rank 0 flips one bit in
the middle of rank 1's data file, and both load. Rank 1 reads that file and rank 0 does
not; each prints ``loaded`` or ``ERROR <message>``. Then both save two intact
checkpoints beside it (steps 3 and 6) and each rank loads another one (as a stale
directory listing on one machine would make them), printing ``loaded apart`` or
``APART <message>``. Last, each rank saves to a path of its own, printing ``saved split``
or ``SPLIT <message> metadata=<whether its path holds a .metadata>``.

``python sharded_checkpoint_worker.py DIR optimizer``: an EnsembleOptimizer with
per-member hyperparameters (``adam(lr=LR[rows], weight_decay=WD[rows])``) on 2 ranks.
Both ranks train ``OPT_MEMBERS`` members 2 steps and save them to ``DIR/two-ens`` and
``DIR/two-opt``; load ``DIR/one-ens`` and ``DIR/one-opt`` (saved in one process by the
test), train 3 steps more and save to ``DIR/resumed-ens`` and ``DIR/resumed-opt``,
printing ``resumed``; then load ``DIR/one-opt`` into an optimizer whose rank 1 gives
member 4 another learning rate, printing ``MISMATCH <message> untouched=<whether the
state is unchanged>`` (or ``LOADED`` if it was not refused).
"""

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import funcensemble as fe

# --- an EnsembleOptimizer with per-member hyperparameters (shared with the test) ---------

OPT_MEMBERS = 5
LR = torch.tensor([1e-3, 2e-3, 3e-3, 4e-3, 5e-3], dtype=torch.float64)
WD = torch.tensor([0.0, 0.1, 0.0, 0.2, 0.3], dtype=torch.float64)


def opt_member() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()


def opt_run(
    rows: slice, lr: torch.Tensor = LR, seed: int = 0
) -> tuple[fe.Ensemble, fe.optim.EnsembleOptimizer]:
    """Members ``rows`` of the ensemble and their optimizer, each member with its own
    learning rate and weight decay (a [rows] tensor, as each rank builds its own)."""
    ens = fe.Ensemble.from_factory(opt_member, num_members=OPT_MEMBERS, seed=seed)
    ens = ens.select(list(range(OPT_MEMBERS))[rows])
    return ens, fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr[rows], weight_decay=WD[rows]))


def opt_steps(
    ens: fe.Ensemble, opt: fe.optim.EnsembleOptimizer, rows: slice, first: int, steps: int
) -> None:
    """Steps ``first`` to ``first + steps`` of members ``rows``: each member's batch is
    the same whichever rank holds it, so members step as in one process."""
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(OPT_MEMBERS, 8, 4, dtype=torch.float64, generator=g)[rows]
        opt.zero_grad()
        ens(x, in_dims=0).square().sum().backward()
        opt.step()


def optimizer_main(path: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    shard = fe.distributed.MemberShard(OPT_MEMBERS)
    rows = shard.members
    ens, opt = opt_run(rows)
    opt_steps(ens, opt, rows, 0, 2)
    fe.distributed.save(path / "two-ens", ens, shard)
    fe.distributed.save(path / "two-opt", opt, shard)
    ens, opt = opt_run(rows, seed=1)
    fe.distributed.load(path / "one-ens", ens, shard)
    fe.distributed.load(path / "one-opt", opt, shard)
    opt_steps(ens, opt, rows, 2, 3)
    fe.distributed.save(path / "resumed-ens", ens, shard)
    fe.distributed.save(path / "resumed-opt", opt, shard)
    print("resumed", flush=True)
    lr = LR.clone()
    if shard.rank == 1:
        lr[4] = 7e-3
    _, other = opt_run(rows, lr)
    before = {k: v.clone() for k, v in other.state_dict()["state"].items() if v is not None}
    try:
        fe.distributed.load(path / "one-opt", other, shard)
        print("LOADED", flush=True)
    except ValueError as error:
        after = other.state_dict()["state"]
        untouched = all(torch.equal(v, after[k]) for k, v in before.items())
        print(f"MISMATCH {error} untouched={untouched}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    path = Path(sys.argv[1])
    if sys.argv[2:] == ["optimizer"]:
        optimizer_main(path)
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    shard = fe.distributed.MemberShard(5)
    ens = fe.Ensemble.from_factory(lambda: torch.nn.Linear(4, 2), num_members=5, seed=0)
    params = {k: v.detach()[shard.members].clone() for k, v in ens.stacked_params().items()}
    fe.distributed.save(path, {"params": params, "step": 3}, shard)
    dist.barrier()
    if int(os.environ["RANK"]) == 0:
        data = bytearray((path / "__1_0.distcp").read_bytes())
        data[len(data) // 2] ^= 1
        (path / "__1_0.distcp").write_bytes(data)
    dist.barrier()
    template = {"params": {k: torch.zeros_like(v) for k, v in params.items()}, "step": 0}
    try:
        fe.distributed.load(path, template, shard)
        print("loaded", flush=True)
    except ValueError as error:
        print(f"ERROR {error}", flush=True)
    for step in (3, 6):
        saved = {k: v + step for k, v in params.items()}
        fe.distributed.save(path.parent / f"step-{step}", {"params": saved, "step": step}, shard)
    mine = path.parent / ("step-6" if int(os.environ["RANK"]) == 0 else "step-3")
    try:
        fe.distributed.load(mine, template, shard)
        print("loaded apart", flush=True)
    except ValueError as error:
        print(f"APART {error}", flush=True)
    split = path.parent / f"step-9-rank{os.environ['RANK']}"
    try:
        fe.distributed.save(split, {"params": params, "step": 9}, shard)
        print("saved split", flush=True)
    except fe.distributed.DistributedError as error:
        print(f"SPLIT {error} metadata={(split / '.metadata').exists()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
