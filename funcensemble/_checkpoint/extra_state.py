"""Refusing modules whose extra state a checkpoint would not hold.

``fe.save``/``fe.load`` and ``fe.distributed.save``/``load`` store an ensemble's
parameters and buffers. A module can keep more in its ``state_dict()``: extra state
(``get_extra_state``), or entries its own ``_save_to_state_dict`` or a state-dict hook
adds. Saving would drop them, and loading would leave the ensemble's own in place of
the saved ones (a tensor of them is made afresh by each ``state_dict()`` call, so
writing into it reaches nothing). Such an ensemble is refused before anything is
written or changed.
"""

from torch import nn

from .._messages import submodule

_ADVICE = (
    "Save ens.state_dict() with torch.save (across ranks, with "
    "torch.distributed.checkpoint's dcp.save) and restore it with ens.load_state_dict(), "
    "which carry it."
)


def refuse_extra_state(where: str, root: nn.Module, prefix: str = "") -> None:
    """Raise ``TypeError`` if ``root``'s ``state_dict()`` holds more than its parameters
    and persistent buffers, naming the module or the entry (``prefix``: the ensemble's
    name for ``root`` in its own ``state_dict()``).

    Example:
        >>> import torch
        >>> refuse_extra_state("save", torch.nn.Linear(2, 2))  # nothing more: no error
    """
    what = (
        "saving would drop it"
        if where.endswith("save")
        else "loading would keep this ensemble's own"
    )
    expected = set()
    for path, module in root.named_modules(remove_duplicate=False):
        if type(module).get_extra_state is not nn.Module.get_extra_state:
            raise TypeError(
                f"{where}: {submodule(path)} ({type(module).__name__}) keeps extra state "
                f"(get_extra_state), which a checkpoint file does not hold (expected "
                f"parameters and buffers only), so {what}. {_ADVICE}"
            )
        here = f"{path}." if path else ""
        expected.update(here + k for k, p in module._parameters.items() if p is not None)
        expected.update(
            here + k
            for k, b in module._buffers.items()
            if b is not None and k not in module._non_persistent_buffers_set
        )
    extra = sorted(set(root.state_dict(keep_vars=True)) - expected)
    if extra:
        raise TypeError(
            f"{where}: state_dict() holds `{prefix}{extra[0]}`"
            + (f" and {len(extra) - 1} more" if len(extra) > 1 else "")
            + ", neither a parameter nor a buffer (a module's own _save_to_state_dict or a "
            "state-dict hook adds it), which a checkpoint file does not hold (expected "
            f"parameters and buffers only), so {what}. {_ADVICE}"
        )
