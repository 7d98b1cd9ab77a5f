"""Elastic training: joining in a store an earlier attempt wrote to, torchrun restarts, and
resuming from sharded checkpoints (funcensemble/_handshake.py, _rendezvous.py and
examples/elastic_training.py)."""

import os
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import assert_trees_equal, load_example

import funcensemble as fe
from funcensemble.distributed._handshake import Outcome, handshake

ROOT = Path(__file__).resolve().parent.parent
HARD_TIMEOUT = 150.0  # seconds for one torchrun job (two attempts) on a busy machine
POLL = 0.01


def _server() -> dist.TCPStore:
    """A store server on a free port, standing in for torchrun's agent."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)


def _client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)


def _run_ranks(server: dist.TCPStore, ranks: list[int], world: int, seconds: float) -> dict:
    """Run the handshake of ``ranks`` in threads, each with its own store client."""
    outcomes: dict[int, Outcome | BaseException] = {}
    deadline = time.monotonic() + seconds

    def run(rank: int) -> None:
        try:
            outcomes[rank] = handshake(_client(server), rank, world, deadline, POLL)
        except BaseException as error:  # reported by the test
            outcomes[rank] = error

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
        time.sleep(0.05)  # the ranks start in the given order
    for t in threads:
        t.join()
    return outcomes


def _stale_attempt(store: dist.TCPStore, world: int) -> None:
    """What a finished (or crashed) earlier attempt leaves in a store that outlives it."""
    for rank in range(1, world):
        store.set(f"funcensemble/rendezvous/hello/{rank}", "oldnonce")
        store.set(f"funcensemble/rendezvous/welcome/{rank}", "oldnonce oldgeneration")
    for rank in range(world):
        store.set(f"funcensemble/rendezvous/oldgeneration/joined/{rank}", "1")


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0], [1, 0, 2]])
def test_ranks_agree_on_a_namespace_no_earlier_attempt_used(order):
    server = _server()
    _stale_attempt(server, 3)
    outcomes = _run_ranks(server, order, 3, seconds=20)
    generations = {r: o.generation for r, o in outcomes.items() if isinstance(o, Outcome)}
    assert len(generations) == 3, outcomes
    assert all(outcomes[r].complete for r in range(3)), outcomes  # type: ignore[union-attr]
    assert len(set(generations.values())) == 1
    assert generations[0] not in ("oldgeneration", None)
    # A second attempt in the same store gets another namespace again.
    again = _run_ranks(server, [1, 2, 0], 3, seconds=20)
    fresh = {o.generation for o in again.values()}  # type: ignore[union-attr]
    assert len(fresh) == 1 and fresh.isdisjoint({generations[0], "oldgeneration"})


def test_a_missing_rank_is_named_at_the_deadline():
    server = _server()
    _stale_attempt(server, 3)  # the old attempt's keys must not count as joined
    outcomes = _run_ranks(server, [0, 1], 3, seconds=1)
    assert outcomes[0] == Outcome(outcomes[0].generation, (2,))  # type: ignore[union-attr]
    assert outcomes[1] == outcomes[0]
    (alone,) = _run_ranks(_server(), [1], 2, seconds=0.5).values()
    assert alone == Outcome(None, (0,))  # never welcomed: rank 0 is missing


def _agent_store_launch(monkeypatch, rank: int, world: int, port: int) -> None:
    for name, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "1",
    }.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(
    ("rank", "who"),
    [
        (0, r"Rank\(s\) 1 never joined \(1 of 2 did\)"),
        (1, r"Rank 0 never answered this rank's hello"),
    ],
)
def test_a_rank_that_never_joins_torchruns_store_fails_at_the_join_timeout(monkeypatch, rank, who):
    """One rank of two, in a store like torchrun's (served by the agent, not by rank 0,
    and holding an earlier attempt's keys): it fails at ``join_timeout``, naming the
    rank that never came, not at the collectives' ``timeout``."""
    server = _server()
    _stale_attempt(server, 2)
    _agent_store_launch(monkeypatch, rank, 2, server.port)
    init = fe.distributed.init_process_group  # imported before the clock starts
    start = time.monotonic()
    with pytest.raises(fe.distributed.DistributedError) as info:
        init("gloo", timeout=timedelta(seconds=60), join_timeout=timedelta(seconds=1))
    elapsed = time.monotonic() - start
    assert not dist.is_initialized()
    assert re.fullmatch(
        rf"init_process_group: rank {rank} of 2 failed while waiting for all 2 ranks to join "
        rf"the rendezvous at 127\.0\.0\.1:{server.port}, after 1\.\d s \(join_timeout 1 s\)\. "
        rf"{who}.*Their own output says which\.",
        str(info.value),
    ), str(info.value)
    error = info.value
    assert (error.rank, error.world_size, error.operation) == (rank, 2, "init_process_group")
    assert error.timeout == timedelta(seconds=1) and 1 <= error.waited <= elapsed
    print(f"rank {rank}: failed {elapsed:.2f} s after init_process_group(join_timeout=1 s)")


# --- torchrun --max-restarts ------------------------------------------------------------


def _torchrun(args: list[str], out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torchrun's default: shared store
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            "--monitor-interval=0.1",
            str(ROOT / "examples" / "elastic_training.py"),
            *args,
            "--out",
            str(out),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HARD_TIMEOUT,
        check=False,
    )


def _final_checkpoint(example, out: Path, members: int) -> dict:
    """The last checkpoint of a run, read in this one process (all members)."""
    params = {
        k: torch.zeros_like(v)
        for k, v in fe.Ensemble.from_factory(example.make_member, num_members=members)
        .stacked_params()
        .items()
    }
    template = {"params": params, "opt": fe.optim.adam(1e-2).init(params), "step": 0, "batch": 0}
    return fe.distributed.load(example.checkpoint(out, example.QUICK["steps"]), template)


@pytest.mark.multiprocess
@pytest.mark.slow  # two attempts of two ranks start up on two shared cores
def test_a_rank_killed_mid_run_is_restarted_and_the_run_ends_as_if_never_stopped(tmp_path):
    """Rank 1 kills itself (SIGKILL) after step 10 of 12; torchrun restarts both ranks,
    which resume from the step-8 checkpoint. The parameters and Adam's state at the end
    are bitwise those of a run that never stopped (float64)."""
    example = load_example("elastic_training")
    members, steps = example.QUICK["members"], example.QUICK["steps"]
    resumed = tmp_path / "resumed"
    result = _torchrun(["--quick", "--quiet", "--crash-after", "10"], resumed)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert "rank 1: killing itself after step 10" in log, log[-4000:]
    assert re.search(r"exitcode\s*:?\s*-9", log), log[-4000:]  # torchrun saw the SIGKILL
    assert "resumed from step 8" in log and "from step 8" in log, log[-4000:]
    assert f"done: step {steps}" in log
    assert (resumed / example.MARKER).is_file()
    assert example.complete_steps(resumed) == [8, 12]  # --keep 2

    straight = tmp_path / "straight"  # the same run in one process, never stopped
    ran = example.main(["--quick", "--quiet", "--out", str(straight)])
    got, want = (_final_checkpoint(example, d, members) for d in (resumed, straight))
    assert got["step"] == want["step"] == steps
    assert_trees_equal(got["params"], want["params"])
    assert_trees_equal(got["opt"], want["opt"])
    assert_trees_equal(want["params"], ran["params"])
    assert next(iter(want["params"].values())).dtype == torch.float64


def test_the_example_resumes_from_its_newest_complete_checkpoint(tmp_path, capsys):
    """In one process: a checkpoint left half-written (no checksum file, as after a
    crash mid-save) is removed and redone; the run resumes from the complete one."""
    example = load_example("elastic_training")
    out = tmp_path / "run"
    straight = example.main(["--quick", "--quiet", "--out", str(out)])
    (out / "step-000012" / ".funcensemble-checksums").unlink()  # step 12 never completed
    capsys.readouterr()
    again = example.main(["--quick", "--quiet", "--out", str(out)])
    assert "resumed from step 8" in capsys.readouterr().out
    assert example.complete_steps(out) == [8, 12]
    assert_trees_equal(again, straight)


def test_the_example_refuses_a_resume_with_other_options(tmp_path, capsys):
    """A rerun asking for fewer steps than its newest checkpoint returned that step's
    state as --steps' ("done: step 6" with step 12's parameters), and one with another
    --batch matched neither run: both are refused now. A folder of the user's named
    step-* is left alone."""
    example = load_example("elastic_training")
    out = tmp_path / "run"
    example.main(["--quick", "--quiet", "--out", str(out)])  # checkpoints at 8 and 12
    (out / "step-notes").mkdir()
    for options in (["--steps", "6"], ["--steps", "16", "--batch", "8"]):
        with pytest.raises(SystemExit, match=r"step-000012 was written with --batch 16 at step 12"):
            example.main(["--members", "5", "--every", "4", "--quiet", "--out", str(out), *options])
    resumed = example.main(
        ["--members", "5", "--every", "4", "--steps", "16", "--quiet", "--out", str(out)]
    )
    assert resumed["step"] == 16 and example.complete_steps(out) == [12, 16]
    assert (out / "step-notes").is_dir()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--steps", "12", "--crash-after", "12"], "--crash-after must be a step from 1 to"),
        (["--crash-after", "0"], "--crash-after must be a step from 1 to"),
        (["--crash-after", "3", "--crash-rank", "1"], "--crash-rank 1 is not a rank of this run"),
    ],
)
def test_the_example_refuses_a_crash_that_would_not_happen(tmp_path, options, message, capsys):
    example = load_example("elastic_training")
    with pytest.raises(SystemExit) as stopped:
        example.main(["--quick", "--quiet", "--out", str(tmp_path / "run"), *options])
    code = stopped.value.code  # argparse's error prints to stderr and exits with 2
    assert message in (code if isinstance(code, str) else capsys.readouterr().err)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_the_example_names_a_checkpoint_written_before_it_saved_the_batch(tmp_path):
    example = load_example("elastic_training")
    out = tmp_path / "run"
    example.main(["--quick", "--quiet", "--out", str(out)])
    saved = _final_checkpoint(example, out, example.QUICK["members"])
    del saved["batch"]  # what the example wrote before it saved --batch
    fe.distributed.save(example.checkpoint(out, 16), saved)
    with pytest.raises(SystemExit, match=r"step-000016 was written by an earlier version"):
        example.main(
            ["--members", "5", "--steps", "20", "--every", "4", "--quiet", "--out", str(out)]
        )
