"""The ``chunk_size`` trade-off: the memory of a step against its time.

``python -m benchmarks.chunking`` measures one ensemble (64 members
``Linear(64,2048)-ReLU-Linear(2048,1)``, a shared batch of 1024, one target per
member) at several chunk sizes, for a training step (``fe.value_and_grad`` and an
in-place SGD update) and for an inference forward under ``torch.no_grad()``
(``fe.vmap``). For each it gives the peak memory above the resting state, measured
in a fresh process per setting as `benchmarks.measure.step_memory` does, and the
time per step relative to ``chunk_size=None``. Prints Markdown and writes
``results/chunking-<machine>.md``.
"""

import argparse
import gc
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

import funcensemble as fe

from .measure import ROOT, _peak_rss_bytes, _reset_peak_rss, run_child, sync, time_interleaved
from .run import machine_name
from .workloads import mlp

LR = 1e-3
MB = 1e6


@dataclass(frozen=True)
class Setup:
    """The ensemble measured, and where."""

    members: int = 64
    in_features: int = 64
    hidden: int = 2048
    batch: int = 1024
    device: str = "cpu"
    threads: int = 1

    @property
    def title(self) -> str:
        return (
            f"{self.members} members `Linear({self.in_features},{self.hidden})-ReLU-"
            f"Linear({self.hidden},1)`, a shared batch of {self.batch}, float32"
        )


def make_step(setup: Setup, mode: str, chunk_size: int | None) -> Callable[[], Any]:
    """One training step or one inference forward of a freshly built ensemble."""
    torch.manual_seed(0)
    dims = (setup.in_features, setup.hidden, 1)
    members = [mlp(dims, torch.nn.ReLU).to(setup.device) for _ in range(setup.members)]
    fmodel, params, buffers = fe.stack(members)
    del members
    x = torch.randn(setup.batch, setup.in_features, device=setup.device)
    if mode == "infer":
        forward = fe.vmap(fmodel, chunk_size=chunk_size)

        def infer() -> Any:
            with torch.no_grad():
                return forward(params, buffers, x)

        return infer

    y = torch.randn(setup.members, setup.batch, 1, device=setup.device)

    def loss_fn(p: Any, b: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(fmodel(p, b, x), y)

    value_and_grad = fe.value_and_grad(loss_fn, (None, 0), chunk_size=chunk_size)
    state: dict[str, Any] = {"buffers": buffers}

    def train() -> None:
        _, grads, state["buffers"] = value_and_grad(params, state["buffers"], x, y)
        with torch.no_grad():
            torch._foreach_add_(list(params.values()), list(grads.values()), alpha=-LR)
        # Kept until the next step, as `p.grad` would be: part of the resting state.
        state["grads"] = grads

    return train


def _child(setup: Setup, mode: str, chunk_size: int | None) -> dict[str, Any]:
    """Build, warm up, then the peak memory of one step above the state between steps."""
    torch.set_num_threads(setup.threads)
    step = make_step(setup, mode, chunk_size)
    for _ in range(2):
        step()
    sync(setup.device)
    gc.collect()
    if setup.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        sync(setup.device)
        return {"peak_bytes": torch.cuda.max_memory_allocated() - before}
    if not _reset_peak_rss():
        return {"error": "cannot reset the peak RSS (needs Linux /proc/self/clear_refs)"}
    before = _peak_rss_bytes()
    step()
    return {"peak_bytes": _peak_rss_bytes() - before}


def step_peak(
    setup: Setup, mode: str, chunk_size: int | None, *, timeout: float = 600
) -> dict[str, Any]:
    """`_child` in a fresh process, with the allocator settings of ``step_memory``."""
    cmd = [sys.executable, "-m", "benchmarks.chunking", "--child", mode, str(chunk_size)]
    cmd += ["--setup", json.dumps(asdict(setup))]
    return run_child(cmd, timeout=timeout)


@dataclass
class Row:
    chunk_size: int | None
    peak_bytes: float | None  # None if the memory was not measured (or failed)
    median_s: float


def measure(
    setup: Setup,
    mode: str,
    chunk_sizes: Sequence[int | None],
    *,
    memory: bool,
    rounds: int,
    min_run_time: float,
) -> list[Row]:
    """Peak memory (one process per chunk size), then times (interleaved, in this one)."""
    peaks: dict[int | None, float | None] = dict.fromkeys(chunk_sizes)
    if memory:
        for k in chunk_sizes:
            found = step_peak(setup, mode, k)
            if "error" in found:
                print(f"chunk_size={k} {mode}: {found['error']}", file=sys.stderr)
            peaks[k] = found.get("peak_bytes")
    steps = {str(k): make_step(setup, mode, k) for k in chunk_sizes}
    for step in steps.values():
        step()  # warm up
    times = time_interleaved(steps, rounds=rounds, min_run_time=min_run_time, threads=setup.threads)
    return [Row(k, peaks[k], times[str(k)].median) for k in chunk_sizes]


def fit(rows: list[Row], members: int) -> tuple[float, float] | None:
    """``(fixed, per_member)`` bytes of the least-squares line ``peak = fixed + per_member * k``.

    Over the chunked rows (``k < N``); the unchunked call is another code path.
    """
    pts = [
        (r.chunk_size, r.peak_bytes)
        for r in rows
        if r.chunk_size is not None and r.chunk_size < members and r.peak_bytes is not None
    ]
    if len({k for k, _ in pts}) < 2:
        return None
    slope, intercept = np.polyfit([k for k, _ in pts], [p for _, p in pts], 1)
    return float(intercept), float(slope)


def table(rows: list[Row], members: int) -> str:
    base = next((r.median_s for r in rows if r.chunk_size is None), rows[0].median_s)
    lines = [
        "| `chunk_size` | calls | peak above resting | time per step | time vs `None` |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        k = members if r.chunk_size is None else min(r.chunk_size, members)
        calls = -(-members // k)
        peak = "n/a" if r.peak_bytes is None else f"{r.peak_bytes / MB:.0f} MB"
        time = f"{r.median_s * 1e3:.1f} ms" if r.median_s < 1 else f"{r.median_s:.2f} s"
        lines.append(f"| {r.chunk_size} | {calls} | {peak} | {time} | {r.median_s / base:.2f}x |")
    line = fit(rows, members)
    if line is not None:
        fixed, per_member = line
        lines += [
            "",
            f"Least-squares fit over the chunked rows: peak ≈ {fixed / MB:.0f} MB + "
            f"{per_member / MB:.1f} MB × `chunk_size`.",
        ]
    return "\n".join(lines)


def report(setup: Setup, results: dict[str, list[Row]], name: str) -> str:
    what = {
        "train": "Training step: `fe.value_and_grad(loss_fn, (None, 0), chunk_size=k)`, "
        "then an in-place SGD update",
        "infer": "Inference: `fe.vmap(fmodel, chunk_size=k)` under `torch.no_grad()`",
    }
    out = [
        "# `chunk_size`: memory against time",
        "",
        f"{setup.title}; {name}, torch {torch.__version__}, {setup.threads} thread(s).",
        "Peak: the rise of the peak memory during one step over the state between steps "
        "(weights, the last step's gradients, data), in a fresh process per row after two "
        "warm-up steps (CPU: peak RSS via `/proc/self/clear_refs`; GPU: "
        "`torch.cuda.max_memory_allocated`). Time: median of interleaved "
        "`Timer.blocked_autorange` blocks.",
    ]
    for mode, rows in results.items():
        out += ["", f"## {what[mode]}", "", table(rows, setup.members)]
    return "\n".join(out) + "\n"


def _chunk(value: str) -> int | None:
    return None if value == "None" else int(value)


def main(argv: Sequence[str] | None = None) -> dict[str, list[Row]]:
    parser = argparse.ArgumentParser(description="Memory and time against chunk_size.")
    defaults = Setup()
    parser.add_argument("--members", type=int, default=defaults.members)
    parser.add_argument("--in-features", type=int, default=defaults.in_features)
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--chunks", default="None,32,16,8,4,1", help="comma-separated")
    parser.add_argument("--modes", default="train,infer", help="train and/or infer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-run-time", type=float, default=1.0)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--name", help="file name (default: chunking-<machine>)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "CHUNK"), help=argparse.SUPPRESS)
    parser.add_argument("--setup", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        setup = Setup(**json.loads(args.setup))
        print(json.dumps(_child(setup, args.child[0], _chunk(args.child[1]))))
        return {}
    setup = Setup(
        args.members, args.in_features, args.hidden, args.batch, args.device, args.threads
    )
    torch.set_num_threads(setup.threads)
    chunks = [_chunk(c) for c in args.chunks.split(",")]
    results = {
        mode: measure(
            setup,
            mode,
            chunks,
            memory=not args.no_memory,
            rounds=args.rounds,
            min_run_time=args.min_run_time,
        )
        for mode in args.modes.split(",")
    }
    machine = machine_name(setup.device, setup.threads)
    text = report(setup, results, machine)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name or 'chunking-' + machine}.md").write_text(text)
    return results


if __name__ == "__main__":
    main()
