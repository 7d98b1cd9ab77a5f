"""The ensembles' own call keywords against the members' ``forward`` parameters.

``ens(x, in_dims=0)`` takes ``in_dims`` for itself (and a ``HeteroEnsemble`` also
``stack``): a member whose ``forward`` has a parameter of that name never receives it,
and would run with its own default where the loop's ``m(x, in_dims=0)`` passes it.
Such a call is refused instead, whichever of the two was meant. The member's names are
read once, when the ensemble is built (a compiled call reads them as a constant).
"""

import inspect
from typing import Any

from torch import nn

OWN = ("in_dims", "stack")  # every keyword an ensemble's call takes for itself
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def taken_by_forward(module: nn.Module) -> tuple[str, ...]:
    """The ensembles' own keywords that ``module.forward`` also names as parameters.

    Example:
        >>> import torch
        >>> taken_by_forward(torch.nn.Linear(2, 2))
        ()
    """
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):  # no signature to read (a builtin): no clash known
        return ()
    names = {p.name for p in signature.parameters.values() if p.kind in _NAMED}
    return tuple(name for name in OWN if name in names)


def refuse_clash(
    where: str, own: tuple[str, ...], taken: tuple[str, ...], forward: str, kwargs: dict[str, Any]
) -> None:
    """Raise if ``kwargs`` passes one of ``own`` that the members' ``forward`` takes.

    Example:
        >>> refuse_clash("Ensemble", ("in_dims",), (), "Linear.forward", {"in_dims": 0})
    """
    for name in own:
        if name in taken and name in kwargs:
            raise ValueError(
                f"{where}: {name}= is both the {where}'s own keyword and a parameter "
                f"of the members' forward ({forward}), so the call cannot tell which is "
                "meant (expected a keyword that names only one of them); the loop's "
                f"m(..., {name}=...) passes it to the member. Pass the member's {name} "
                f"positionally, rename that parameter of {forward}, or call the members "
                "through fe.vmap, whose calls take no keywords of their own."
            )
