"""Parametrizations and pruning, which must be the members' own: added to an ensemble's
module after it was built, they would act on all members' stacked tensor at once.

``weight_norm`` on a stacked ``[N, out, in]`` weight takes one norm per member instead
of one per row, ``spectral_norm`` one spectral norm over all members, and a pruning
method one threshold over all members. Members built with them are stacked with them
(each member's tensors, run per member); a change to the ensemble's module afterwards
(added, removed, or another kind) is refused at the next call, before anything runs.
"""

from torch import nn
from torch.nn.utils import parametrize, prune

from .._messages import submodule

Transforms = frozenset[tuple[str, str, tuple[str, ...]]]


def of(skeleton: nn.Module) -> Transforms:
    """The parametrizations and pruning methods on ``skeleton``'s tensors, by module
    path and tensor name."""
    out = set()
    for path, m in skeleton.named_modules():
        if parametrize.is_parametrized(m):
            for name, chain in m.parametrizations.items():
                out.add((path, name, tuple(type(p).__qualname__ for p in chain)))
        for hook in m._forward_pre_hooks.values():
            if isinstance(hook, prune.BasePruningMethod):
                out.add((path, str(getattr(hook, "_tensor_name", "?")), ("pruning",)))
    return frozenset(out)


def check_unchanged(where: str, skeleton: nn.Module, built: Transforms) -> None:
    """Refuse a call after the skeleton's parametrizations or pruning changed."""
    now = of(skeleton)
    if now == built:
        return
    changed = sorted(now ^ built)
    path, name, kinds = changed[0]
    what = "pruning" if kinds == ("pruning",) else f"a parametrization ({', '.join(kinds)})"
    verb = "added to" if changed[0] in now else "removed from"
    raise ValueError(
        f"{where}: {what} was {verb} `{name}` of {submodule(path)} after the ensemble was "
        "built (expected the parametrizations and pruning the members were built with): "
        "on the stacked tensor it acts on all members at once (weight_norm takes one norm "
        "per member instead of one per row, pruning one threshold over all members), not "
        "on each member's. Apply it to each member before building the ensemble, or build "
        "a new one from the members (fe.Ensemble(ens.unstack()) after changing them)."
    )
