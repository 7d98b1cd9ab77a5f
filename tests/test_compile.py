"""A whole training step (forward, loss, grads, Adam update) under torch.compile."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("compile_check.py")


@pytest.mark.slow
@pytest.mark.parametrize("face", ["functional", "in_place", "pure_refused", "module", "mlp"])
def test_compiled_training_step_matches_eager(face):
    """fullgraph=True compile of a full step equals eager for 3 steps (see the script)."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), face], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("OK")
