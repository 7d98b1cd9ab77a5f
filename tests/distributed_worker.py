"""One rank of the multi-process tests in test_distributed.py (run as a script, not collected).

``python distributed_worker.py OUTDIR [--train] [--save DIR] [--load DIR] [--fail MODE]
[--disagree] [--timeout SECONDS] [--join-timeout SECONDS]``,
with the launcher's environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE). Rank 0
writes what the test compares to OUTDIR as torch files. ``train_members`` is also what
the test runs in a single process as the reference.
"""

import argparse
import functools
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

import funcensemble as fe

NUM_MEMBERS = 5  # uneven on 2 ranks (3 + 2), 3 ranks (2 + 2 + 1) and 4 ranks (2 + 1 + 1 + 1)
STEPS = 3
SAMPLES, BATCH = 32, 8
SEED = 0


def make_member() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2)).double()


def dataset() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 4, generator=g, dtype=torch.float64)
    return x, torch.sin(x @ torch.randn(4, 2, generator=g, dtype=torch.float64))


def test_inputs() -> Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def train_members(ens: fe.Ensemble, shard: fe.distributed.MemberShard) -> dict[str, Any]:
    """Bagging: each member trains on its own bootstrap sample, drawn from a shared seed."""
    x, y = dataset()
    # Every rank draws the indices of all N members from the same seed, then keeps its own.
    indices = fe.bootstrap_indices(
        shard.num_members, SAMPLES, generator=torch.Generator().manual_seed(3)
    )
    mine = shard.select(indices)  # [my members, SAMPLES]
    fmodel = ens.fmodel
    params = {k: v.detach() for k, v in ens.stacked_params().items()}
    buffers = dict(ens.stacked_buffers())
    opt = fe.optim.adam(1e-2)
    state = opt.init(params)

    def loss_fn(p, b, xb, yb):
        return torch.nn.functional.mse_loss(fmodel(p, b, xb), yb)

    step = fe.value_and_grad(loss_fn, in_dims=0)
    for s in range(STEPS):
        rows = mine[:, s * BATCH : (s + 1) * BATCH]  # [my members, BATCH]
        _, grads, buffers = step(params, buffers, x[rows], y[rows])
        updates, state = opt.update(grads, state, params)
        params = fe.optim.apply_updates(params, updates)
    return {"params": params, "buffers": buffers, "opt": state, "step": STEPS}


def look_at_all_members(run: dict[str, Any], ens: fe.Ensemble, shard) -> dict[str, Tensor]:
    """Predictions and reductions over all N members (collectives across ranks)."""
    d = fe.distributed
    preds = fe.vmap(ens.fmodel)(run["params"], run["buffers"], test_inputs())[..., 0]
    return {
        "params": d.all_gather(run["params"], shard),
        "mu": d.all_gather(run["opt"][0].mu, shard),
        "preds": d.all_gather(preds, shard),
        "mean": d.mean(preds, shard),
        # float16 values whose sum over members (not their mean) passes float16's 65504.
        "half_mean": d.mean((20000 + 300 * preds).half(), shard),
        "half_var": d.var((20000 + 300 * preds).half(), shard),
        "var": d.var(preds, shard),
        "std": d.std(preds, shard, correction=0),
        "min": d.min(preds, shard),
        "max": d.max(preds, shard),
        "subset_min": d.subset_min(preds, shard, 2, generator=torch.Generator().manual_seed(7)),
        "subset_min_per_sample": d.subset_min(
            preds, shard, 3, generator=torch.Generator().manual_seed(8), per_sample=True
        ),
        "positive": d.all_gather(preds > 0, shard),  # bools travel as bytes
        "int_min": d.min((preds * 100).long(), shard),
        "int_subset_min": d.subset_min(
            (preds * 100).long(), shard, 2, generator=torch.Generator().manual_seed(9)
        ),
    }


def template(shard) -> dict[str, Any]:
    """This rank's fresh structure to load into: other weights, zero optimizer state."""
    ens = shard.from_factory(make_member, seed=123)
    params = {k: v.detach() for k, v in ens.stacked_params().items()}
    return {
        "params": params,
        "buffers": dict(ens.stacked_buffers()),
        "opt": fe.optim.adam(1e-2).init(params),
        "step": 0,
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--save", type=Path)
    parser.add_argument("--load", type=Path)
    parser.add_argument("--fail", choices=["raise", "hang", "kill", "unshared"])
    parser.add_argument("--disagree", action="store_true")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--join-timeout", type=float, default=None)
    args = parser.parse_args(argv)
    join = None if args.join_timeout is None else timedelta(seconds=args.join_timeout)

    started = time.monotonic()
    try:
        fe.distributed.init_process_group(
            timeout=timedelta(seconds=args.timeout), join_timeout=join
        )
    finally:  # the fault tests read how long the rendezvous took, or took to fail
        print(f"init_process_group returned after {time.monotonic() - started:.2f} s", flush=True)
    try:
        rank = dist.get_rank()
        results: dict[str, Any] = {"world_size": dist.get_world_size()}
        if args.fail:
            fail(args.fail, rank, args.out)
        if args.disagree:
            disagree(rank, args.out)
            return
        shard = fe.distributed.MemberShard(NUM_MEMBERS)
        results["sizes"] = shard.sizes
        # Rank 1's batch, everywhere (the others' values are ignored).
        got = fe.distributed.broadcast({"x": torch.full((3,), float(rank))}, src=1)
        assert torch.equal(got["x"], torch.ones(3)), f"rank {rank} received {got}"
        if args.train:
            ens = shard.from_factory(make_member, seed=SEED)
            run = train_members(ens, shard)
            results["trained"] = look_at_all_members(run, ens, shard)
            if args.save:  # the functional state, and the trained members as an Ensemble
                fe.distributed.save(args.save / "run", run, shard)
                with torch.no_grad():
                    for name, t in ens.stacked_params().items():
                        t.copy_(run["params"][name])
                fe.distributed.save(args.save / "ensemble", ens, shard)
        if args.load:
            loaded = fe.distributed.load(args.load / "run", template(shard), shard)
            ens = shard.from_factory(make_member, seed=9)
            fe.distributed.load(args.load / "ensemble", ens)  # shard from the checkpoint
            results["loaded"] = {
                "params": fe.distributed.all_gather(loaded["params"], shard),
                "mu": fe.distributed.all_gather(loaded["opt"][0].mu, shard),
                "count": loaded["opt"][0].count,
                "step": loaded["step"],
                "ensemble": fe.distributed.all_gather(dict(ens.stacked_params()), shard),
            }
        if rank == 0:
            torch.save(results, args.out / "results.pt")
    finally:
        dist.destroy_process_group()


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return x * self.factor


def _double(module: nn.Module, inputs: Any, output: Tensor) -> Tensor:
    return output * 2


def _triple(module: nn.Module, inputs: Any, output: Tensor) -> Tensor:
    return output * 3


def _decayed(count: Tensor, base: float) -> Tensor:
    return base * 0.5 ** count.double()


def disagree(rank: int, out: Path) -> None:
    """Set-ups that differ between ranks: every rank must raise the same clear error."""
    messages = {}

    def expect_error(name: str, action) -> None:
        try:
            action()
        except ValueError as error:
            messages[name] = str(error)
        except (TypeError, OSError, RuntimeError) as error:
            messages[name] = f"{type(error).__name__}: {error}"
        else:
            messages[name] = None  # the test fails on this

    expect_error("N", lambda: fe.distributed.MemberShard(NUM_MEMBERS + rank))
    shard = fe.distributed.MemberShard(NUM_MEMBERS)
    width = 16 if rank == 0 else 8
    expect_error(
        "architecture",
        lambda: shard.from_factory(lambda: nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2))),
    )
    expect_error(
        "slope",  # a non-tensor setting: only the architecture fingerprint can tell
        lambda: shard.from_factory(
            lambda: nn.Sequential(nn.Linear(4, 2), nn.LeakyReLU(0.1 * rank))
        ),
    )
    expect_error(  # an attribute of a custom module: neither a tensor nor in extra_repr
        "attribute", lambda: shard.from_factory(lambda: nn.Sequential(nn.Linear(4, 2), Scale(rank)))
    )
    hook = _double if rank == 0 else _triple

    def hooked() -> nn.Module:
        member = make_member()
        member.register_forward_hook(hook)
        return member

    expect_error("hook", lambda: shard.from_factory(hooked))
    dtype = torch.float64 if rank == 0 else torch.float32
    expect_error("dtype", lambda: shard.from_factory(lambda: make_member().to(dtype)))
    ens = shard.from_factory(make_member, seed=SEED)  # alike on every rank: no error
    params = {k: v.detach() for k, v in ens.stacked_params().items()}
    renamed = params if rank == 0 else {f"net.{k}": v for k, v in params.items()}
    expect_error("names", lambda: shard.check_agreement({"params": renamed}))
    betas = (0.9, 0.999) if rank == 0 else (0.9, 0.99)
    expect_error("betas", lambda: shard.check_agreement(optimizer=fe.optim.adam(1e-2, betas=betas)))
    # A schedule's number written in its body (code constants, not closure cells)...
    schedule = (lambda c: 0.01 + 0 * c) if rank == 0 else (lambda c: 0.001 + 0 * c)
    expect_error("schedule", lambda: shard.check_agreement(optimizer=fe.optim.adam(schedule)))
    base = 1e-2 if rank == 0 else 1e-3  # ... or bound by functools.partial
    expect_error(
        "partial",
        lambda: shard.check_agreement(
            optimizer=fe.optim.adam(functools.partial(_decayed, base=base))
        ),
    )
    torch_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1 * (rank + 1))
    expect_error("torch.optim", lambda: shard.check_agreement(optimizer=torch_opt))
    expect_error(
        "step", lambda: fe.distributed.save(out / "ckpt", {"params": params, "step": rank}, shard)
    )
    # The same number of elements in another shape: without the check, a silent mix-up.
    local = torch.zeros(shard.size, 2, 3) if rank == 0 else torch.zeros(shard.size, 3, 2)
    expect_error("mean shapes", lambda: fe.distributed.mean(local, shard))
    local = torch.zeros(shard.size, 4) if rank == 0 else torch.zeros(shard.size, 4).double()
    expect_error("gather dtypes", lambda: fe.distributed.all_gather(local, shard))
    # Generators out of step: members {0, 4} drawn on rank 0, {3, 4} on rank 1.
    q = torch.zeros(shard.size, 3)
    for name, per_sample in (("subset", False), ("subset per sample", True)):
        expect_error(
            name,
            lambda p=per_sample: fe.distributed.subset_min(
                q, shard, 2, generator=torch.Generator().manual_seed(2 * rank), per_sample=p
            ),
        )
    # Per-sample draws of another batch size on one rank: exchanged as they were, the
    # draws' sizes differed and gloo aborted a process.
    expect_error(
        "subset batch",
        lambda: fe.distributed.subset_min(
            torch.zeros(shard.size, 3 + rank),
            shard,
            2,
            generator=torch.Generator().manual_seed(0),
            per_sample=True,
        ),
    )
    # The same subset drawn in another order ({0, 4} from seeds 0 and 1): no error.
    same = fe.distributed.subset_min(q, shard, 2, generator=torch.Generator().manual_seed(rank))
    messages["same subset"] = same.shape
    shard.check_agreement(ens, optimizer=fe.optim.adam(1e-2), batch_size=BATCH)  # no error
    # Data replicas (a (1, 2) mesh): average_gradients sums flat buffers, so trees of
    # other shapes or structures with the same element count would mix parameters.
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("member", "data"))
    replica = fe.distributed.MemberShard(NUM_MEMBERS, mesh=mesh)
    n = replica.size
    shapes = (n, 2, 3) if rank == 0 else (n, 3, 2)
    expect_error(
        "average shapes",
        lambda: fe.distributed.average_gradients({"w": torch.ones(shapes)}, replica),
    )
    a, b = (6, 2) if rank == 0 else (2, 6)
    expect_error(
        "average leaves",
        lambda: fe.distributed.average_gradients(
            {"a": torch.ones(n, a), "b": torch.ones(n, b)}, replica
        ),
    )
    nested = {"w": torch.ones(n, 4)} if rank == 0 else [torch.ones(n, 4)]
    expect_error("average structure", lambda: fe.distributed.average_gradients(nested, replica))
    averaged = fe.distributed.average_gradients({"w": torch.full((n, 2), float(rank))}, replica)
    messages["averaged"] = averaged["w"].unique().tolist()  # alike trees: no error, the mean
    # scale-out.md: a mean loss averages to the whole batch's gradient; a summed one
    # to 1/D of it, as with DistributedDataParallel.
    xs = torch.arange(1.0, 9.0, dtype=torch.float64)  # the whole batch, on every rank
    part = xs[replica.batch_slice(8)]
    w = torch.ones(n, 1, dtype=torch.float64, requires_grad=True)
    ratios = {}
    for reduction in ("mean", "sum"):
        (g,) = torch.autograd.grad(getattr(w * part, reduction)(), w)
        (whole,) = torch.autograd.grad(getattr(w * xs, reduction)(), w)
        got = fe.distributed.average_gradients({"w": g}, replica)["w"]
        ratios[reduction] = [round(r, 12) for r in (got / whole).unique().tolist()]
    messages["reductions"] = ratios
    expect_error(
        "predict uneven",
        lambda: fe.distributed.predict(
            lambda x: torch.zeros(n, x.shape[0], 2), replica, torch.randn(9, 3), reductions=["mean"]
        ),
    )
    # Other collectives, or other arguments, on the ranks: min and max make the same
    # all-gather, so rank 0's min and rank 1's max combined values without a word.
    values = torch.arange(float(shard.size))[:, None] + 10 * rank
    expect_error(
        "min or max",
        lambda: (
            fe.distributed.min(values, shard) if rank == 0 else fe.distributed.max(values, shard)
        ),
    )
    # Each rank names its own function first; the rest is the same on every rank.
    messages["min or max"] = messages["min or max"] and messages["min or max"].partition(": ")[2]
    expect_error("var correction", lambda: fe.distributed.var(values, shard, correction=rank))
    generator = torch.Generator().manual_seed
    expect_error(
        "subset k", lambda: fe.distributed.subset_min(q, shard, 2 + rank, generator=generator(0))
    )
    # Draws of other sizes ([N] and [batch, N]) were exchanged: gloo aborted a process.
    expect_error(
        "subset per_sample",
        lambda: fe.distributed.subset_min(
            q, shard, 2, generator=generator(0), per_sample=bool(rank)
        ),
    )
    # predict with other reductions: mean's all-reduce met max's all-gather, and both
    # ranks waited for the whole timeout.
    expect_error(
        "predict reductions",
        lambda: fe.distributed.predict(
            ens, shard, test_inputs(), reductions=["mean"] if rank == 0 else ["max"]
        ),
    )
    expect_error("predict src", lambda: fe.distributed.predict(ens, shard, test_inputs(), src=rank))
    # A rank that refused its own arguments before the first collective: the other
    # waited in it for the whole timeout (found by an audit).
    expect_error(
        "predict refused on one rank",
        lambda: fe.distributed.predict(
            ens, shard, test_inputs(), reductions=["mean"] if rank == 0 else ["meen"]
        ),
    )

    # randomness="same" promises one draw for all N members; split over the ranks, each
    # drew its own: members 0:3 shared one mask, members 3:5 another.
    def dropped() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5))

    expect_error("same randomness", lambda: shard.from_factory(dropped, randomness="same"))
    expect_error(
        "same randomness select",
        lambda: shard.select(
            fe.Ensemble.from_factory(dropped, num_members=NUM_MEMBERS, seed=0, randomness="same")
        ),
    )
    # An ensemble built directly (or given randomness="same" after): check_agreement
    # and predict passed it (found by an audit).
    direct = fe.Ensemble([dropped() for _ in range(shard.size)], randomness="same")
    expect_error("same randomness agreement", lambda: shard.check_agreement(direct))
    expect_error(
        "same randomness predict", lambda: fe.distributed.predict(direct, shard, torch.ones(2, 4))
    )
    # With data replicas only, every rank holds every member: one draw for all is kept.
    shared = replica.from_factory(dropped, seed=0, randomness="same")
    masks = shared(torch.ones(3, 4)) == 0
    messages["same on replicas"] = [torch.equal(masks[0], m) for m in masks]
    # A replica that refused its own arguments: the other replica waited in the digest
    # exchange and failed with a vague DistributedError (or went on to the next call).
    w = torch.ones(n, 4)
    if rank == 1:
        w[0] = torch.tensor([1.0, -1.0, 0.0, 0.0])
    expect_error(
        "cancel on one replica",
        lambda: fe.distributed.average_gradients({"w": torch.ones(n, 3)}, replica, weights=w),
    )

    def fails_on_rank_1(x: Tensor) -> Tensor:
        if rank == 1:
            raise RuntimeError("the model failed on purpose")
        return torch.zeros(n, x.shape[0], 2)

    expect_error(
        "predict model fails on one rank",
        lambda: fe.distributed.predict(fails_on_rank_1, replica, torch.ones(4, 3)),
    )
    expect_error(
        "predict output wrong on one rank",
        lambda: fe.distributed.predict(
            lambda x: torch.zeros(n + rank, x.shape[0], 2), replica, torch.ones(4, 3)
        ),
    )
    expect_error(
        "predict uneven batch on one replica",
        lambda: fe.distributed.predict(
            lambda x: torch.zeros(n, x.shape[0], 2), replica, torch.ones(4 + rank, 3)
        ),
    )
    # Data replicas of the same members (a 1 x 2 mesh) calling min here and max there,
    # another correction, or drawing subsets from generators seeded by rank: each went
    # on with its own result, no one process's (found by an audit).
    values = torch.arange(n * 3.0).view(n, 3) - 4
    expect_error(
        "replicas min or max",
        lambda: (fe.distributed.min if rank == 0 else fe.distributed.max)(values, replica),
    )
    name = "replicas min or max"
    messages[name] = messages[name] and messages[name].partition(": ")[2]  # (its own name)
    expect_error(
        "replicas correction",
        lambda: fe.distributed.var(values, replica, correction=rank),
    )
    expect_error(
        "replicas subset",
        lambda: fe.distributed.subset_min(values, replica, 2, generator=generator(2 * rank)),
    )
    messages["replicas same subset"] = fe.distributed.subset_min(
        values, replica, 2, generator=generator(7)
    ).tolist()
    dtype = torch.float32 if rank == 0 else torch.int64
    expect_error(
        "integer on one replica",
        lambda: fe.distributed.average_gradients({"w": torch.ones(n, 3, dtype=dtype)}, replica),
    )
    # Sharded checkpoints refused by one rank alone, before the first exchange: the
    # other rank waited in it for the whole timeout (found by an audit).
    rows = {"w": torch.ones(shard.size + rank, 2)}
    expect_error("save refused on one rank", lambda: fe.distributed.save(out / "r", rows, shard))
    wide = fe.distributed.MemberShard(NUM_MEMBERS + 2)
    fe.distributed.save(out / "ck5", {"w": torch.ones(shard.size, 2)}, shard)
    fe.distributed.save(out / "ck7", {"w": torch.ones(wide.size, 2)}, wide)
    template = {"w": torch.zeros(shard.size, 2)}
    where = out / ("ck5" if rank == 0 else "nowhere")
    expect_error("load missing on one rank", lambda: fe.distributed.load(where, template, shard))
    where = out / ("ck5" if rank == 0 else "ck7")
    expect_error("load other N on one rank", lambda: fe.distributed.load(where, template, shard))
    # Refusals of other kinds on one rank (found by an audit): a leaf save cannot write,
    # no shard, and a torch.optim optimizer's checkpoint missing on one rank.
    leaves = {"w": torch.ones(shard.size, 2), "tag": "run-1" if rank else 1}
    expect_error("save leaf on one rank", lambda: fe.distributed.save(out / "t", leaves, shard))
    mine = None if rank else shard
    expect_error("save no shard on one rank", lambda: fe.distributed.save(out / "s", rows, mine))
    ens_opt = torch.optim.Adam(ens.parameters())
    fe.distributed.save(out / "opt", ens_opt, shard)
    where = out / ("opt" if rank == 0 else "nowhere")
    expect_error("load optimizer missing", lambda: fe.distributed.load(where, ens_opt, shard))
    # Mismatched collectives are not reached: every rank raised above, and goes on in step.
    got = fe.distributed.all_gather(torch.full((shard.size, 2), float(rank)), shard)
    messages["gathered"] = got.shape
    torch.save(messages, out / f"disagree{rank}.pt")
    dist.barrier()  # neither rank tears the group down while the other still uses it


def unshared_save(rank: int, out: Path) -> None:
    """Rank 1's checkpoint directory is on a disk of its own: the file it writes is gone
    from the shared directory (moved aside) before rank 0 writes ``.metadata``."""
    from funcensemble.distributed._dcp_checksums import ChecksummingWriter

    if rank == 1:
        write_data = ChecksummingWriter.write_data

        def write_elsewhere(self, plan, planner):
            done = write_data(self, plan, planner)
            for name in {result.storage_data[0].relative_path for result in done.wait()}:
                (out / "ckpt" / name).rename(out / f"rank1-disk-{name}")
            return done

        ChecksummingWriter.write_data = write_elsewhere
    shard = fe.distributed.MemberShard(NUM_MEMBERS)
    ens = shard.from_factory(make_member, seed=SEED)
    try:
        fe.distributed.save(out / "ckpt", ens, shard)
    except fe.distributed.DistributedError as error:
        (out / f"unshared{rank}.txt").write_text(str(error))


def fail(mode: str, rank: int, out: Path) -> None:
    if mode == "kill":
        # Rank 1 dies (SIGKILL: no exception, no goodbye) in the middle of training.
        shard = fe.distributed.MemberShard(NUM_MEMBERS)
        ens = shard.from_factory(make_member, seed=SEED)
        train_members(ens, shard)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.monotonic()
        try:
            fe.distributed.all_gather(torch.zeros(shard.size, 3), shard)
        finally:
            print(f"all_gather returned after {time.monotonic() - started:.2f} s", flush=True)
    if mode == "unshared":
        unshared_save(rank, out)
        return
    if mode == "raise":
        if rank == 1:
            raise ValueError("rank 1 fails on purpose")
        shard = fe.distributed.MemberShard(NUM_MEMBERS)
        fe.distributed.all_gather(torch.zeros(shard.size, 3), shard)
    else:
        # A group whose collectives wait 3 seconds at most; rank 1 stops answering
        # after the set-up, and rank 0 saves a checkpoint without it.
        group = dist.new_group(timeout=timedelta(seconds=3))
        shard = fe.distributed.MemberShard(NUM_MEMBERS, group=group)
        ens = shard.from_factory(make_member, seed=SEED)
        if rank == 1:
            time.sleep(120)
        fe.distributed.save(out / "late", ens, shard)


if __name__ == "__main__":
    main(sys.argv[1:])
