"""A process that saves checkpoints in a loop and is killed mid-save, for test_checkpoint.py.

``python kill_during_save.py PATH`` imports torch and funcensemble once, saves
generation 0 to ``PATH`` (twice) and prints ``ready SECONDS`` (how long the second save took). Then,
for each line ``TRIAL DELAY`` read from stdin, it forks a child that saves generations
``TRIAL * 1000 + 1``, ``+ 2``, ... to ``PATH`` without pause, kills the child with
SIGKILL after ``DELAY`` seconds, reaps it, and prints ``killed PID SAVES``: the child's
pid and how many of its saves had returned. Forking (rather than starting a process per
trial) keeps the import of torch out of every trial.
"""

import os
import signal
import sys
import time
import warnings

import torch

import funcensemble as fe

MEGABYTES = 20


def base() -> torch.Tensor:
    """The checkpoint's tensor before its generation is added: 20 MB of float64."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(MEGABYTES * 2**20 // 8, generator=g, dtype=torch.float64)


def generation(values: torch.Tensor, g: int) -> dict:
    return {"w": values + g, "generation": g}


def _saver(path: str, values: torch.Tensor, first: int, done: int) -> None:
    g = first
    while True:
        fe.save(path, generation(values, g))
        os.write(done, b"x")
        g += 1


def main() -> None:
    path = sys.argv[1]
    values = base()
    fe.save(path, generation(values, 0))
    start = time.perf_counter()  # the second save: no first-touch costs
    fe.save(path, generation(values, 0))
    print(f"ready {time.perf_counter() - start}", flush=True)
    for line in sys.stdin:
        trial, delay = line.split()
        read, write = os.pipe()
        with warnings.catch_warnings():  # forking with torch loaded: the child only saves
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                _saver(path, values, int(trial) * 1000 + 1, write)
            finally:
                os._exit(1)
        os.close(write)
        time.sleep(float(delay))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        saves = 0
        while chunk := os.read(read, 4096):
            saves += len(chunk)
        os.close(read)
        print(f"killed {pid} {saves}", flush=True)


if __name__ == "__main__":
    main()
