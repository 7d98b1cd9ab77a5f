"""``EnsembleOptimizer``: a functional optimizer stepping an Ensemble in place, torch-style."""

from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from torch import Tensor

from .._core.tree_view import Stacked, adapted, state_view
from .._messages import a, expected_got, key_difference
from .._types import StackedTensor
from ._protocol import GradientTransformation, PyTree, flatten


def _state_keys(spec: optree.PyTreeSpec) -> list[str]:
    return [path.codify("state") for path in optree.treespec_accessors(spec)]


def _describe(value: object) -> str:
    if value is None:
        return "None"
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return a(type(value).__name__)


class EnsembleOptimizer:
    """Step stacked parameters in place, for a training loop that calls ``loss.backward()``.

    It behaves like a ``torch.optim.Optimizer`` over the ensemble's stacked ``[N, ...]``
    parameters: ``step()`` reads each parameter's ``.grad`` (skipping parameters whose
    ``.grad`` is None) and steps the parameters and the state in place with the
    transform's [`update_`][funcensemble.optim.GradientTransformation.update_]
    (``fe.optim.adam``'s runs ``torch.optim.Adam(fused=True)``'s kernel where it can).
    Its state is ``transform``'s state, in ``self.state``. Learning-rate schedules are
    given to the transform as a callable ``lr`` (such as
    [`warmup_cosine`][funcensemble.optim.warmup_cosine], per member if need be);
    ``torch.optim.lr_scheduler`` classes do not apply.

    Args:
        params: An [`Ensemble`][funcensemble.Ensemble] (its stacked parameters are
            stepped), a [`HeteroEnsemble`][funcensemble.HeteroEnsemble] (each group's,
            the transform run per group as by its
            [`optimizer`][funcensemble.HeteroEnsemble.optimizer]) or a mapping of names
            to parameter tensors (e.g. the ``params`` of [`stack`][funcensemble.stack]).
        transform: The optimizer, e.g. ``fe.optim.adam(lr=1e-3)``.

    Example:
        >>> import torch, funcensemble as fe
        >>> ens = fe.Ensemble([torch.nn.Linear(3, 1) for _ in range(4)])
        >>> opt = fe.optim.EnsembleOptimizer(ens, fe.optim.adam(lr=0.1))
        >>> before = ens.stacked.bias.detach().clone()
        >>> opt.zero_grad()
        >>> ens(torch.randn(8, 3)).sum().backward()  # the members' losses add up
        >>> opt.step()
        >>> torch.allclose((ens.stacked.bias - before).abs(), torch.full((4, 1), 0.1))
        True
    """

    def __init__(
        self,
        params: Stacked | Mapping[str, StackedTensor],
        transform: GradientTransformation,
    ) -> None:
        where = "EnsembleOptimizer"
        view = state_view(params)  # an Ensemble stands for its stacked parameters
        if view is not None:
            named = dict(view["params"])
        elif isinstance(params, Mapping):
            named = dict(params)
            for name, p in named.items():
                if not isinstance(p, Tensor) or not p.is_leaf:
                    raise TypeError(
                        f"{where}: parameter `{name}` must be a leaf tensor (an "
                        f"nn.Parameter or a tensor from fe.stack), got "
                        f"{type(p).__name__ if not isinstance(p, Tensor) else 'a non-leaf tensor'}."
                    )
        else:
            raise TypeError(
                f"{where}: Expected an Ensemble or a mapping of names to stacked parameters, "
                f"got {type(params).__name__}."
            )
        if not isinstance(transform, GradientTransformation):
            raise TypeError(
                f"{where}: Expected a GradientTransformation such as fe.optim.adam(), got "
                f"{type(transform).__name__}."
            )
        # A HeteroEnsemble runs the transform group by group (see HeteroEnsemble.optimizer).
        transform = adapted(params, transform)
        self.params: dict[str, Tensor] = named
        self.transform = transform
        with torch.no_grad():
            self.state: Any = transform.init(named)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset every parameter's ``.grad``: to None, or to zeros if ``set_to_none=False``."""
        for p in self.params.values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().requires_grad_(False).zero_()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update the parameters in place from their ``.grad``.

        Args:
            closure: Optional; re-evaluates the loss (with gradients) and returns it.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads: PyTree = {}
        for name, p in self.params.items():
            if p.grad is not None and p.grad.is_sparse:
                raise RuntimeError(
                    f"EnsembleOptimizer.step: `{name}` has a sparse gradient, which is not "
                    "supported; use dense gradients (e.g. nn.Embedding(sparse=False))."
                )
            grads[name] = p.grad
        self.state = self.transform.update_(grads, self.state, self.params)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state as ``{"state": {path: tensor or None}}``.

        Plain dicts and tensors only, so ``torch.save`` and ``torch.load(...,
        weights_only=True)`` take it. As with ``torch.optim``, the tensors are the live
        state's, not copies: ``step()`` updates them in place, so clone them to keep a
        snapshot of this step's values.
        """
        leaves, spec = flatten(self.state)
        return {"state": dict(zip(_state_keys(spec), leaves, strict=True))}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state saved by [`state_dict`][funcensemble.optim.EnsembleOptimizer.state_dict].

        Everything is checked before anything changes; tensors are copied to the current
        state's device and dtype.

        Raises:
            ValueError: Keys, shapes or missing tensors that do not match this optimizer
                (a different transform or parameter set).
        """
        where = "EnsembleOptimizer.load_state_dict"
        if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping):
            wanted = "the dict returned by state_dict(), {'state': {...}}"
            raise TypeError(
                f"{where}: this is not an optimizer state "
                f"{expected_got(wanted, type(state_dict).__name__)}. Pass what "
                "EnsembleOptimizer.state_dict() returned."
            )
        loaded = state_dict["state"]
        leaves, spec = flatten(self.state)
        keys = _state_keys(spec)
        difference = key_difference(set(keys) - set(loaded), set(loaded) - set(keys))
        if difference:
            raise ValueError(
                f"{where}: the state does not match this optimizer: it {difference}. It was "
                "saved from a different transform or set of parameters."
            )
        new = []
        for key, mine in zip(keys, leaves, strict=True):
            value = loaded[key]
            if mine is None or value is None:
                if mine is not value:
                    raise ValueError(
                        f"{where}: `{key}` does not match this optimizer's state "
                        f"{expected_got(_describe(mine), _describe(value))}. It was saved "
                        "from a different transform or set of parameters."
                    )
                new.append(None)
                continue
            if not isinstance(value, Tensor) or value.shape != mine.shape:
                raise ValueError(
                    f"{where}: `{key}` does not match this optimizer's state "
                    f"{expected_got(_describe(mine), _describe(value))}. It was saved with a "
                    "different member count or architecture."
                )
            new.append(value.detach().to(device=mine.device, dtype=mine.dtype, copy=True))
        self.state = spec.unflatten(new)

    def __repr__(self) -> str:
        return f"EnsembleOptimizer({len(self.params)} stacked parameters)"
