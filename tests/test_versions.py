"""The oldest versions the package declares are the ones `make test-oldest` tests."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def declared_ranges() -> dict[str, tuple[str, str | None]]:
    """``{name: (floor, cap or None)}`` of pyproject.toml's runtime dependencies."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.M | re.S)[1]  # no tomllib on 3.10
    requirements = re.findall(r'^\s*"([^"]+)"', block, re.M)
    ranges = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)(?:,<([0-9.]+))?", requirement)
        ranges[match[1]] = (match[2], match[3])
    assert len(ranges) == 5, requirements
    return ranges


def declared_floors() -> dict[str, str]:
    """``{name: floor}`` of pyproject.toml's runtime dependencies."""
    return {name: floor for name, (floor, _) in declared_ranges().items()}


def test_torch_is_capped_above_the_newest_release_ci_tests_and_nothing_else_is():
    """A torch newer than the one `make test-newest` installs is not tested (2.14.1
    changed what compiles, and one compiled call's result)."""
    newest = re.search(
        r"^TORCH_NEWEST := torch==(\d+)\.(\d+)\.\d+$", (ROOT / "Makefile").read_text(), re.M
    )
    caps = {name: cap for name, (_, cap) in declared_ranges().items() if cap is not None}
    assert caps == {"torch": f"{newest[1]}.{int(newest[2]) + 1}"}
    for doc in (ROOT / "README.md", ROOT / "docs" / "how-to" / "versions.md"):
        assert f"below {caps['torch']}" in " ".join(doc.read_text().split()), doc.name


def test_the_newest_release_ci_tests_is_at_least_the_one_make_test_pins():
    def version(name: str) -> tuple[int, ...]:
        pin = re.search(rf"^{name} := torch==([\d.]+)$", (ROOT / "Makefile").read_text(), re.M)
        return tuple(int(part) for part in pin[1].split("."))

    assert version("TORCH_NEWEST") >= version("TORCH_DEV")


def oldest_pins() -> dict[str, str]:
    """``{name: version}`` pinned by the Makefile's OLDEST line."""
    line = re.search(r"^OLDEST := (.*)$", (ROOT / "Makefile").read_text(), re.M)[1]
    return dict(pin.split("==") for pin in line.split())


def test_every_floor_is_the_version_test_oldest_installs():
    assert oldest_pins() == declared_floors()


def test_ci_runs_the_oldest_then_the_newest_versions_after_the_readme_command():
    """The oldest versions' 5 GB go before the newest torch's 5.5 GB come unless the
    disk has room for both; the installs run beside make test, and CI waits for them
    (and fails on their failure) before going on."""
    text = (ROOT / ".ci" / "run").read_text()
    lines = text.splitlines()
    steps = [ln.strip().split(" >")[0] for ln in lines if ln.strip().startswith(("make", "rm"))]
    assert steps == [
        "make .venv-oldest/.installed",
        "make .venv-newest/.installed",
        "make install && make test || tested=$?",
        "make test-oldest",
        "rm -rf .venv-oldest",
        "make test-newest",
    ]
    assert 'if [ "$free_gb" -ge "$ROOM_FOR_BOTH_GB" ]; then' in text
    assert 'wait "$pid" || status=$?' in text
    assert '[ "$status" -eq 0 ] || exit "$status"' in text
    assert '[ "$tested" -eq 0 ] || exit "$tested"' in text


def test_readme_and_versions_page_state_the_floors():
    floors = declared_floors()
    for doc in (ROOT / "README.md", ROOT / "docs" / "how-to" / "versions.md"):
        text = " ".join(doc.read_text().split())
        for name, floor in floors.items():
            assert f"{name} {floor}" in text, f"{doc.name} does not state {name} {floor}"
