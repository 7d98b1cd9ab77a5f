"""Refusing modules whose extra state a checkpoint would not hold.

``fe.save``/``fe.load`` and ``fe.distributed.save``/``load`` store an ensemble's
parameters and buffers. A module that overrides ``get_extra_state`` keeps more in its
``state_dict()``: saving would drop it, and loading would leave the ensemble's own in
place of the saved one (a tensor of it is made afresh by each ``state_dict()`` call,
so writing into it reaches nothing). Such an ensemble is refused before anything is
written or changed.
"""

from collections.abc import Iterable

from torch import nn

from .._messages import submodule


def refuse_extra_state(where: str, modules: Iterable[tuple[str, nn.Module]]) -> None:
    """Raise ``TypeError`` naming the first of ``modules`` that keeps extra state.

    Example:
        >>> import torch
        >>> refuse_extra_state("save", torch.nn.Linear(2, 2).named_modules())  # none kept
    """
    for path, module in modules:
        if type(module).get_extra_state is not nn.Module.get_extra_state:
            what = (
                "saving would drop it"
                if where.endswith("save")
                else ("loading would keep this ensemble's own")
            )
            raise TypeError(
                f"{where}: {submodule(path)} ({type(module).__name__}) keeps extra state "
                f"(get_extra_state), which a checkpoint file does not hold (expected "
                f"parameters and buffers only), so {what}. Save ens.state_dict() with "
                "torch.save (across ranks, with torch.distributed.checkpoint's dcp.save) "
                "and restore it with ens.load_state_dict(), which carry it."
            )
