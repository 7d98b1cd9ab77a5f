"""Naming the layer a failed vectorized forward broke on.

Under ``vmap`` a wrong input width fails deep inside a batched matrix product whose
message shows the members folded into the shapes (``(30x4 and 3x20)``) and names
neither the input nor the layer. When a forward fails, it is run once more for one
member on the meta device (no data, nothing of the caller's touched), with a
pre-hook on every ``nn.Linear`` of a hook-free copy of the module: the first one fed
an input of the wrong width is reported by its state-dict path. Nothing runs on the
success path.
"""

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .. import _torch_compat
from .._kernels.fastpath import _has_hooks, width_error
from .._tree import leaves as tree_leaves
from .._tree import tree_map
from .skeleton import meta_skeleton


class _Found(Exception):
    """Stops the meta run at the layer found."""


def _meta(x: Any) -> Any:
    # A tensor's shape as one member sees it (under vmap, the logical shape).
    return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, Tensor) else x


def linear_width_error(
    where: str, skeleton: nn.Module, params: Any, buffers: Any, args: Any, kwargs: Any
) -> ValueError | None:
    """The wrong-width Linear a forward of one member reaches, or ``None``."""
    if _torch_compat.global_module_hooks() or any(_has_hooks(m) for m in skeleton.modules()):
        return None  # a hook may reshape inputs: the meta run could mislead
    found: list[str] = []
    names: dict[int, str] = {}
    meta_args, meta_kwargs = tree_map(_meta, args), tree_map(_meta, kwargs)
    # A Linear fed one of the call's own inputs, as it is: that input has the wrong width.
    inputs = {id(t) for t in tree_leaves((meta_args, meta_kwargs)) if isinstance(t, Tensor)}

    def check(module: nn.Module, given: tuple[Any, ...]) -> None:
        x = given[0] if given else None
        if isinstance(x, Tensor) and x.dim() >= 1 and x.shape[-1] != module.weight.shape[-1]:
            prefix = names[id(module)]
            weight = f"{prefix}.weight" if prefix else "weight"
            shape = tuple(module.weight.shape)
            found.append(width_error(where, weight, shape, x.shape[-1], first=id(x) in inputs))
            raise _Found

    try:
        copy = meta_skeleton(skeleton)
        names.update((id(m), name) for name, m in copy.named_modules())
        for module in copy.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_pre_hook(check)
            if isinstance(module, nn.modules.batchnorm._NormBase):
                # Shapes alike in both modes; in train mode with momentum=None the
                # layer reads its step count as a number, which a meta tensor has not.
                module.eval()
        with torch.no_grad():
            functional_call(
                copy,
                (tree_map(_meta, params), tree_map(_meta, buffers)),
                meta_args,
                meta_kwargs,
                tie_weights=True,
                strict=False,
            )
    except _Found:
        return ValueError(found[0])
    except Exception:  # the meta run failed otherwise: report the original error
        return None
    return None
