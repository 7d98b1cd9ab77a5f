"""The test run's runtime type checks: jaxtyping + beartype on funcensemble's public face.

Loaded as a pytest plugin (``-p tests.public_typecheck`` in pyproject.toml), before
anything imports funcensemble. It installs jaxtyping's import hook, as jaxtyping's own
``--jaxtyping-packages=funcensemble,beartype.beartype`` option does, with its transformer
restricted to what a user calls: module-level functions, classes, and methods whose
names are not private (``_name``; dunders such as ``__init__`` and ``__call__`` are
kept). Every one of those is checked at every call, its jaxtyping shapes included.

Left unwrapped: private helpers and functions defined inside functions. jaxtyping's own
option wraps those too, and beartype decorates a nested function anew each time the
function around it runs: on the property tests that came to a third of the run time
(1.3 million wrapped calls, 19,000 decorations for 121 cases), for checks of internal
annotations that the public calls around them check already.
"""

import ast
from typing import Any

from jaxtyping import _import_hook


def _checked(node: ast.FunctionDef | ast.AsyncFunctionDef, parents: list[ast.AST]) -> bool:
    nested = any(isinstance(p, ast.FunctionDef | ast.AsyncFunctionDef) for p in parents)
    dunder = node.name.startswith("__") and node.name.endswith("__")
    return not nested and (dunder or not node.name.startswith("_"))


class _PublicFace(_import_hook.JaxtypingTransformer):
    """jaxtyping's transformer, decorating only the functions ``_checked`` keeps."""

    def visit_FunctionDef(self, node: ast.FunctionDef) -> Any:
        if _checked(node, self._parents):
            return super().visit_FunctionDef(node)
        self._parents.append(node)
        self.generic_visit(node)  # (functions inside it are nested: not decorated)
        self._parents.pop()
        return node


_cache_path = _import_hook._optimized_cache_from_source


def _own_cache_path(typechecker_hash: str, /, path: str, debug_override: Any = None) -> str:
    """Bytecode cached apart from that of jaxtyping's own option (which wraps more)."""
    return _cache_path(f"{typechecker_hash}public", path, debug_override)


_import_hook.JaxtypingTransformer = _PublicFace  # (the loader looks it up at each import)
_import_hook._optimized_cache_from_source = _own_cache_path
_import_hook.install_import_hook("funcensemble", "beartype.beartype")
