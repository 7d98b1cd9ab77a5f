"""A whole training step (forward, loss, grads, optimizer update) under torch.compile."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("compile_check.py")


def run_check(face: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), face], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("OK")


# `newest`: make test-newest runs these too, on the newest torch CI tests (what torch 2.14
# changed, and a whole fullgraph step of each face).
NEWEST = pytest.mark.newest


@pytest.mark.slow
@pytest.mark.parametrize(
    "face",
    [
        pytest.param("functional", marks=NEWEST),
        "in_place",
        "module",
        pytest.param("mlp", marks=NEWEST),
        "frozen",
        "functional_mlp",
        "functional_mlp_vmap",
        "nested_vmap",
        "polyak",
        "partition",
        "rebound_buffer",
        "wrong_shape",
        "optimizer_limits",
        "transform_swaps",
        "cumulative_batch_norm",
        pytest.param("shared_input_in_place", marks=NEWEST),
        "embedding_max_norm",
        "container_under_compile",
        pytest.param("dict_inputs", marks=NEWEST),
        pytest.param("float64_steps", marks=NEWEST),
        "attention_autocast",
        pytest.param("forward_mode", marks=NEWEST),
        "user_mode",
    ],
)
def test_compiled_training_step_matches_eager(face):
    """fullgraph=True compile of a full step equals eager for 3 steps (see the script)."""
    run_check(face)


@pytest.mark.slow
def test_compiled_apply_updates_on_trainable_params_is_a_clear_error():
    """apply_updates cannot return new leaves that require grad from a compiled graph:
    it says so and points to update_, and the parameters are untouched."""
    run_check("pure_refused")


@pytest.mark.slow
@NEWEST
def test_compiled_randomness_limits_are_as_documented():
    """compile.md: randomness="same" with chunk_size needs a graph break; "error" stops
    with torch's wording (see the script)."""
    run_check("randomness_limits")


@pytest.mark.slow
@NEWEST
def test_compiled_second_derivatives_are_as_documented():
    """compile.md: grad of grad through the MLP ops is refused naming them; hessian stops
    under fullgraph and otherwise computes what eager code does (see the script)."""
    run_check("second_derivatives")
