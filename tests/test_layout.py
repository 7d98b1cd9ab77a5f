"""The package's layout rules that a grep can check."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "funcensemble"

# torch's private internals, reached only through funcensemble/_torch_compat.py.
_PRIVATE_TORCH = re.compile(
    r"torch\._C\b|torch\._functorch\b|torch\.utils\._|_pytree\b|from torch import _C\b"
)


def test_torch_internals_only_in_torch_compat():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_torch_compat.py"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if _PRIVATE_TORCH.search(line)
    ]
    assert not offenders, (
        "torch._C / torch._functorch / torch.utils._pytree used outside "
        "funcensemble/_torch_compat.py (add a named helper there):\n" + "\n".join(offenders)
    )


def test_the_inventory_names_every_private_call_the_seam_makes():
    source = (PACKAGE / "_torch_compat.py").read_text()
    docstring, code = source.split('"""', 2)[1], source.split('"""', 2)[2]
    used = set(re.findall(r'_require\(\s*\w+,\s*"(\w+)"', code))
    assert used, "no _require(...) lookups found"
    missing = sorted(name for name in used if name not in docstring)
    assert not missing, f"_torch_compat's docstring inventory does not list {missing}"


# The package's layout (README, "Layout"): a few top-level modules, the rest grouped.
_TOP_LEVEL = {
    "__init__.py",
    "_bagging.py",
    "_gaussian_mixture.py",
    "_messages.py",
    "_reduce.py",
    "_sample_weights.py",
    "_torch_compat.py",
    "_tree.py",
    "_types.py",
    "reduce.py",
}
_GROUPS = {"_checkpoint", "_core", "_hetero", "_kernels", "_structure", "distributed", "optim"}


def test_modules_live_in_their_groups():
    top = {p.name for p in PACKAGE.glob("*.py")}
    assert top <= _TOP_LEVEL, (
        f"new top-level modules {sorted(top - _TOP_LEVEL)}: put them in one of the groups "
        f"{sorted(_GROUPS)} (README, 'Layout'), or list them here if they belong at the top"
    )
    groups = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert groups == _GROUPS
    for group in groups:
        init = PACKAGE / group / "__init__.py"
        assert init.exists() and init.read_text().startswith('"""'), f"{group} needs a docstring"
