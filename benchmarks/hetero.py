"""A heterogeneous ensemble (three architectures, members interleaved) against the loop.

``python -m benchmarks.hetero [--quick] [--per-structure K] [--threads T]`` builds K
members of each of three MLPs (``8-32-4`` Tanh, ``8-128-4`` Tanh, ``8-64-64-4`` ReLU),
interleaved (member i has structure ``i % 3``), with a shared batch of 256 and one
target per member, and times a training step (each member's own MSE summed, backward,
Adam with lr 1e-3) and an inference forward (``torch.no_grad()``) for:

- ``loop``: an ``nn.ModuleList`` loop + ``torch.optim.Adam(foreach=True)``, the baseline;
- ``fe.HeteroEnsemble``: one ``HeteroEnsemble`` (outputs ``[N, ...]`` in member order)
  + ``torch.optim.Adam(foreach=True)``;
- ``fe.HeteroEnsemble+EnsembleOptimizer``: the same with
  ``fe.optim.EnsembleOptimizer(hens, fe.optim.adam(lr))`` (training only);
- ``3 x fe.Ensemble``: one ``fe.Ensemble`` per structure built by hand, outputs left
  per group: what the grouping and reordering cost on top of the groups themselves.

Before timing, every method's parameters and buffers after two training steps (and its
inference outputs) are compared with the loop's. Times are CPU time
(``time.process_time``) per call, rounds interleaved across methods, median over rounds;
the ratio is the loop's median over the method's (above 1: faster than the loop).
"""

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

import funcensemble as fe

from .workloads import mlp

LR = 1e-3
BATCH = 256
STRUCTURES = (
    ("8-32-4 Tanh", lambda: mlp((8, 32, 4), nn.Tanh)),
    ("8-128-4 Tanh", lambda: mlp((8, 128, 4), nn.Tanh)),
    ("8-64-64-4 ReLU", lambda: mlp((8, 64, 64, 4), nn.ReLU)),
)
METHODS = ("loop", "fe.HeteroEnsemble", "fe.HeteroEnsemble+EnsembleOptimizer", "3 x fe.Ensemble")


def members(per_structure: int, *, dtype: torch.dtype = torch.float32) -> list[nn.Module]:
    """``3 * per_structure`` members, structures interleaved, the same for every method."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return [STRUCTURES[i % 3][1]().to(dtype) for i in range(3 * per_structure)]


def data(n: int, *, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 8, generator=g, dtype=dtype), torch.randn(
        n, BATCH, 4, generator=g, dtype=dtype
    )


@dataclass
class Built:
    """One method: a training step, an inference forward, and its members (for checks)."""

    train: Callable[[], Any]
    infer: Callable[[], Tensor]
    members: Callable[[], list[nn.Module]]


def build(method: str, modules: list[nn.Module], x: Tensor, y: Tensor) -> Built:
    """``method`` over copies of ``modules``."""
    modules = copy.deepcopy(modules)
    if method == "loop":
        mods = nn.ModuleList(modules)
        opt = torch.optim.Adam(mods.parameters(), lr=LR, foreach=True)

        def train() -> None:
            opt.zero_grad()
            sum(((m(x) - y[i]) ** 2).mean() for i, m in enumerate(mods)).backward()
            opt.step()

        def infer() -> Tensor:
            with torch.no_grad():
                return torch.stack([m(x) for m in mods])

        return Built(train, infer, lambda: list(mods))
    if method == "3 x fe.Ensemble":
        groups = [list(range(s, len(modules), 3)) for s in range(3)]
        ensembles = nn.ModuleList([fe.Ensemble([modules[i] for i in g]) for g in groups])
        targets = [y[g] for g in groups]
        opt = torch.optim.Adam(ensembles.parameters(), lr=LR, foreach=True)

        def train() -> None:
            opt.zero_grad()
            sum(
                ((ens(x) - t) ** 2).mean(dim=(1, 2)).sum()
                for ens, t in zip(ensembles, targets, strict=True)
            ).backward()
            opt.step()

        def infer() -> Tensor:
            with torch.no_grad():
                outs = [ens(x) for ens in ensembles]
            out = outs[0].new_empty((len(modules), *outs[0].shape[1:]))
            for g, o in zip(groups, outs, strict=True):
                out[g] = o
            return out

        def unstack() -> list[nn.Module]:
            out: list[Any] = [None] * len(modules)
            for g, ens in zip(groups, ensembles, strict=True):
                for position, i in enumerate(g):
                    out[i] = ens.member(position)
            return out

        return Built(train, infer, unstack)
    hens = fe.HeteroEnsemble(modules)
    if method == "fe.HeteroEnsemble":
        step = torch.optim.Adam(hens.parameters(), lr=LR, foreach=True)
    else:
        step = fe.optim.EnsembleOptimizer(hens, fe.optim.adam(LR))

    def train() -> None:
        step.zero_grad()
        ((hens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
        step.step()

    def infer() -> Tensor:
        with torch.no_grad():
            return hens(x)

    return Built(train, infer, hens.unstack)


def check(per_structure: int = 2, *, dtype: torch.dtype = torch.float32) -> str | None:
    """Every method against the loop: outputs, then parameters after two steps.

    Returns None if all agree, else what differs first.
    """
    modules = members(per_structure, dtype=dtype)
    x, y = data(len(modules), dtype=dtype)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-11}
    built = {m: build(m, modules, x, y) for m in METHODS}
    ref = built["loop"]
    for method, b in built.items():
        if not torch.allclose(b.infer(), ref.infer(), **tol):
            return f"{method}: inference outputs differ from the loop's"
    for _ in range(2):
        for b in built.values():
            b.train()
    expected = [m.state_dict() for m in ref.members()]
    for method, b in built.items():
        for i, (got, want) in enumerate(zip(b.members(), expected, strict=True)):
            for k, v in want.items():
                if not torch.allclose(got.state_dict()[k], v, **tol):
                    return f"{method}: member {i} `{k}` differs from the loop's after 2 steps"
    return None


def time_cpu(steps: dict[str, Callable[[], Any]], *, rounds: int, calls: int) -> dict[str, float]:
    """Median CPU seconds per call of each step, rounds interleaved across steps."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for k, step in steps.items():
            start = time.process_time()
            for _ in range(calls):
                step()
            times[k].append((time.process_time() - start) / calls)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hetero", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="4 members per structure, short")
    parser.add_argument(
        "--per-structure", type=int, default=None, help="members per structure (default 16)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    k = args.per_structure or (4 if args.quick else 16)
    if k < 1 or args.threads < 1:
        parser.error("--per-structure and --threads must be positive")
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        mismatch = check()
        if mismatch is not None:
            raise SystemExit(f"benchmarks.hetero: {mismatch}; not timed.")
        modules = members(k)
        x, y = data(len(modules))
        built = {m: build(m, modules, x, y) for m in METHODS}
        for b in built.values():  # warm-up: optimizer state, first-call costs
            b.train()
            b.infer()
        rounds, calls = (3, 3) if args.quick else (9, 10)
        results = {
            "train": time_cpu({m: b.train for m, b in built.items()}, rounds=rounds, calls=calls),
            "infer": time_cpu(
                {m: b.infer for m, b in built.items() if "EnsembleOptimizer" not in m},
                rounds=rounds,
                calls=calls,
            ),
        }
    finally:
        torch.set_num_threads(before)
    print(
        f"Heterogeneous ensemble: {k} members each of {', '.join(s for s, _ in STRUCTURES)} "
        f"(N={3 * k}, interleaved), batch {BATCH}, torch {torch.__version__}, "
        f"{args.threads} thread(s); CPU time per call, median of {rounds} interleaved rounds\n"
    )
    print("| mode | method | ms per call | vs loop |")
    print("|---|---|---:|---:|")
    for mode, timings in results.items():
        for method, seconds in timings.items():
            ratio = timings["loop"] / seconds
            print(f"| {mode} | {method} | {seconds * 1e3:.2f} | {ratio:.2f}x |")
    return results


if __name__ == "__main__":
    main()
