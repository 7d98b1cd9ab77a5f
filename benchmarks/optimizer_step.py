"""The optimizer step alone, on stacked ``[N, ...]`` parameters: fe.optim against torch.optim.

``python -m benchmarks.optimizer_step [--threads T] [--quick] [--device cpu|cuda]``
prints a Markdown table. Every method steps its own copy of the same stacked
parameters with the same fixed random gradients (set once, never recomputed), so the
time is the optimizer's alone: no forward, no backward. The reference is
``torch.optim.Adam(fused=True)``, the fastest of torch's own implementations.
:func:`optimizer_step_rows` returns the rows for other scripts.
"""

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

import funcensemble as fe

from .measure import sync, time_interleaved
from .workloads import WORKLOADS

LR = 1e-3
FUSED = "torch.optim.Adam(fused=True)"
METHODS = (
    "torch.optim.Adam(foreach=True)",
    FUSED,
    "fe.optim.EnsembleOptimizer(adam)",
    "fe.optim.adam update_",
    "fe.optim.adam update + apply_updates",
    "fe.optim.chain(scale_by_adam, scale_by_learning_rate) update_",
)
# (workload, N): the stacked parameter sets timed by default.
CASES = (("S", 128), ("L", 32))


@dataclass(frozen=True)
class StepRow:
    """One method's median step time on one stacked parameter set."""

    workload: str
    n: int
    method: str
    seconds: float
    vs_fused: float  # seconds / the fused torch.optim.Adam's seconds


def stacked_case(
    workload: str, n: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Stacked parameters of ``n`` members of ``workload``, and fixed random gradients."""
    _, params, _ = fe.stack(WORKLOADS[workload].members(n, dtype=dtype, device=device))
    g = torch.Generator().manual_seed(0)
    grads = {
        k: torch.randn(v.shape, generator=g, dtype=dtype).to(device) for k, v in params.items()
    }
    return {k: v.detach().clone() for k, v in params.items()}, grads


def step_functions(
    params: dict[str, Tensor], grads: dict[str, Tensor]
) -> dict[str, tuple[Callable[[], Any], Callable[[], dict[str, Tensor]]]]:
    """Per method: a step, and a getter of its current parameters (for checks)."""

    def leaves() -> dict[str, nn.Parameter]:
        out = {k: nn.Parameter(v.clone()) for k, v in params.items()}
        for k, p in out.items():
            p.grad = grads[k].clone()
        return out

    out: dict[str, tuple[Callable[[], Any], Callable[[], dict[str, Tensor]]]] = {}
    for method, flag in zip(METHODS[:2], ("foreach", "fused"), strict=True):
        ps = leaves()
        opt = torch.optim.Adam(ps.values(), lr=LR, **{flag: True})
        out[method] = (opt.step, lambda ps=ps: ps)

    ps = leaves()
    ensemble_opt = fe.optim.EnsembleOptimizer(ps, fe.optim.adam(LR))
    out[METHODS[2]] = (ensemble_opt.step, lambda ps=ps: ps)

    adam = fe.optim.adam(LR)
    mutated = {k: v.clone() for k, v in params.items()}
    box = {"state": adam.init(mutated)}

    def update_() -> None:
        box["state"] = adam.update_(grads, box["state"], mutated)

    out[METHODS[3]] = (update_, lambda: mutated)

    pure = {"params": {k: v.clone() for k, v in params.items()}}
    pure["state"] = adam.init(pure["params"])

    def update() -> None:
        updates, pure["state"] = adam.update(grads, pure["state"], pure["params"])
        pure["params"] = fe.optim.apply_updates(pure["params"], updates)

    out[METHODS[4]] = (update, lambda: pure["params"])

    # The composition folds into adam's own step: it should time like `adam update_`.
    chained = fe.optim.chain(fe.optim.scale_by_adam(), fe.optim.scale_by_learning_rate(LR))
    stepped = {k: v.clone() for k, v in params.items()}
    chained_box = {"state": chained.init(stepped)}

    def chained_update_() -> None:
        chained_box["state"] = chained.update_(grads, chained_box["state"], stepped)

    out[METHODS[5]] = (chained_update_, lambda: stepped)
    return out


def optimizer_step_rows(
    cases: Sequence[tuple[str, int]] = CASES,
    *,
    threads: int = 1,
    rounds: int = 5,
    min_run_time: float = 0.2,
    device: str = "cpu",
) -> list[StepRow]:
    """Median step time of every method on each ``(workload, N)``, rounds interleaved."""
    rows = []
    for workload, n in cases:
        steps = step_functions(*stacked_case(workload, n, device=device))

        def timed(step: Callable[[], Any]) -> Callable[[], None]:
            def call() -> None:
                step()
                sync(device)

            return call

        for step, _ in steps.values():  # warm-up: state allocation, first-call costs
            step()
        timings = time_interleaved(
            {m: timed(step) for m, (step, _) in steps.items()},
            rounds=rounds,
            min_run_time=min_run_time,
            threads=threads,
        )
        fused = timings[FUSED].median
        rows += [
            StepRow(workload, n, m, timings[m].median, timings[m].median / fused) for m in METHODS
        ]
    return rows


def markdown(rows: Sequence[StepRow]) -> str:
    """The rows as a Markdown table: time per step and ratio to the fused torch Adam."""
    lines = [
        "| workload | N | method | step (µs) | vs Adam(fused=True) |",
        "|---|---:|---|---:|---:|",
    ]
    lines += [
        f"| {r.workload} | {r.n} | {r.method} | {r.seconds * 1e6:.1f} | {r.vs_fused:.2f}x |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[StepRow]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.optimizer_step", description=__doc__
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be positive")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(args.threads)
        rows = optimizer_step_rows(
            threads=args.threads,
            rounds=2 if args.quick else 7,
            min_run_time=0.05 if args.quick else 0.3,
            device=args.device,
        )
    finally:
        torch.set_num_threads(before)
    print(
        f"Optimizer step alone, torch {torch.__version__}, {args.device}, "
        f"{args.threads} thread(s), median of interleaved rounds\n"
    )
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
