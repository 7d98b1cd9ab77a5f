"""Measurements: equivalence checks, interleaved timing, matmul peak and step memory.

``python -m benchmarks.measure WORKLOAD METHOD N`` is the child process that measures
one method's training-step memory in a fresh interpreter (see `step_memory`).
"""

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.benchmark import Timer

from .methods import LR, METHODS, Runner
from .workloads import WORKLOADS

ROOT = Path(__file__).resolve().parent.parent  # where `python -m benchmarks...` runs
CHECK_STEPS = 2  # training steps run by every method before its state is compared


def tolerances(dtype: torch.dtype, train: bool, *, compiled: bool = False) -> dict[str, float]:
    """How close a method must come to the loop.

    Batched kernels sum in another order than N separate ones; after a few Adam steps
    (whose first update is about ``lr * sign(grad)``) float32 rounding shows in the
    4th-5th digit. Float64 agrees to rounding, except that ``torch.optim.Adam`` under
    ``torch.compile`` computes its step scalars in float32 (eager uses Python floats):
    its float64 parameters move up to ``1e-3 * lr`` away from eager's within two steps.
    A wrong gradient or a skipped member moves them by about ``lr``.
    """
    if dtype == torch.float64:
        return {"rtol": 1e-4, "atol": 1e-5} if compiled else {"rtol": 1e-7, "atol": 1e-9}
    return {"rtol": 1e-3, "atol": 1e-4} if train else {"rtol": 1e-4, "atol": 1e-5}


def quiet_compile_logs() -> None:
    """Silence dynamo's note that ``torch.optim``'s profiler annotations are not traced."""
    logging.getLogger("torch._dynamo.variables.ctx_manager").setLevel(logging.ERROR)
    logging.getLogger("torch._dynamo.variables.torch").setLevel(logging.ERROR)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@dataclass
class Checked:
    """What a method computed in its check: outputs (inference) or state (training)."""

    value: Tensor | dict[str, Tensor]
    first_call_s: float  # the first call alone: for compiled methods, mostly compilation


def run_check(runner: Runner, *, train: bool, device: str) -> Checked:
    """The first calls of a freshly built method, and what they computed."""
    sync(device)
    start = time.perf_counter()
    out = runner.step()
    sync(device)
    first = time.perf_counter() - start
    if not train:
        return Checked(out.detach().clone(), first)
    for _ in range(CHECK_STEPS - 1):
        runner.step()
    return Checked(runner.state(), first)


def _outliers_allowed(dtype: torch.dtype, train: bool, numel: int) -> int:
    """How many elements of a trained float32 tensor may miss the tolerance.

    Where a parameter's true gradient is about zero (a ReLU at its kink, a weight
    whose contributions cancel), the float32 gradient is rounding noise whose sign
    depends on summation order, and Adam, which divides by the gradient's own
    magnitude, turns that noise into a step of up to ``lr`` either way. A handful of
    such elements is expected; a wrong gradient or a skipped member moves thousands.
    """
    if dtype == torch.float64 or not train:
        return 0
    return max(2, numel // 1000)


def compare(
    got: Checked, ref: Checked, *, train: bool, dtype: torch.dtype, compiled: bool = False
) -> str | None:
    """``None`` if ``got`` matches the loop's ``ref``, else what differs."""
    tol = tolerances(dtype, train, compiled=compiled)
    pairs: list[tuple[str, Tensor, Tensor]]
    if isinstance(ref.value, Tensor):
        pairs = [("output", got.value, ref.value)]  # type: ignore[list-item]
    else:
        assert isinstance(got.value, dict)
        if got.value.keys() != ref.value.keys():
            return f"state keys {sorted(got.value)} != loop's {sorted(ref.value)}"
        pairs = [(k, got.value[k], ref.value[k]) for k in ref.value]
    for name, a, b in pairs:
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{name}: {a.dtype}{tuple(a.shape)} != loop's {b.dtype}{tuple(b.shape)}"
        if not a.is_floating_point():
            if not torch.equal(a, b):
                return f"{name}: differs from the loop's"
            continue
        diff = (a - b).abs()
        missed = diff > tol["atol"] + tol["rtol"] * b.abs()
        allowed = _outliers_allowed(dtype, train, a.numel())
        worst = diff.max().item() if diff.numel() else 0.0
        # Adam moves a parameter by at most about lr per step, whatever the gradient.
        if int(missed.sum()) > allowed or (allowed and worst > 2 * LR * CHECK_STEPS):
            return (
                f"{name}: {int(missed.sum())} of {a.numel()} elements differ by more than "
                f"atol {tol['atol']:g} + rtol {tol['rtol']:g} (largest {worst:.3g}; "
                f"{allowed} allowed)"
            )
    return None


def check_against_loop(
    workload: str,
    mode: str,
    method: str,
    *,
    n: int = 3,
    batch: int = 4,
    dtype: torch.dtype = torch.float64,
    device: str = "cpu",
) -> str | None:
    """Build the loop and ``method`` from the same members; ``None`` if they agree."""
    w, train = WORKLOADS[workload], mode == "train"
    x, y = w.data(n, batch=batch, dtype=dtype, device=device)

    def checked(key: str) -> Checked:
        runner = METHODS[key].build(w, w.members(n, dtype=dtype, device=device), x, y, train)
        return run_check(runner, train=train, device=device)

    compiled = METHODS[method].compiled
    return compare(checked(method), checked("loop"), train=train, dtype=dtype, compiled=compiled)


@dataclass
class Timing:
    times: list[float] = field(default_factory=list)  # seconds per call, one per block

    @property
    def median(self) -> float:
        return float(np.median(self.times))

    @property
    def iqr(self) -> float:
        q25, q75 = np.percentile(self.times, [25, 75])
        return float(q75 - q25)


def clock(name: str) -> Callable[[], float]:
    """The timer for ``name``: ``"wall"`` (``time.perf_counter``) or ``"cpu"``
    (``time.thread_time``: this thread's CPU time, system time included). With one
    thread every CPU kernel runs on the calling thread, so "cpu" times the step itself,
    unmoved by other jobs on a shared machine (except through caches and clocks)."""
    return time.thread_time if name == "cpu" else time.perf_counter


def time_interleaved(
    steps: dict[str, Callable[[], Any]],
    *,
    rounds: int,
    min_run_time: float,
    threads: int,
    timer: Callable[[], float] = time.perf_counter,
) -> dict[str, Timing]:
    """Time every step with ``Timer.blocked_autorange``, rounds interleaved across steps.

    Interleaving spreads slow drifts of a shared machine (other jobs, clocks) over all
    methods instead of loading them onto whichever ran at the wrong moment.
    """
    timers = {
        k: Timer("step()", globals={"step": s}, num_threads=threads, timer=timer)
        for k, s in steps.items()
    }
    out = {k: Timing() for k in steps}
    for _ in range(rounds):
        for k, timer in timers.items():
            out[k].times.extend(timer.blocked_autorange(min_run_time=min_run_time).times)
    return out


def matmul_peak_gflops(
    *,
    device: str,
    size: int,
    threads: int,
    min_run_time: float,
    clock_fn: Callable[[], float] = time.perf_counter,
) -> float:
    """This machine's float32 ``torch.mm`` throughput: the best of many large products.

    The best block, not the median: on a shared machine the median measures the other
    jobs. Half the size too, which some BLAS libraries run closer to peak.
    """
    best = 0.0
    for n in (size // 2, size):
        a = torch.randn(n, n, device=device)
        b = torch.randn(n, n, device=device)
        torch.mm(a, b)
        timer = Timer(
            "torch.mm(a, b)",
            globals={"a": a, "b": b, "torch": torch},
            num_threads=threads,
            timer=clock_fn,
        )
        seconds = min(timer.blocked_autorange(min_run_time=min_run_time / 2).times)
        best = max(best, 2 * n**3 / seconds / 1e9)
    return best


# -- memory of one training step, in a fresh process -----------------------------------


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _peak_rss_bytes() -> int:
    """``VmHWM``: the peak RSS of this process's memory since the last reset.

    Not ``ru_maxrss``, which is the same figure floored by the parent's peak: a child
    inherits the parent's high-water mark through fork and exec, and the reset does
    not lower it.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _child(workload: str, method: str, n: int, device: str, threads: int) -> dict[str, Any]:
    """Build, warm up (optimizer state, caches, compilation), then measure one step."""
    torch.set_num_threads(threads)
    quiet_compile_logs()
    cuda = device.startswith("cuda")
    w = WORKLOADS[workload]
    x, y = w.data(n, device=device)
    runner = METHODS[method].build(w, w.members(n, device=device), x, y, True)
    for _ in range(2):
        runner.step()
    sync(device)
    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        runner.step()
        sync(device)
        peak = torch.cuda.max_memory_allocated() - before
        return {"step_peak_bytes": peak, "resting_bytes": before}
    if not _reset_peak_rss():
        return {"error": "cannot reset the peak RSS (needs Linux /proc/self/clear_refs)"}
    before = _peak_rss_bytes()
    runner.step()
    return {"step_peak_bytes": _peak_rss_bytes() - before}


def step_memory(
    workload: str, method: str, n: int, *, device: str, threads: int, timeout: float = 600
) -> dict[str, Any]:
    """Peak memory of one training step above the resting state, in a fresh process.

    The resting state is the memory held between steps (weights, gradients left from
    the previous step, optimizer state, data), after two warm-up steps. On CPU the peak
    is the rise of the peak RSS (``VmHWM``) over one step after resetting it; on GPU of
    ``max_memory_allocated``, which also gives the resting state itself.
    """
    cmd = [sys.executable, "-m", "benchmarks.measure", workload, method, str(n)]
    cmd += ["--device", device, "--threads", str(threads)]
    return run_child(cmd, timeout=timeout)


def run_child(cmd: list[str], *, timeout: float) -> dict[str, Any]:
    """Run a memory-measuring child process; its last stdout line is a JSON dict.

    With glibc's default (dynamic) mmap threshold, a step's buffers are served from
    heap memory the warm-up steps already touched, and RSS never rises again. A fixed
    page-sized threshold returns every buffer of a page or more to the OS when freed,
    so each step's transient allocations show up in its own peak RSS. GLIBC_TUNABLES
    (which `benchmarks.run` pins for timing, keeping freed memory) would override it.
    """
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env.update(MALLOC_MMAP_THRESHOLD_="4096", MALLOC_TRIM_THRESHOLD_="0")
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {proc.returncode}: {tail[0]}"}
    return json.loads(lines[-1])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Training-step memory of one method.")
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("method", choices=sorted(METHODS))
    parser.add_argument("n", type=int)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    print(json.dumps(_child(args.workload, args.method, args.n, args.device, args.threads)))


if __name__ == "__main__":
    main()
