"""Smoke tests of the benchmark suite: every method still computes what the loop does.

Tiny sizes, float64, one or two steps, no timing assertions: this only keeps
``python -m benchmarks.run`` from rotting as the library changes.
"""

import json
import subprocess
import sys

import pytest
import torch

from benchmarks import measure, run
from benchmarks.methods import METHODS, Unsupported
from benchmarks.workloads import WORKLOADS

# Known limitations of other libraries, reported as such in the tables.
UNSUPPORTED = {("tensordict", "C")}


def _cases():
    for wk, w in WORKLOADS.items():
        for mode in ("infer", "train"):
            for mk, m in METHODS.items():
                if mk == "loop" or not m.applies(w, mode):
                    continue
                if m.compiled and wk == "L":
                    continue  # compiled as S is (a wider MLP, the same path): CI time
                marks = [pytest.mark.slow] if m.compiled else []
                yield pytest.param(wk, mode, mk, id=f"{wk}-{mode}-{mk}", marks=marks)


# Compiled methods run in a fresh interpreter, as users run them: the test run's
# jaxtyping/beartype instrumentation of funcensemble is not traceable by dynamo.
COMPILED_CHECK = """
import sys
from benchmarks.measure import check_against_loop
print("MISMATCH", check_against_loop(*sys.argv[1:4]) or "none")
"""


@pytest.mark.parametrize(("workload", "mode", "method"), list(_cases()))
def test_method_matches_loop(workload, mode, method):
    why = METHODS[method].unavailable(mode)
    if why:
        pytest.skip(why)
    if (method, workload) in UNSUPPORTED:
        with pytest.raises(Unsupported):
            measure.check_against_loop(workload, mode, method)
    elif METHODS[method].compiled:
        done = subprocess.run(
            [sys.executable, "-c", COMPILED_CHECK, workload, mode, method],
            capture_output=True, text=True, timeout=300, cwd=measure.ROOT, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().splitlines()[-1] == "MISMATCH none"
    else:
        assert measure.check_against_loop(workload, mode, method) is None


def test_compare_reports_a_difference():
    ref = measure.Checked({"w": torch.zeros(3, 2, dtype=torch.float64)}, 0.0)
    got = measure.Checked({"w": torch.full((3, 2), 1e-3, dtype=torch.float64)}, 0.0)
    assert "w" in measure.compare(got, ref, train=True, dtype=torch.float64)
    other = measure.Checked({"v": torch.zeros(3, 2, dtype=torch.float64)}, 0.0)
    assert "keys" in measure.compare(other, ref, train=True, dtype=torch.float64)


def test_compare_allows_a_few_float32_adam_outliers():
    # Adam turns float32 rounding noise in a near-zero gradient into a step of up to lr.
    ref = measure.Checked({"w": torch.zeros(1000)}, 0.0)
    few, many = torch.zeros(1000), torch.zeros(1000)
    few[3] = many[:10] = 5e-4
    check = lambda got: measure.compare(  # noqa: E731
        measure.Checked({"w": got}, 0.0), ref, train=True, dtype=torch.float32
    )
    assert check(few) is None
    assert "10 of 1000 elements" in check(many)
    assert "largest" in check(torch.full((1000,), 1e-2) * (torch.arange(1000) == 0))


def test_flops_of_the_heads():
    # Linear(8,32)-Tanh-Linear(32,4) over 256 rows: 2*256*(8*32 + 32*4) per forward.
    forward = 2 * 256 * (8 * 32 + 32 * 4)
    assert WORKLOADS["S"].flops(5, train=False) == 5 * forward
    # Training adds the weight gradients, and input gradients of the second layer only.
    assert WORKLOADS["S"].flops(5, train=True) == 5 * (2 * forward + 2 * 256 * 32 * 4)


def test_run_writes_the_report(tmp_path, capsys):
    rows = run.main(
        ["--quick", "--workloads", "S,C", "--methods", "fe.Ensemble,conv1d", "--sizes", "2",
         "--threads", "1", "--rounds", "1", "--min-run-time", "0.001", "--no-memory",
         "--name", "smoke", "--out", str(tmp_path)]
    )  # fmt: skip
    assert {(r.workload, r.method) for r in rows} == {
        (w, m) for w in "SC" for m in ("loop", "fe.Ensemble")
    } | {("S", "conv1d")}
    assert all(r.ok and r.median_s > 0 for r in rows)
    text = (tmp_path / "smoke.md").read_text()
    assert "## S:" in text and "## C:" in text and "fe.Ensemble" in text
    saved = json.loads((tmp_path / "smoke.json").read_text())
    assert len(saved["rows"]) == len(rows)
    assert "| 2 | loop" in capsys.readouterr().out
    assert "## The optimizer step alone" in text and "| S | 2 | fe.optim.adam update_ |" in text
    assert saved["optimizer_step"] in text


def test_pin_malloc_reruns_once_with_fixed_thresholds(monkeypatch):
    calls = []
    monkeypatch.setattr(run.os, "execve", lambda *args: calls.append(args))
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    run.pin_malloc(["--quick"])  # not asked for: no re-run
    monkeypatch.setenv("GLIBC_TUNABLES", "set.by.the.user=1")
    run.pin_malloc(["--quick", "--pin-malloc"])  # already pinned (or the user's own)
    monkeypatch.delenv("GLIBC_TUNABLES")
    run.pin_malloc(["--quick", "--pin-malloc"])
    if sys.platform != "linux" or run.platform.libc_ver()[0] != "glibc":
        assert calls == []
        return
    ((_, argv, env),) = calls
    assert argv[1:] == ["-m", "benchmarks.run", "--quick", "--pin-malloc"]
    assert env["GLIBC_TUNABLES"] == run.MALLOC_TUNABLES


@pytest.mark.slow
def test_step_memory_in_a_subprocess():
    found = measure.step_memory("S", "loop", 2, device="cpu", threads=1, timeout=120)
    assert found.get("step_peak_bytes", -1) >= 0, found


def test_chunking_table(tmp_path, capsys):
    from benchmarks import chunking

    results = chunking.main(
        ["--members", "4", "--in-features", "3", "--hidden", "8", "--batch", "16",
         "--chunks", "None,3,1", "--rounds", "1", "--min-run-time", "0.001", "--no-memory",
         "--name", "smoke", "--out", str(tmp_path)]
    )  # fmt: skip
    assert [r.chunk_size for r in results["train"]] == [None, 3, 1]
    assert all(r.median_s > 0 for rows in results.values() for r in rows)
    text = (tmp_path / "smoke.md").read_text()
    assert "## Training step" in text and "## Inference" in text
    assert "| 3 | 2 | n/a |" in text  # 4 members in chunks of 3: two calls
    assert text in capsys.readouterr().out
    # One setting's memory, in a fresh process as in the full run.
    setup = chunking.Setup(members=4, in_features=3, hidden=8, batch=16)
    assert chunking.step_peak(setup, "train", 2, timeout=120).get("peak_bytes", -1) >= 0
    rows = [chunking.Row(k, 10e6 + 2e6 * k, 1.0) for k in (1, 2, 4)]
    fixed, per_member = chunking.fit([*rows, chunking.Row(None, 99e6, 1.0)], members=8)
    assert abs(fixed - 10e6) < 1 and abs(per_member - 2e6) < 1


def test_optimizer_step_methods_agree_and_time():
    from benchmarks import optimizer_step

    steps = optimizer_step.step_functions(*optimizer_step.stacked_case("S", 2))
    for step, _ in steps.values():
        step()
        step()
    reference = steps[optimizer_step.FUSED][1]()
    for method, (_, params) in steps.items():
        torch.testing.assert_close(
            {k: v.detach() for k, v in params().items()},
            {k: v.detach() for k, v in reference.items()},
            rtol=1e-5,
            atol=1e-6,
            msg=method,
        )
    rows = optimizer_step.optimizer_step_rows([("S", 2)], rounds=1, min_run_time=0.001)
    assert [r.method for r in rows] == list(optimizer_step.METHODS)
    assert all(r.seconds > 0 for r in rows)
    assert "| S | 2 | torch.optim.Adam(fused=True) |" in optimizer_step.markdown(rows)


def test_hetero_benchmark_methods_match_loop():
    from benchmarks import hetero

    assert hetero.check(per_structure=1, dtype=torch.float64) is None


def test_cpu_clock_needs_one_cpu_thread(capsys):
    assert run.parse(["--clock", "cpu", "--threads", "1"]).clock == "cpu"
    assert run.parse([]).clock == "wall"
    with pytest.raises(SystemExit):
        run.parse(["--clock", "cpu", "--threads", "2"])
    assert "--clock cpu times the calling thread" in capsys.readouterr().err
    assert measure.clock("cpu") is measure.time.thread_time
    assert measure.clock("wall") is measure.time.perf_counter
