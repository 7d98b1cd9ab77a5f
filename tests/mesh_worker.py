"""One rank of test_mesh.py's four-rank run (run as a script, not collected).

``python mesh_worker.py OUTDIR`` with the launcher's environment (4 ranks). In one
launch, on three meshes of the same 4 processes: (2, 2), (1, 4) and (4, 1) as
``("member", "data")``, it trains the members data-parallel, counts the all-reduces
each step makes, and writes every rank's gathered parameters to OUTDIR; the (2, 2) run
saves a sharded checkpoint that the (1, 4) and (4, 1) runs load, and the (4, 1) run
saves one that the test loads in one process. ``train`` is also what the test runs in
a single process, on the whole batch, as the reference.
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
from funcensemble.distributed._errors import group_timeout

NUM_MEMBERS = 5  # uneven on 2 member ranks (3 + 2) and on 4 (2 + 1 + 1 + 1)
STEPS, BATCH = 4, 8  # 8 samples per member per step: split into 1, 2 or 4 equal parts
SHAPES = [(2, 2), (1, 4), (4, 1)]


def make_member() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def batches() -> tuple[Tensor, Tensor]:
    """Every member's own batches, ``[STEPS, N, BATCH, ...]``, from a shared seed."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, NUM_MEMBERS, BATCH, 3, generator=g, dtype=torch.float64)
    return x, torch.sin(x[..., :2]) + x[..., 2:]


def train(
    shard: fe.distributed.MemberShard, calls: list[int] | None = None
) -> tuple[dict[str, Any], list[int]]:
    """Adam on this rank's members and its part of every batch, gradients averaged.

    Returns the run's state and, per step, how many entries ``average_gradients``
    added to ``calls`` (one per all-reduce, where the caller counts them).
    """
    calls = [] if calls is None else calls
    per_step = []
    ens = shard.from_factory(make_member, seed=0)
    params = {k: v.detach() for k, v in ens.stacked_params().items()}
    buffers = dict(ens.stacked_buffers())
    opt = fe.optim.adam(1e-2)
    state = opt.init(params)
    x, y = batches()
    mine = shard.batch_slice(BATCH)

    def loss_fn(p, b, xb, yb):
        return nn.functional.mse_loss(ens.fmodel(p, b, xb), yb)

    step = fe.value_and_grad(loss_fn, in_dims=0)
    for t in range(STEPS):
        xb, yb = x[t, shard.members, mine], y[t, shard.members, mine]
        _, grads, buffers = step(params, buffers, xb, yb)
        before = len(calls)
        grads = fe.distributed.average_gradients(grads, shard)
        per_step.append(len(calls) - before)
        updates, state = opt.update(grads, state, params)
        params = fe.optim.apply_updates(params, updates)
    return {"params": params, "buffers": buffers, "opt": state, "step": STEPS}, per_step


def template(shard: fe.distributed.MemberShard) -> dict[str, Any]:
    ens = shard.from_factory(make_member, seed=123)
    params = {k: v.detach() for k, v in ens.stacked_params().items()}
    return {
        "params": params,
        "buffers": dict(ens.stacked_buffers()),
        "opt": fe.optim.adam(1e-2).init(params),
        "step": 0,
    }


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    calls: list[int] = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        results: dict[str, Any] = {}
        for m, d in SHAPES:
            if (m, d) == (2, 2):  # the library's mesh: its groups keep the 60 s timeout
                mesh = fe.distributed.init_mesh(m, d)
                results["timeouts"] = [
                    group_timeout(mesh.get_group(axis)).total_seconds()
                    for axis in ("member", "data")
                ]
            else:
                mesh = init_device_mesh("cpu", (m, d), mesh_dim_names=("member", "data"))
            shard = fe.distributed.MemberShard(NUM_MEMBERS, mesh=mesh)
            run, per_step = train(shard, calls)
            name = f"{m}x{d}"
            results[name] = {
                "coords": (shard.rank, shard.data_rank, shard.sizes),
                "all_reduces_per_step": per_step,
                "params": fe.distributed.all_gather(run["params"], shard),
                "mu": fe.distributed.all_gather(run["opt"][0].mu, shard),
            }
            if name == "2x2":
                fe.distributed.save(out / "ckpt_2x2", run, shard)
                # Replicas whose rows differ (like BatchNorm statistics): replica 0's are saved.
                rows = torch.arange(shard.members.start, shard.members.stop, dtype=torch.float64)
                stats = rows[:, None] + 100.0 * shard.data_rank
                fe.distributed.save(out / "stats_2x2", {"stats": stats.repeat(1, 2)}, shard)
                # Replicas that disagree on N are refused on every rank of the mesh.
                try:
                    fe.distributed.MemberShard(NUM_MEMBERS + shard.data_rank, mesh=mesh)
                except ValueError as error:
                    results["disagree"] = str(error)
                # Member groups passing predict other src or reductions: every rank raises
                # (the ranks of one group agreed, and waited for the timeout).
                model = lambda x, n=shard.size: torch.zeros(n, x.shape[0], 2)  # noqa: E731
                for key, kwargs in (
                    ("src", {"src": shard.rank}),
                    ("reductions", {"reductions": ["mean"] if shard.rank else ["max"]}),
                ):
                    try:
                        fe.distributed.predict(model, shard, torch.ones(4, 3), **kwargs)
                    except ValueError as error:
                        results[f"predict {key}"] = str(error)
            else:
                loaded = fe.distributed.load(out / "ckpt_2x2", template(shard), shard)
                results[name]["loaded"] = {
                    "params": fe.distributed.all_gather(loaded["params"], shard),
                    "mu": fe.distributed.all_gather(loaded["opt"][0].mu, shard),
                    "step": loaded["step"],
                }
            if name == "4x1":
                fe.distributed.save(out / "ckpt_4x1", run, shard)
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.all_reduce = real_all_reduce
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
