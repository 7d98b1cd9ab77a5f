"""Submodules registered under several names, whose tensors ``functional_call`` leaks.

A member may hold one submodule under two names (``self.c = self.a``, or one layer at
two places of an ``nn.Sequential``). ``torch.func.functional_call(...,
tie_weights=True)`` then swaps that module's tensors once per name, and puts back, for
the second name, the tensor it swapped in for the first: after the call the skeleton
holds one member's batched tensor instead of its own (an ``Ensemble``'s stacked
parameters vanish from ``parameters()``, and the next call fails inside ``vmap``). The
call itself computes the right values, so putting those slots back afterwards is all
it takes.
"""

import contextlib
from collections.abc import Iterator

from torch import nn


def aliased_slots(module: nn.Module) -> list[tuple[dict, str]]:
    """The parameter and buffer slots of the submodules reachable under more than one name."""
    seen: dict[int, tuple[nn.Module, int]] = {}
    for _, sub in module.named_modules(remove_duplicate=False):
        seen[id(sub)] = (sub, seen[id(sub)][1] + 1 if id(sub) in seen else 1)
    return [
        (table, name)
        for sub, count in seen.values()
        if count > 1
        for table in (sub._parameters, sub._buffers)
        for name in table
    ]


@contextlib.contextmanager
def kept(module: nn.Module) -> Iterator[None]:
    """Put back what the aliased submodules of ``module`` hold when the block exits."""
    saved = [(table, name, table[name]) for table, name in aliased_slots(module)]
    try:
        yield
    finally:
        for table, name, value in saved:
            table[name] = value
