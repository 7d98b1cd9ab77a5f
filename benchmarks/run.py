"""Time every method on every workload and write the results.

``python -m benchmarks.run [--quick] [--workloads S,L,C] [--methods loop,fe.Ensemble,...]
[--threads T] [--device cpu|cuda]``. Prints a table per workload and writes
``benchmarks/results/<machine>.md``, ``.png`` (time vs N, log-log) and ``.json``.
"""

import argparse
import datetime
import gc
import os
import platform
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .measure import (
    CHECK_STEPS,
    clock,
    compare,
    matmul_peak_gflops,
    quiet_compile_logs,
    run_check,
    step_memory,
    time_interleaved,
)
from .methods import METHODS, Method, Runner, Unsupported
from .optimizer_step import CASES as OPTIMIZER_CASES
from .optimizer_step import markdown as markdown_optimizer_step
from .optimizer_step import optimizer_step_rows
from .report import MODES, Row, memory_table, timing_table, write
from .workloads import WORKLOADS, Workload

RESULTS = Path(__file__).parent / "results"

# glibc's malloc moves its mmap and trim thresholds as a program runs, so whether a
# multi-megabyte activation gets memory that is already mapped or fresh pages (a page
# fault per 4 KiB, about 1 ms per 4 MiB here) depends on the allocation history: a
# method that allocates such temporaries every step then times up to 2x apart from one
# process to the next. The headline tables run with the system's malloc, as users do
# (funcensemble's MLP path keeps its large buffers, so it does not depend on this);
# --pin-malloc re-runs with fixed thresholds, under which every method reuses freed
# memory, for a second table that does not depend on that luck.
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"


def pin_malloc(argv: Sequence[str]) -> None:
    """With ``--pin-malloc``, re-run this command with fixed glibc malloc thresholds
    (Linux; once)."""
    if (
        sys.platform != "linux"
        or "--pin-malloc" not in argv
        or "GLIBC_TUNABLES" in os.environ
        or platform.libc_ver()[0] != "glibc"
    ):
        return
    env = dict(os.environ, GLIBC_TUNABLES=MALLOC_TUNABLES)
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.run", *argv], env)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:160]


def run_group(
    w: Workload,
    mode: str,
    n: int,
    methods: Sequence[Method],
    *,
    device: str,
    dtype: torch.dtype = torch.float32,
    threads: int,
    rounds: int,
    min_run_time: float,
    time_it: bool = True,
    timer: str = "wall",
) -> list[Row]:
    """Build, check against the loop, then time (interleaved) every method at one N.

    ``methods`` must start with the loop, the reference of the checks. Methods that do
    not apply to the workload or mode are left out; ones that cannot run, or disagree
    with the loop, get a row saying why and no timing.
    """
    assert methods[0].key == "loop", "the loop comes first: it is the reference"
    torch._dynamo.reset()  # each N compiles afresh, with static shapes
    train = mode == "train"
    x, y = w.data(n, device=device, dtype=dtype)
    flops = w.flops(n, train=train)
    rows: dict[str, Row] = {}
    runners: dict[str, Runner] = {}
    ref = None
    for m in methods:
        if not m.applies(w, mode):
            continue
        row = rows[m.key] = Row(w.key, mode, n, m.key, "ok", flops)
        why = m.unavailable(mode)
        if why:
            row.status = f"skipped: {why}"
            continue
        try:
            runner = m.build(w, w.members(n, device=device, dtype=dtype), x, y, train)
            checked = run_check(runner, train=train, device=device)
        except Unsupported as error:
            row.status = f"unsupported: {error}"
            continue
        except Exception as error:  # a broken method must not stop the others
            row.status = f"error: {_first_line(error)}"
            continue
        if ref is None:
            ref = checked
        else:
            mismatch = compare(checked, ref, train=train, dtype=dtype, compiled=m.compiled)
            if mismatch:
                row.status = f"MISMATCH vs loop: {mismatch}"
                continue
        row.first_call_s = checked.first_call_s
        runners[m.key] = runner
    if ref is None:
        raise RuntimeError(f"{w.key} {mode} N={n}: the loop itself failed: {rows['loop'].status}")
    if time_it:
        steps = {k: r.step for k, r in runners.items()}
        timed = time_interleaved(
            steps,
            rounds=rounds,
            min_run_time=min_run_time,
            threads=threads,
            timer=clock(timer),
        )
        for k, t in timed.items():
            rows[k].median_s, rows[k].iqr_s = t.median, t.iqr
    del runners
    gc.collect()
    return list(rows.values())


def machine_name(device: str, threads: int) -> str:
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = _cpu_model() or platform.machine()
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("(r)", "").replace("(tm)", ""))
    suffix = f"-{threads}t" if not device.startswith("cuda") else ""
    return f"{device.split(':')[0]}-{slug.strip('-')}{suffix}"


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _selected(value: str | None, known: dict[str, Any], what: str) -> list[str]:
    if value is None:
        return list(known)
    picked = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in picked if v not in known]
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; choose from {', '.join(known)}")
    return picked


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer N, shorter timing, no memory for compiled methods",
    )
    parser.add_argument("--workloads", help=f"comma list of {','.join(WORKLOADS)} (all)")
    parser.add_argument("--methods", help=f"comma list of {', '.join(METHODS)} (all)")
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="CPU threads (default: torch.get_num_threads())",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cpu)")
    parser.add_argument("--sizes", help="comma list of N overriding every workload's")
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds (quick 3, full 5)")
    parser.add_argument(
        "--min-run-time", type=float, help="seconds per method per round (quick 0.05, full 0.2)"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    parser.add_argument(
        "--no-optimizer-step",
        action="store_true",
        help="skip the optimizer-step-alone table (benchmarks.optimizer_step)",
    )
    parser.add_argument(
        "--pin-malloc",
        action="store_true",
        help="fix glibc's malloc thresholds for every method (MALLOC_TUNABLES; default: "
        "the system's adaptive ones, as users run)",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or this thread's CPU time (cpu: needs --threads 1; steadier on "
        "a shared machine)",
    )
    parser.add_argument("--name", help="results file name (default: from device and threads)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.threads < 1:
        parser.error("--threads must be positive")
    if args.clock == "cpu" and (args.threads != 1 or args.device != "cpu"):
        parser.error("--clock cpu times the calling thread: use it with --threads 1 on cpu")
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.min_run_time = args.min_run_time or (0.05 if args.quick else 0.2)
    return args


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse(argv)
    threads = torch.get_num_threads()
    quiet_compile_logs()
    # A full run reports cold compile times, not whatever an earlier run left in the
    # compile caches; a quick one may reuse them.
    cold = not args.quick
    with (
        torch._inductor.config.patch(fx_graph_cache=not cold, autotune_local_cache=not cold),
        torch._functorch.config.patch(enable_autograd_cache=not cold),
    ):
        try:
            torch.set_num_threads(args.threads)
            return _run(args, argv)
        finally:
            torch.set_num_threads(threads)


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> list[Row]:
    workloads = [WORKLOADS[k] for k in _selected(args.workloads, WORKLOADS, "workloads")]
    keys = _selected(args.methods, METHODS, "methods")
    methods = [METHODS["loop"]] + [METHODS[k] for k in keys if k != "loop"]
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
    device = args.device
    name = args.name or machine_name(device, args.threads) + ("-quick" if args.quick else "")
    cuda = device.startswith("cuda")
    mm_size = (8192 if cuda else 2048) // (2 if args.quick else 1)

    def mm_peak() -> float:
        return matmul_peak_gflops(
            device=device,
            size=mm_size,
            threads=args.threads,
            min_run_time=1.0,
            clock_fn=clock(args.clock),
        )

    peak = mm_peak()
    print(
        f"{name}: torch {torch.__version__}, {args.threads} thread(s), "
        f"float32 mm peak {peak:.1f} GFLOP/s\n"
    )
    rows: list[Row] = []
    memory: dict[str, dict[str, dict[str, Any]]] = {}
    for w in workloads:
        ns = sizes or list(w.quick_sizes if args.quick else w.sizes)
        print(f"## {w.title}\n")
        for mode in MODES:
            sub: list[Row] = []
            for n in ns:
                # Compilation dominates a quick run: compile at the largest N only.
                at_n = [m for m in methods if not (args.quick and m.compiled and n != max(ns))]
                sub += run_group(
                    w,
                    mode,
                    n,
                    at_n,
                    device=device,
                    threads=args.threads,
                    rounds=args.rounds,
                    min_run_time=args.min_run_time,
                    timer=args.clock,
                )
            rows += sub
            print(f"### {MODES[mode]}\n\n{timing_table(sub, peak)}\n", flush=True)
        if not args.no_memory:
            memory[w.key] = {}
            largest = {
                r.method: r for r in rows if (r.workload, r.mode, r.n) == (w.key, "train", max(ns))
            }
            for m in methods:
                if m.key not in largest or not largest[m.key].ok:
                    continue  # not applicable, unavailable, or failed its check
                if m.compiled and args.quick:
                    memory[w.key][m.key] = {"error": "not measured with --quick"}
                    continue
                memory[w.key][m.key] = step_memory(
                    w.key, m.key, max(ns), device=device, threads=args.threads
                )
    # A peak is the best the machine did: measured again at the end, the larger counts
    # (the tables printed on the way used the first measurement).
    peak = max(peak, mm_peak())
    meta = {
        "machine": name,
        "command": "python -m benchmarks.run " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.date.today().isoformat(),
        "device": device,
        "device_name": torch.cuda.get_device_name() if cuda else (_cpu_model() or "cpu"),
        "torch": torch.__version__,
        "threads": args.threads,
        "mm_size": mm_size,
        "peak_gflops": peak,
        "rounds": args.rounds,
        "min_run_time": args.min_run_time,
        "check_steps": CHECK_STEPS,
        "compile_caches": "on (a quick run may reuse compiled code)" if args.quick else "off",
        "malloc": os.environ.get("GLIBC_TUNABLES", "system default"),
        "clock": args.clock,
    }
    # The optimizer step alone, on the stacked parameters of the selected workloads.
    cases = [
        (k, max(sizes) if sizes else n)
        for k, n in OPTIMIZER_CASES
        if k in {w.key for w in workloads}
    ]
    optimizer_md = None
    if cases and not args.no_optimizer_step:
        optimizer_md = markdown_optimizer_step(
            optimizer_step_rows(
                cases,
                threads=args.threads,
                rounds=args.rounds,
                min_run_time=args.min_run_time,
                device=device,
            )
        )
        print(f"## The optimizer step alone\n\n{optimizer_md}\n")
    md = write(rows, memory, meta, args.out, optimizer_step=optimizer_md)
    for key, per_method in memory.items():
        n = max(r.n for r in rows if r.workload == key)
        print(f"## {key}: memory of a training step\n\n{memory_table(per_method, n, device)}\n")
    print(f"wrote {md} (and .png, .json)")
    return rows


if __name__ == "__main__":
    pin_malloc(sys.argv[1:])
    main()
