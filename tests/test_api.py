"""The public surface is pinned: ``__all__`` lists exactly what docs/api.md documents."""

import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from types import ModuleType

import pytest

import funcensemble as fe

API_PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"
_ENTRY = re.compile(r"^::: funcensemble\.([\w.]+)\s*$", re.MULTILINE)
_EXAMPLE = re.compile(r"^\s*Examples?:\s*$", re.MULTILINE)


def documented() -> list[str]:
    """Dotted names after ``funcensemble.`` in the API page's ``:::`` lines, in order."""
    return _ENTRY.findall(API_PAGE.read_text())


def public_submodules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(fe.__path__) if not m.name.startswith("_"))


def namespaces() -> dict[str, ModuleType]:
    found = {"funcensemble": fe}
    for name in public_submodules():
        found[f"funcensemble.{name}"] = importlib.import_module(f"funcensemble.{name}")
    return found


def test_api_page_lists_each_name_once():
    names = documented()
    assert names, f"{API_PAGE} has no `::: funcensemble.X` entries"
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_top_level_all_matches_the_api_page():
    expected = {n for n in documented() if "." not in n}
    # A public submodule (fe.reduce) is documented through its members instead.
    got = set(fe.__all__) - set(public_submodules())
    assert got == expected, (
        f"in __all__ but not in docs/api.md: {sorted(got - expected)}; "
        f"in docs/api.md but not in __all__: {sorted(expected - got)}"
    )


@pytest.mark.parametrize("sub", public_submodules())
def test_submodule_all_matches_the_api_page(sub):
    module = importlib.import_module(f"funcensemble.{sub}")
    assert getattr(fe, sub) is module, f"funcensemble/__init__.py should import `{sub}`"
    expected = {n.split(".", 1)[1] for n in documented() if n.split(".")[0] == sub}
    got = set(module.__all__)
    assert got == expected, (
        f"in funcensemble.{sub}.__all__ but not in docs/api.md: {sorted(got - expected)}; "
        f"in docs/api.md but not in __all__: {sorted(expected - got)}"
    )


def test_no_undocumented_dotted_entries():
    subs = set(public_submodules())
    stray = [n for n in documented() if "." in n and n.split(".")[0] not in subs]
    assert not stray, f"docs/api.md documents names outside the public namespaces: {stray}"


@pytest.mark.parametrize("namespace", sorted(namespaces()))
def test_all_is_sorted_and_importable(namespace):
    module = namespaces()[namespace]
    assert module.__all__ == sorted(module.__all__), f"{namespace}.__all__ is not sorted"
    for name in module.__all__:
        assert hasattr(module, name), f"{namespace}.__all__ lists missing name `{name}`"


def public_objects() -> list[tuple[str, object]]:
    return [
        (f"{ns}.{name}", getattr(module, name))
        for ns, module in sorted(namespaces().items())
        for name in module.__all__
        if not inspect.ismodule(getattr(module, name))
    ]


@pytest.mark.parametrize(("name", "obj"), public_objects(), ids=[n for n, _ in public_objects()])
def test_public_name_has_a_docstring_with_an_example(name, obj):
    doc = inspect.getdoc(obj)
    assert doc, f"{name} has no docstring"
    assert _EXAMPLE.search(doc), f"{name}'s docstring has no `Example:` section"
    assert ">>>" in doc, f"{name}'s `Example:` section has no runnable `>>>` lines"
