"""How a container of stacked tensors shows itself as a pytree to the layers below it.

The optimizer layer (``EnsembleOptimizer``, Polyak averaging) works on pytrees and
imports nothing above it; a container such as ``Ensemble`` registers a view of itself
here (its stacked parameters and buffers), and those functions accept it through
the view.
"""

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

View = dict[str, dict[str, Tensor]]


@runtime_checkable
class Stacked(Protocol):
    """A container of stacked ``[N, ...]`` tensors, such as an ``Ensemble``."""

    def stacked_params(self) -> Any: ...

    def stacked_buffers(self) -> Any: ...


_VIEWS: dict[type, Callable[[Any], View]] = {}
_ADAPTERS: dict[type, Callable[[Any, Any], Any]] = {}


def register_view(
    cls: type, view: Callable[[Any], View], *, adapt: Callable[[Any, Any], Any] | None = None
) -> None:
    """Let instances of ``cls`` stand for ``view(x)``: ``{"params": ..., "buffers": ...}``.

    ``adapt(x, transform)``, if given, is the optimizer to run over ``x``'s view in
    place of ``transform`` (a container whose leaves are not all one member axis runs
    it part by part).
    """
    _VIEWS[cls] = view
    if adapt is not None:
        _ADAPTERS[cls] = adapt


# Containers no view is registered for: looked up by their exact type first, which
# torch.compile traces (it cannot iterate a builtin type's __mro__ under fullgraph).
_PLAIN = (dict, list, tuple)


def adapted(x: object, transform: Any) -> Any:
    """The optimizer to run over ``x``'s view: ``transform`` as ``x``'s class adapts it."""
    if type(x) in _PLAIN:
        return transform
    for cls in type(x).__mro__:
        adapt = _ADAPTERS.get(cls)
        if adapt is not None:
            return adapt(x, transform)
    return transform


def state_view(x: object) -> View | None:
    """``x``'s registered view (its stacked parameters and buffers), or None."""
    if type(x) in _PLAIN:
        return None
    for cls in type(x).__mro__:
        view = _VIEWS.get(cls)
        if view is not None:
            return view(x)
    return None
