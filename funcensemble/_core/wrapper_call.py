"""Calling an ensemble's own module as the loop calls its members: global hooks skip it.

torch runs a global forward hook (``register_module_forward_hook``, its pre-hook kin) on
every module it calls. Inside an ensemble's call they run on the members' modules, as
in the loop over members; the ensemble itself is a module the loop never calls, so a
hook that changes what it is given (scales an output, shifts an input) would be applied
once more to all members. The ensemble's call skips them, and runs its own hooks (on
``ens`` itself) as torch does.
"""

from typing import Any

from torch import nn

from .. import _torch_compat


def call(module: nn.Module, where: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``module(*args, **kwargs)``, without torch's global forward hooks on ``module``."""
    if not _torch_compat.global_forward_hooks():
        return nn.Module.__call__(module, *args, **kwargs)
    if (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    ):
        raise ValueError(
            f"{where}: a global forward hook is set (register_module_forward_hook or "
            f"register_module_forward_pre_hook) and this {type(module).__name__} has "
            "hooks of its own (expected one or the other). The global hook runs on the "
            "members' modules, as in a loop over the members; torch would also run it "
            f"on the {type(module).__name__} itself, applying it once more to every "
            "member, so the call skips it there, which torch cannot do while running "
            f"the {type(module).__name__}'s own hooks. Remove its own hooks while the "
            "global hook is set, or register the hook on its modules (ens.stacked) "
            "instead of globally."
        )
    # What torch's call runs when no hook is set.
    return _torch_compat.unhooked_forward(module)(*args, **kwargs)
