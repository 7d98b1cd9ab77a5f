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
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

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
            elif isinstance(hook, (WeightNorm, SpectralNorm)):  # the hook-based forms
                kind = _LEGACY[0] if isinstance(hook, WeightNorm) else _LEGACY[1]
                out.add((path, str(getattr(hook, "name", "?")), (kind,)))
    return frozenset(out)


# The hook-based reparametrizations (stack refuses members built with them).
_LEGACY = ("torch.nn.utils.weight_norm", "torch.nn.utils.spectral_norm")


def check_unchanged(where: str, skeleton: nn.Module, built: Transforms) -> None:
    """Refuse a call after the skeleton's parametrizations or pruning changed."""
    now = of(skeleton)
    if now == built:
        return
    changed = sorted(now ^ built)
    path, name, kinds = changed[0]
    legacy = kinds[0] in _LEGACY
    plain = legacy or kinds == ("pruning",)
    what = kinds[0] if plain else f"a parametrization ({', '.join(kinds)})"
    verb = "added to" if changed[0] in now else "removed from"
    fix = (
        "Use torch.nn.utils.parametrizations." + kinds[0].rsplit(".", 1)[1] + " on each "
        "member before building the ensemble (the hook-based form cannot be stacked)"
        if legacy
        else "Apply it to each member before building the ensemble"
    )
    raise ValueError(
        f"{where}: {what} was {verb} `{name}` of {submodule(path)} after the ensemble was "
        "built (expected the parametrizations and pruning the members were built with): "
        "on the stacked tensor it acts on all members at once (weight_norm takes one norm "
        "per member instead of one per row, pruning one threshold over all members), not "
        f"on each member's. {fix}, or build a new one from the members "
        "(fe.Ensemble(ens.unstack()) after changing them)."
    )
