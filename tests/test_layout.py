"""The package's layout rules that a grep can check."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "funcensemble"

# torch's private internals, reached only through funcensemble/_torch_compat.py.
_PRIVATE_TORCH = re.compile(r"torch\._C\b|torch\._functorch\b|_pytree\b|from torch import _C\b")


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
