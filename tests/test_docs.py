"""Every ```python block in the docs pages and the README runs, page by page.

Blocks on one page share a fresh namespace and run in order, so a page reads as one
session. A block preceded by a ``<!-- skip -->`` line is not run (for code that needs
something optional, such as a GPU).
"""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [p for p in (ROOT / "docs").rglob("*.md") if p.name != "api.md"] + [ROOT / "README.md"]
)
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^\n`]*)$")
_SKIP = "<!-- skip -->"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line number, source)`` of each runnable ```python block, in order."""
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
        info = fence["info"].split()
        if info[:1] == ["python"] and previous != _SKIP:
            blocks.append((start + 2, "\n".join(body)))
        k += 1
    return blocks


def test_block_extraction():
    text = "\n".join(
        [
            "```python",
            "a = 1",
            "```",
            "<!-- skip -->",
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
    assert python_blocks(text) == [(2, "a = 1"), (13, "b = 2")]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_code_runs(page):
    blocks = python_blocks(page.read_text())
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for line, source in blocks:
            # Pad so tracebacks point at the line in the Markdown file.
            code = compile("\n" * (line - 1) + source, str(page.relative_to(ROOT)), "exec")
            exec(code, namespace)
