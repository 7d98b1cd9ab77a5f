"""One rank of test_distributed.py's four-rank run (run as a script, not collected).

``python groups_worker.py OUTDIR`` with the launcher's environment (4 ranks). In one
launch:

- ``subgroups``: two ensembles of ``NUM_MEMBERS`` on the process groups {0, 1} and
  {2, 3} (``MemberShard(N, group=...)``), each with its own weights and its own batch,
  each calling ``predict(..., src=0)`` (the group's first rank, as ``shard.rank``
  counts) and ``predict(..., src=2)`` (no rank of a group of 2: refused), and ``var``
  and ``std`` of float32 outputs that nearly agree.
- ``structures``: on the default group, ``all_gather`` and ``broadcast`` of pytrees
  whose keys differ between ranks (equal leaf shapes), of a tensor on some ranks and a
  dict on others, and of an empty dict on one rank: every rank must raise, naming the
  keys; dicts whose keys only come in another order are gathered key by key.
- ``batchnorm``: on a ``(2, 2)`` ``("member", "data")`` mesh, ``predict`` of members
  with BatchNorm in train mode (refused before anything runs: each replica would
  normalize its own half of the batch) and in eval mode (the whole batch's result).
- ``bagging``: on the same mesh, SGD steps of members trained on Poisson bootstrap
  weights (``fe.bootstrap_masks`` + ``fe.weighted_mean``), each replica on its half of
  the batch, gradients combined by ``average_gradients(grads, shard, weights=...)``.

Each rank writes what the test compares to ``OUTDIR/rankR.pt``; ``make_member``,
``batch`` and ``near_agreement`` are also what the test uses for the one-process
reference.
"""

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

import funcensemble as fe

NUM_MEMBERS = 3  # 2 + 1 on each group of 2
GROUPS = ([0, 1], [2, 3])


def make_member() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def batch(group: int) -> Tensor:
    """Each group's own batch: a group that ran the other's would show."""
    g = torch.Generator().manual_seed(10 + group)
    return torch.randn(4, 3, generator=g, dtype=torch.float64) + 3 * group


def near_agreement(group: int) -> Tensor:
    """``[N, 64]`` float32 outputs around 1e3 within 1e-4."""
    g = torch.Generator().manual_seed(20 + group)
    return (1e3 + 1e-4 * torch.randn(NUM_MEMBERS, 64, generator=g, dtype=torch.float64)).float()


def error(action: Any) -> str:
    try:
        action()
    except ValueError as e:
        return str(e)
    return "no error"


def subgroups(rank: int) -> dict[str, Any]:
    groups = [dist.new_group(ranks) for ranks in GROUPS]  # every rank builds every group
    which = 0 if rank in GROUPS[0] else 1
    shard = fe.distributed.MemberShard(NUM_MEMBERS, group=groups[which])
    ens = shard.from_factory(make_member, seed=which)
    x = batch(which) if shard.rank == 0 else torch.empty(4, 3, dtype=torch.float64)
    values = near_agreement(which)[shard.members]
    return {
        "group": which,
        "predict": fe.distributed.predict(ens, shard, x, src=0, reductions=["mean", "std"]),
        "src outside the group": error(lambda: fe.distributed.predict(ens, shard, x, src=2)),
        "var": fe.distributed.var(values, shard),
        "std": fe.distributed.std(values, shard),
    }


def structures(rank: int) -> dict[str, Any]:
    shard = fe.distributed.MemberShard(4)  # one member per rank
    ones = torch.full((1, 3), float(rank))
    keys = {"mu": ones, "sigma": ones} if rank % 2 == 0 else {"log_sigma": ones, "mu": ones}
    d = fe.distributed
    out = {
        "gather keys": error(lambda: d.all_gather(keys, shard)),
        "broadcast keys": error(lambda: d.broadcast(keys)),
        "gather tensor or dict": error(lambda: d.all_gather(ones if rank else {"x": ones}, shard)),
        "gather empty": error(lambda: d.all_gather({} if rank == 3 else {"x": ones}, shard)),
        # Each rank its own src: each kept its own values, as if broadcast.
        "broadcast src": error(lambda: d.broadcast({"x": ones}, src=rank % 2)),
    }
    # Insertion order is no structure: dicts are gathered key by key.
    ordered = {"a": ones, "b": 2 * ones} if rank % 2 else {"b": 2 * ones, "a": ones}
    out["gathered"] = d.all_gather(ordered, shard)
    return out


def make_normed() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 4)).double()


def halves() -> Tensor:
    """A batch whose halves differ: normalizing each half on its own would show."""
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(30), dtype=torch.float64)
    x[4:] += 3.0
    return x


def batchnorm() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("member", "data"))
    shard = fe.distributed.MemberShard(NUM_MEMBERS, mesh=mesh)
    ens = shard.from_factory(make_normed, seed=0)
    before = {k: v.clone() for k, v in ens.stacked_buffers().items()}
    names = ["mean", "mean_probs"]
    out = {"train": error(lambda: fe.distributed.predict(ens, shard, halves(), reductions=names))}
    out["buffers unchanged"] = all(
        torch.equal(v, before[k]) for k, v in ens.stacked_buffers().items()
    )
    out["eval"] = fe.distributed.predict(ens.eval(), shard, halves(), reductions=names)
    # Without running statistics BatchNorm takes the batch's in eval mode too.
    untracked = shard.from_factory(
        lambda: nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8, track_running_stats=False)),
        seed=0,
    ).eval()
    out["untracked"] = error(lambda: fe.distributed.predict(untracked, shard, halves()))
    return out


BAGGING_STEPS, BAGGING_BATCH = 3, 16


def bagging_data(step: int) -> tuple[Tensor, Tensor, Tensor]:
    """The whole batch and every member's Poisson bootstrap weights ``[N, B]``."""
    g = torch.Generator().manual_seed(40 + step)
    x = torch.randn(BAGGING_BATCH, 3, generator=g, dtype=torch.float64)
    y = torch.randn(BAGGING_BATCH, 2, generator=g, dtype=torch.float64)
    w = fe.bootstrap_masks(
        NUM_MEMBERS, BAGGING_BATCH, distribution="poisson", dtype=torch.float64, generator=g
    )
    return x, y, w


def bagging() -> dict[str, Tensor]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("member", "data"))
    shard = fe.distributed.MemberShard(NUM_MEMBERS, mesh=mesh)
    ens = shard.from_factory(make_member, seed=0)
    params = {k: v.detach() for k, v in ens.stacked_params().items()}
    buffers = dict(ens.stacked_buffers())
    opt = fe.optim.sgd(lr=0.1)
    state = opt.init(params)
    part = shard.batch_slice(BAGGING_BATCH)

    def loss_fn(p, b, x, y, w):
        per_sample = ((ens.fmodel(p, b, x) - y) ** 2).mean(-1)
        return fe.weighted_mean(per_sample, w)

    step = fe.value_and_grad(loss_fn, in_dims=(None, None, 0))
    for t in range(BAGGING_STEPS):
        x, y, w = bagging_data(t)
        mine = w[shard.members][:, part]
        _, grads, buffers = step(params, buffers, x[part], y[part], mine)
        grads = fe.distributed.average_gradients(grads, shard, weights=mine)
        updates, state = opt.update(grads, state, params)
        params = fe.optim.apply_updates(params, updates)
    return fe.distributed.all_gather(params, shard)


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    results = {
        "subgroups": subgroups(rank),
        "structures": structures(rank),
        "batchnorm": batchnorm(),
        "bagging": bagging(),
    }
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
