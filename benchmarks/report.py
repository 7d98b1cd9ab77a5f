"""Results as Markdown tables (printed and written) and a log-log plot of time against N."""

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .methods import METHODS
from .workloads import WORKLOADS

MODES = {"infer": "inference forward (no_grad)", "train": "training step (MSE, backward, Adam)"}


@dataclass
class Row:
    """One method at one (workload, mode, N)."""

    workload: str
    mode: str
    n: int
    method: str
    status: str  # "ok", or why there is no timing (skipped, unsupported, mismatch, error)
    flops: int
    median_s: float | None = None
    iqr_s: float | None = None
    first_call_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return ""
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 1000 else f"{ms:.0f}"


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.2g}%" if fraction < 0.1 else f"{100 * fraction:.0f}%"


def _mib(nbytes: float | None) -> str:
    return "" if nbytes is None else f"{nbytes / 2**20:.1f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if r else ("-" * (w + 2))
            for w, r in zip(widths, right, strict=True)
        )
        + "|"
    )
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def timing_table(rows: Sequence[Row], peak_gflops: float) -> str:
    """One workload and mode: a row per (N, method), ratios against the loop of that N."""
    loop = {r.n: r.median_s for r in rows if r.method == "loop" and r.ok}
    header = [
        "N",
        "method",
        "median ms",
        "IQR ms",
        "vs loop",
        "GFLOP/s",
        "% mm peak",
        "compile s",
        "note",
    ]
    out = []
    for r in rows:
        if not r.ok:
            out.append([str(r.n), r.method, "", "", "", "", "", "", r.status])
            continue
        assert r.median_s is not None
        base = loop.get(r.n)
        gflops = r.flops / r.median_s / 1e9
        out.append(
            [
                str(r.n),
                r.method,
                _ms(r.median_s),
                _ms(r.iqr_s),
                f"{base / r.median_s:.2f}x" if base else "",
                f"{gflops:.3g}",
                _percent(gflops / peak_gflops),
                f"{r.first_call_s:.1f}" if METHODS[r.method].compiled else "",
                "",
            ]
        )
    return _table(header, out, [True, False, True, True, True, True, True, True, False])


def memory_table(memory: dict[str, dict[str, Any]], n: int, device: str) -> str:
    cuda = device.startswith("cuda")
    how = "max_memory_allocated" if cuda else "peak RSS"
    header = ["method", f"step peak MiB ({how}, N={n})"] + (["resting MiB"] if cuda else [])
    out = []
    for method, m in memory.items():
        cells = [method, m.get("error") or _mib(m["step_peak_bytes"])]
        out.append(cells + ([_mib(m.get("resting_bytes"))] if cuda else []))
    return _table(header, out, [False, True, True][: len(header)])


def markdown(
    rows: Sequence[Row],
    memory: dict[str, dict[str, dict[str, Any]]],
    meta: dict[str, Any],
    plot_name: str | None,
) -> str:
    """The whole report: machine, then per workload its timing and memory tables."""
    parts = [
        f"# Benchmarks: {meta['machine']}",
        "",
        f"`{meta['command']}` on {meta['date']}.",
        "",
        f"- device: {meta['device_name']}; torch {meta['torch']}, {meta['threads']} thread(s)",
        f"- float32 `torch.mm` peak (best block of {meta['mm_size'] // 2} and "
        f"{meta['mm_size']} square products, at the start and the end of the run): "
        f"{meta['peak_gflops']:.1f} GFLOP/s",
        "- timing: `torch.utils.benchmark.Timer.blocked_autorange` on "
        + ("the thread's CPU time (`--clock cpu`)" if meta.get("clock") == "cpu" else "wall time")
        + f", {meta['rounds']} rounds "
        f"interleaved across methods, min {meta['min_run_time']} s each; median and "
        "interquartile range of the per-block times",
        "- every method's outputs (inference) or parameters and buffers after "
        f"{meta['check_steps']} training steps were checked against the loop before timing; "
        "all start from the same N modules",
        "- vs loop: the loop's median over the method's (higher is faster); GFLOP/s counts "
        "only matmul/conv FLOPs (training: forward, weight and input gradients); "
        f"compile s: the first call, compilation included (inductor caches "
        f"{meta['compile_caches']})",
        (
            "- malloc: the system's (glibc's adaptive thresholds, as users run)"
            if meta.get("malloc", "system default") == "system default"
            else f"- malloc: `GLIBC_TUNABLES={meta['malloc']}` (pinned with `--pin-malloc`: "
            "see `MALLOC_TUNABLES` in `benchmarks/run.py`)"
        ),
        "- step peak: memory of one training step above the resting state (weights, "
        "gradients, optimizer state, data), measured after two warm-up steps in a fresh "
        "process per method",
        "",
    ]
    if plot_name:
        parts += [f"![time vs N]({plot_name})", ""]
    for key in dict.fromkeys(r.workload for r in rows):
        parts += [f"## {WORKLOADS[key].title}", ""]
        for mode, title in MODES.items():
            sub = [r for r in rows if r.workload == key and r.mode == mode]
            if sub:
                parts += [f"### {title}", "", timing_table(sub, meta["peak_gflops"]), ""]
        if memory.get(key):
            n = max(r.n for r in rows if r.workload == key)
            parts += [
                "### memory of a training step",
                "",
                memory_table(memory[key], n, meta["device"]),
                "",
            ]
    return "\n".join(parts)


def plot(rows: Sequence[Row], path: Path, title: str) -> bool:
    """Time against N, log-log, a panel per (workload, mode). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keys = list(dict.fromkeys(r.workload for r in rows))
    fig, axes = plt.subplots(len(keys), 2, figsize=(11, 3.6 * len(keys)), squeeze=False)
    methods = [m for m in METHODS if any(r.method == m for r in rows)]
    # tab20's darker half, then its lighter half: 20 distinct colors in a stable order.
    palette = plt.get_cmap("tab20")
    colors = {m: palette((2 * i) % 20 + (2 * i) // 20) for i, m in enumerate(methods)}
    markers = dict(zip(methods, "os^vDPX*<>h", strict=False))
    for i, key in enumerate(keys):
        for j, mode in enumerate(MODES):
            ax = axes[i][j]
            for method in methods:
                pts = sorted(
                    (r.n, r.median_s, r.iqr_s)
                    for r in rows
                    if (r.workload, r.mode, r.method) == (key, mode, method) and r.ok
                )
                if not pts:
                    continue
                ns, med, iqr = zip(*pts, strict=True)
                ours = method.startswith("fe.")
                ax.errorbar(
                    [*ns],
                    [1e3 * t for t in med],
                    yerr=[5e2 * q for q in iqr],  # +- half the interquartile range
                    fmt=("-" if ours else "--") + markers.get(method, "o"),
                    lw=1.6 if ours else 1.0,
                    ms=4,
                    capsize=2,
                    color=colors[method],
                    label=method,
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{key}: {MODES[mode]}", fontsize=9)
            ax.set_xlabel("members N")
            ax.set_ylabel("ms per call")
            ax.grid(True, which="both", alpha=0.3)
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    order = [m for m in methods if m in handles]
    fig.legend([handles[m] for m in order], order, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06 + 0.02 * (len(handles) // 4), 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def as_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


def write(
    rows: Sequence[Row],
    memory: dict[str, dict[str, dict[str, Any]]],
    meta: dict[str, Any],
    out: Path,
    *,
    optimizer_step: str | None = None,
) -> Path:
    """Write ``<machine>.md``, ``.png`` and ``.json`` into ``out``; returns the ``.md``.

    ``optimizer_step``: the Markdown table of `benchmarks.optimizer_step`, if it ran.
    """
    out.mkdir(parents=True, exist_ok=True)
    name = meta["machine"]
    png = out / f"{name}.png"
    plotted = plot(rows, png, f"{meta['device_name']}, {meta['threads']} thread(s)")
    md = out / f"{name}.md"
    text = markdown(rows, memory, meta, png.name if plotted else None)
    if optimizer_step:
        text += "\n\n## The optimizer step alone\n\n" + optimizer_step
    md.write_text(text + "\n")
    data = {"meta": meta, "rows": as_json(rows), "memory": memory, "optimizer_step": optimizer_step}
    (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    return md


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m benchmarks.report RESULTS.json``: rewrite its tables and plot."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("results", type=Path, help="a .json written by benchmarks.run")
    args = parser.parse_args(argv)
    data = json.loads(args.results.read_text())
    rows = [Row(**r) for r in data["rows"]]
    md = write(
        rows,
        data["memory"],
        data["meta"],
        args.results.parent,
        optimizer_step=data.get("optimizer_step"),
    )
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
