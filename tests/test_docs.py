"""Every ```python block in the docs pages and the README runs, page by page.

Blocks on one page share a fresh namespace and run in order, so a page reads as one
session. Two exceptions, both listed here and nowhere else:

- A block preceded by ``<!-- needs: gpu -->`` or ``<!-- needs: several machines -->``
  runs only where that hardware is present; ``NEEDS`` lists every such block, so
  hiding a block from the tests is a deliberate, reviewed change. No other marker
  skips a block.
- The pages in ``FRESH_INTERPRETER`` run in a child Python without the test run's
  jaxtyping import hook, whose wrappers ``torch.compile`` cannot trace (users compile
  the plain library). They take a while, so they are marked slow.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [p for p in (ROOT / "docs").rglob("*.md") if p.name != "api.md"] + [ROOT / "README.md"]
)
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^\n`]*)$")
_MARKER = re.compile(r"^<!--\s*(?P<what>[a-z]+)(:\s*(?P<arg>[^>]*?))?\s*-->$")

# Hardware CI lacks, and how to tell whether this machine has it.
HARDWARE = {
    "gpu": torch.cuda.is_available,
    "several machines": lambda: False,
}
# Every block that needs such hardware: page -> what each of its marked blocks needs.
NEEDS = {
    "docs/how-to/chunking.md": ["gpu"],
    "docs/how-to/scale-out.md": ["gpu"],
}
FRESH_INTERPRETER = {"docs/how-to/compile.md"}


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """``(first line number, source, needed hardware or None)`` of each ```python block."""
    blocks, lines, k = [], text.splitlines(), 0
    while k < len(lines):
        fence = _FENCE.match(lines[k])
        if not fence:
            k += 1
            continue
        start, indent = k, fence["indent"]
        k += 1
        while k < len(lines) and lines[k].strip() != "```":
            k += 1
        body = [line.removeprefix(indent) for line in lines[start + 1 : k]]
        previous = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        marker = _MARKER.match(previous)
        needs = None
        if marker and marker["what"] != "needs":
            raise ValueError(
                f"line {start}: unknown marker {previous!r} before a code block. Only "
                f"'<!-- needs: X -->' (X in {sorted(HARDWARE)}) keeps a block from running."
            )
        if marker:
            needs = marker["arg"]
            if needs not in HARDWARE:
                raise ValueError(
                    f"line {start}: {previous!r} names unknown hardware (expected one of "
                    f"{sorted(HARDWARE)})."
                )
        if fence["info"].split()[:1] == ["python"]:
            blocks.append((start + 2, "\n".join(body), needs))
        k += 1
    return blocks


def run_page(page: Path) -> list[int]:
    """Run the page's blocks in one namespace; the line numbers of those not run."""
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    not_run = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for line, source, needs in python_blocks(page.read_text()):
            if needs is not None and not HARDWARE[needs]():
                not_run.append(line)
                continue
            # Pad so tracebacks point at the line in the Markdown file.
            code = compile("\n" * (line - 1) + source, str(page.relative_to(ROOT)), "exec")
            exec(code, namespace)
    return not_run


def test_every_editable_install_keeps_the_package_visible_to_type_checkers():
    # The default editable install of this layout is an import hook, which mypy and
    # pyright do not run: an install guide whose commands use it contradicts the README.
    for page in (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))):
        for line in page.read_text().splitlines():
            if re.match(r"\s*pip install -e\b", line):  # a command, in a shell block
                assert "editable_mode=compat" in line, f"{page.relative_to(ROOT)}: {line}"


def test_block_extraction():
    text = "\n".join(
        [
            "```python",
            "a = 1",
            "```",
            "<!-- needs: gpu -->",
            "```python",
            "needs_a_gpu()",
            "```",
            "```bash",
            "make test",
            "```",
            "- item",
            "    ```python",
            "    b = 2",
            "    ```",
        ]
    )
    assert python_blocks(text) == [
        (2, "a = 1", None),
        (6, "needs_a_gpu()", "gpu"),
        (13, "b = 2", None),
    ]
    with pytest.raises(ValueError, match="unknown marker"):
        python_blocks("<!-- skip -->\n```python\nx = 1\n```")
    with pytest.raises(ValueError, match="unknown hardware"):
        python_blocks("<!-- needs: a quantum computer -->\n```python\nx = 1\n```")


def test_every_block_kept_from_running_is_listed():
    marked = {}
    for page in PAGES:
        needs = [n for _, _, n in python_blocks(page.read_text()) if n is not None]
        if needs:
            marked[str(page.relative_to(ROOT))] = needs
    assert marked == NEEDS


def _page_param(page: Path):
    name = str(page.relative_to(ROOT))
    marks = [pytest.mark.slow] if name in FRESH_INTERPRETER else []
    return pytest.param(page, id=name, marks=marks)


@pytest.mark.parametrize("page", [_page_param(p) for p in PAGES])
def test_page_code_runs(page):
    if str(page.relative_to(ROOT)) in FRESH_INTERPRETER:
        done = subprocess.run(
            [sys.executable, __file__, str(page)], capture_output=True, text=True, timeout=500
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return
    run_page(page)


if __name__ == "__main__":  # a page in FRESH_INTERPRETER, run by test_page_code_runs
    sys.path.insert(0, str(ROOT))
    run_page(Path(sys.argv[1]))
