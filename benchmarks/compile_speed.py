"""Compiled training steps against the loop, in CPU time, in one process.

``python -m benchmarks.compile_speed [--n 128] [--threads 2] [--rounds 15]``: the S
workload's training step for the loop (``Adam(foreach=True)``), the eager module face
(``EnsembleOptimizer``) and functional face (``update_``), the compiled module face
and the compiled functional face (docs/how-to/compile.md's recipe, and the pure step),
and the same functional recipe with the MLP ops switched off (everything traced, as
before the functional face reached them). Each is checked against the loop first
(``measure.compare``), then timed in interleaved rounds, in the process's CPU time
(``time.process_time``, which other jobs on a shared machine disturb less; with 2
threads it also counts OpenMP's spin-waiting) and in wall time. Prints per-step medians,
the ratios to the loop, and each method's first call (mostly compilation, compile caches off;
inductor compiles in worker processes, so wall seconds).
"""

import argparse
import contextlib
import time
from collections.abc import Iterator

import numpy as np
import torch

from funcensemble._kernels import fastpath as _fastpath

from .measure import compare, quiet_compile_logs, run_check
from .methods import METHODS
from .workloads import WORKLOADS

KEYS = [
    "loop",
    "fe.EnsembleOptimizer",
    "fe.functional",
    "fe.Ensemble+compile",
    "fe.functional+compile_",
    "fe.functional+compile",
]


@contextlib.contextmanager
def traced_mlp() -> Iterator[None]:
    """The functional face's compiled MLP traced op by op (the route before the ops)."""
    saved = _fastpath._compiled_member_call
    _fastpath._compiled_member_call = lambda *args: None
    try:
        yield
    finally:
        _fastpath._compiled_member_call = saved


def main() -> None:
    # Cold compile times, as a full benchmarks.run reports them: no compile caches.
    with (
        torch._inductor.config.patch(fx_graph_cache=False, autotune_local_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        _main()


def _main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_speed")
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20, help="steps per method per round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_compile_logs()
    w = WORKLOADS["S"]
    x, y = w.data(args.n)
    steps, first = {}, {}
    ref = None
    for key in [*KEYS, "fe.functional+compile_ (MLP traced)"]:
        traced = key.endswith("(MLP traced)")
        method = METHODS[key.split(" ")[0]]
        torch._dynamo.reset()
        with traced_mlp() if traced else contextlib.nullcontext():
            runner = method.build(w, w.members(args.n), x, y, True)
            checked = run_check(runner, train=True, device="cpu")
            first[key] = checked.first_call_s
        if ref is None:
            ref = checked
        else:
            bad = compare(checked, ref, train=True, dtype=torch.float32, compiled=True)
            assert bad is None, f"{key}: {bad}"
        steps[key] = runner.step
    cpu_times: dict[str, list[float]] = {k: [] for k in steps}
    wall_times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for key, step in steps.items():
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(args.steps):
                step()
            cpu_times[key].append((time.process_time() - cpu) / args.steps)
            wall_times[key].append((time.perf_counter() - wall) / args.steps)
    loop_cpu, loop_wall = np.median(cpu_times["loop"]), np.median(wall_times["loop"])
    print(f"S N={args.n}, {args.threads} thread(s), torch {torch.__version__}, per training step")
    print("| method | CPU us | vs loop | wall us | vs loop | first call s (wall) |")
    print("|---|---:|---:|---:|---:|---:|")
    for key in steps:
        cpu, wall = np.median(cpu_times[key]), np.median(wall_times[key])
        print(
            f"| {key} | {cpu * 1e6:.0f} | {loop_cpu / cpu:.2f}x | {wall * 1e6:.0f} | "
            f"{loop_wall / wall:.2f}x | {first[key]:.1f} |"
        )


if __name__ == "__main__":
    main()
