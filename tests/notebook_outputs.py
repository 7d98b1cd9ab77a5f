"""Execute the quickstart notebook and check or store its outputs.

The notebook is committed WITH its outputs, so that the docs site (mkdocs-jupyter, which
renders the stored outputs and runs nothing) shows its printouts and its plot. This
module is the one place that says how it is executed, for both users of it:

- ``make notebook`` (``python tests/notebook_outputs.py``) re-executes it and stores
  the result in place;
- tests/test_more_examples.py executes it in the test run and checks that the stored
  outputs are present, clean and the same as a fresh run's.

A run is made reproducible and free of anything machine-specific: one thread
(``OMP_NUM_THREADS=1``, as the seeded results depend on the summation order), the
inline matplotlib backend, a scratch working directory, no per-cell timing metadata, and
the kernel's ``language_info`` cut to the language's name (no Python version).
"""

import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
TIMEOUT_S = 120  # per cell; the whole notebook takes seconds

# What must never be stored: absolute paths of a machine (home, temporary and virtual
# environment folders, Windows drives) and tracebacks.
_MACHINE_SPECIFIC = re.compile(
    r"(/home/|/root/|/tmp/|/Users/|/work/|site-packages|\.venv|[A-Za-z]:\\|Traceback)"
)
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def read(path: Path = NOTEBOOK) -> Any:
    """The notebook at ``path``, validated against its nbformat schema."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    return nb


def execute(nb: Any) -> Any:
    """Run every cell of ``nb`` in a fresh kernel, storing the outputs in it; return it.

    The kernel runs this interpreter (jupyter_client puts ``sys.executable`` in place of
    the kernelspec's bare ``python``) on this checkout's ``funcensemble``. Raises
    ``nbclient.exceptions.CellExecutionError`` if a cell fails.
    """
    import nbclient

    env = {
        "OMP_NUM_THREADS": "1",
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        with tempfile.TemporaryDirectory() as scratch:
            client = nbclient.NotebookClient(
                nb,
                kernel_name="python3",
                timeout=TIMEOUT_S,
                record_timing=False,
                resources={"metadata": {"path": scratch}},
            )
            client.execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    nb.metadata.language_info = {"name": nb.metadata.language_info.get("name", "python")}
    return nb


def _text(output: Any) -> str:
    if output.output_type == "stream":
        return output.text
    return output.get("data", {}).get("text/plain", "")


def stored_output_problems(nb: Any) -> list[str]:
    """What is wrong with the outputs stored in ``nb`` (an empty list if nothing).

    Every code cell must have run, once, in order, in one fresh kernel (execution counts
    1, 2, 3, ...); every code cell but the first (the imports) must have outputs; at
    least one output must be an image; nothing may be an error, a message on stderr, a
    machine's path or per-cell timing metadata.
    """
    problems = []
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    if counts != list(range(1, len(code) + 1)):
        problems.append(
            f"execution counts are {counts}, expected 1 to {len(code)} in order "
            "(run the whole notebook once in a fresh kernel: make notebook)"
        )
    for k, cell in enumerate(code):
        if k > 0 and not cell.outputs:
            problems.append(f"code cell {k} has no stored outputs")
        if "execution" in cell.metadata or "ExecuteTime" in cell.metadata:
            problems.append(f"code cell {k} stores timing metadata")
        for output in cell.outputs:
            if output.output_type == "error":
                problems.append(f"code cell {k} stores an error: {output.ename}")
            elif output.output_type == "stream" and output.name == "stderr":
                problems.append(f"code cell {k} stores stderr: {output.text[:200]!r}")
            found = _MACHINE_SPECIFIC.search(_text(output))
            if found:
                problems.append(f"code cell {k} stores a machine-specific {found[0]!r}")
    images = [
        output for cell in code for output in cell.outputs if "image/png" in output.get("data", {})
    ]
    if not images:
        problems.append("no image output stored (the plot cell should display a figure)")
    if set(nb.metadata.get("language_info", {})) - {"name"}:
        problems.append("the notebook metadata stores the kernel's language_info details")
    return problems


def output_differences(stored: Any, fresh: Any, *, rel_tol: float = 0.01) -> list[str]:
    """Where the stored outputs of a notebook differ from a fresh run's.

    Per code cell: the same outputs, of the same kinds (stream, result, display) and
    formats (text/plain, image/png, ...), and the same text, with numbers equal to
    ``rel_tol`` plus one unit of their last printed digit (another CPU or torch build
    may round differently after hundreds of optimizer steps). Image bytes are not
    compared: they change with matplotlib's version.
    """
    differences = []
    stored_code = [cell for cell in stored.cells if cell.cell_type == "code"]
    fresh_code = [cell for cell in fresh.cells if cell.cell_type == "code"]
    if [c.source for c in stored_code] != [c.source for c in fresh_code]:
        return ["the two notebooks have different code cells"]
    for k, (old, new) in enumerate(zip(stored_code, fresh_code, strict=True)):
        shape_old = [(o.output_type, sorted(o.get("data", {}))) for o in old.outputs]
        shape_new = [(o.output_type, sorted(o.get("data", {}))) for o in new.outputs]
        if shape_old != shape_new:
            differences.append(f"code cell {k}: stored outputs {shape_old}, fresh {shape_new}")
            continue
        for a, b in zip(old.outputs, new.outputs, strict=True):
            text_a, text_b = _text(a), _text(b)
            if _NUMBER.sub("#", text_a) != _NUMBER.sub("#", text_b) or not all(
                _close(x, y, rel_tol)
                for x, y in zip(_NUMBER.findall(text_a), _NUMBER.findall(text_b), strict=True)
            ):
                differences.append(f"code cell {k}: stored {text_a!r}, fresh {text_b!r}")
    return differences


def _close(x: str, y: str, rel_tol: float) -> bool:
    def unit(number: str) -> float:  # one unit of the last printed digit
        mantissa, _, exponent = number.lower().partition("e")
        decimals = len(mantissa.partition(".")[2])
        return 10.0 ** (int(exponent or 0) - decimals)

    a, b = float(x), float(y)
    return abs(a - b) <= rel_tol * max(abs(a), abs(b)) + max(unit(x), unit(y))


def main(argv: list[str] | None = None) -> int:
    """Re-execute the notebook(s) given (default: the quickstart) and store the outputs."""
    import nbformat

    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)] or [NOTEBOOK]
    for path in paths:
        nb = execute(read(path))
        problems = stored_output_problems(nb)
        if problems:
            print(f"{path}: not stored:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 1
        nbformat.write(nb, path)
        print(f"{path}: executed, outputs stored")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
