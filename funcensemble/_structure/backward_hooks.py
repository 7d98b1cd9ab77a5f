"""Module backward hooks, which never run for members: refused, never dropped.

Every member runs inside ``torch.func.vmap``, where the tensors a module sees report
``requires_grad=False``; ``nn.Module.__call__`` then leaves out its backward hooks
(``register_full_backward_hook``, ``register_full_backward_pre_hook``,
``register_backward_hook``, and their global ``register_module_*`` forms) without a
word, and a hook that changes a gradient would leave the members' gradients silently
unlike the plain modules'. So members carrying one are refused when an ensemble is
built, and a call refuses one added later (on the skeleton, or globally).
"""

from torch import nn

from .. import _torch_compat
from .._messages import submodule

_TABLES = {"_backward_pre_hooks": "backward pre-hook", "_backward_hooks": "backward hook"}

HINT = (
    "Module backward hooks (register_full_backward_hook, register_full_backward_pre_hook, "
    "register_backward_hook) do not run inside torch.func.vmap, which runs every member, "
    "so the members' gradients would silently differ from their own modules'. Remove the "
    "hook and apply its change outside the members: in the loss, with a hook on the "
    "Ensemble itself or on its stacked output (out.register_hook), or on the stacked "
    "gradients after backward."
)


def kind_on(module: nn.Module) -> str | None:
    """The kind of backward hook registered on ``module`` itself, if any."""
    tables = vars(module)
    return next((kind for table, kind in _TABLES.items() if tables.get(table)), None)


def member_error(where: str, index: int, kind: str, path: str) -> ValueError:
    """The refusal of member ``index`` for its ``kind`` of hook on submodule ``path``."""
    return ValueError(f"{where}: member {index} has a {kind} on {submodule(path)}. {HINT}")


def check_call(where: str, skeleton: nn.Module) -> None:
    """Refuse a call inside ``vmap`` whose hooks would not run: a backward hook added to
    the skeleton after the ensemble was built, or a global module backward hook."""
    if _torch_compat.global_backward_hooks():
        raise ValueError(
            f"{where}: a global module backward hook is registered "
            "(torch.nn.modules.module.register_module_full_backward_hook, "
            "register_module_full_backward_pre_hook or register_module_backward_hook); it "
            "would not run for the members, which run inside torch.func.vmap, and their "
            "gradients would silently differ from their own modules'. Remove it "
            "(handle.remove()) while the ensemble runs, or apply its change outside the "
            "members (in the loss, or on the stacked gradients after backward)."
        )
    for path, sub in skeleton.named_modules():
        kind = kind_on(sub)
        if kind is not None:
            raise ValueError(
                f"{where}: the ensemble's module has a {kind} on {submodule(path)}, added "
                f"after the ensemble was built. {HINT}"
            )
