"""The examples run, in quick mode, and check what they claim."""

from pathlib import Path
from types import ModuleType

import pytest
from helpers import load_example

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str) -> ModuleType:
    return load_example(name)


def test_multihead_quick_agrees_with_the_loop(capsys):
    multihead = load("multihead")
    results = multihead.main(["--quick"])
    out = capsys.readouterr().out
    assert len(results) == len(multihead.variants()) >= 2
    for r in results:
        assert r.losses.shape == (16,)
        assert r.steps_per_s > 0
        assert r.name in out
    assert "end at the same loss in every variant" in out


def test_multihead_options():
    multihead = load("multihead")
    results = multihead.main(["--heads", "3", "--steps", "2", "--batch", "5"])
    assert [r.losses.shape for r in results] == [(3,)] * len(results)


def test_multihead_fails_when_a_variant_disagrees(monkeypatch):
    multihead = load("multihead")
    loop = multihead.loop_variant

    def off_by_a_step(heads, x, y):
        step, trained = loop(heads, x, y)
        step()  # one extra step: different final losses
        return step, trained

    found = multihead.variants()
    monkeypatch.setattr(multihead, "variants", lambda: {**found, "broken": off_by_a_step})
    with pytest.raises(AssertionError, match="broken: per-head final losses differ"):
        multihead.main(["--heads", "4", "--steps", "3"])


def test_multihead_rejects_bad_options():
    multihead = load("multihead")
    with pytest.raises(SystemExit):
        multihead.main(["--heads", "0"])


def test_every_example_is_tested():
    tests = Path(__file__).resolve().parent
    sources = "\n".join(p.read_text() for p in tests.glob("test_*.py"))
    untested = [p.name for p in sorted(EXAMPLES.glob("*.py")) if p.stem not in sources]
    assert not untested, f"examples without a test running them: {untested}"
